"""Throughput, peaks, the console table and W&B."""
