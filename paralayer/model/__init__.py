"""The model in parts, each once: RoPE kinds (positions.py), norms, attention (plain or windowed) and
latent attention (MLA), the SwiGLU MLP, mixture of experts and its routers (moe.py, routing.py),
multi-token prediction (mtp.py); block.py assembles a decoder block from the config and
transformer.py the decoder. The same parts build Llama, Mistral, Qwen3, Qwen3-MoE, Mixtral and
DeepSeek-V3."""
