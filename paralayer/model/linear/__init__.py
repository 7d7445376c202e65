"""Linear attention (Gated DeltaNet, Qwen3-Next / Qwen3.5): the delta rule in chunked form, the
short causal convolution before it, and the layer that assembles them with its gates and norm."""
