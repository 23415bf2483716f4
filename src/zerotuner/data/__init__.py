"""The training data: scanned, captioned, bucketed, loaded and ordered the same way on every
rank and in `check` and `plan` (no torch; PIL, numpy and, for clips, PyAV).

- `scan`: every usable image or clip of the run's datasets into one Dataset (`scan_sources`),
  or their count from file names alone (`listed_samples`);
- `files`: which files under a data folder are read, and how (links, FIFOs, masks' names);
- `probe`: each file decoded once, and the scan index that remembers it between starts;
- `captions`: sidecars, metadata.jsonl, ZT_CAPTION_TEMPLATE and ZT_CAPTION_DROPOUT;
- `dataset`: what a scan found (`Item`, `Part`, `Dataset`) and its summary lines;
- `buckets`: the aspect buckets of a resolution and each item's bucket;
- `notes`: what the run's settings do to the dataset, for `check` and the log;
- `loading`: one item decoded, fitted to its bucket, for the VAE (`load_example`);
- `order`: the batches of each epoch for each rank, and the `Position` a resume starts from;
- `clips`: video clips (`Video` sampling, probing and decoding with PyAV).
"""
