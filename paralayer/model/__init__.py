"""The plain Llama-style transformer (transformer.py) and its mixture-of-experts feed-forward (moe.py)."""
