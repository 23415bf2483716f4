"""Weights on disk and in ZeRO: zero.Init loading, EMA, checkpoints, export, LoRA files."""
