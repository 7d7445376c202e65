"""Training data: tokenizers, the offline corpus, packing and sampling, `datasets` loading."""
