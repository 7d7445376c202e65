"""Training data: tokenizers.py, corpus.py (offline corpus), readers.py (formats, `datasets`),
dataset.py (packed + cached dataset), sampler.py (labels, global batches), cache.py (atomic
writes, lock files), preflight.py and errors.py (torch-free checks before launch)."""
