"""Optimizers beyond AdamW: Muon (Newton-Schulz on the blocks' matrices, AdamW for the rest), its
owners across data-parallel ranks, and QK-clip. runtime/optimizer.py builds them from the config."""
