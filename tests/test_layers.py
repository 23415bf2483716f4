"""The package's stages import one way (the import-linter contract in pyproject.toml), and no
module imports one that imports it back: the layout stays true after the next feature."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]


def test_the_stages_import_one_way():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_no_module_imports_one_that_imports_it_back():
    graph = grimp.build_graph("zerotuner")
    pairs = sorted(
        (a, b)
        for a in graph.modules
        for b in graph.find_modules_directly_imported_by(a)
        if a < b and a in graph.find_modules_directly_imported_by(b)
    )
    assert pairs == []
