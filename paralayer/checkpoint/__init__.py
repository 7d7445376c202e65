"""Weights on disk: DCP checkpoints (dcp.py), Hugging Face import/export (hf.py, export.py), expert keys."""
