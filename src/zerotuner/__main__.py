from zerotuner.cli import main

raise SystemExit(main())
