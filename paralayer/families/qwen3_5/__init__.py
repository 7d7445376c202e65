"""Qwen3.5 (transformers 5.25 models/qwen3_5 and qwen3_5_moe): Qwen3-Next's hybrid of Gated DeltaNet
and gated full-attention layers (paralayer/families/qwen3_next.py), as two families, dense
(``Qwen3_5ForCausalLM``, text.py) and MoE (``Qwen3_5MoeForCausalLM``, moe.py). What differs from
Qwen3-Next, each read from transformers' modular_qwen3_5*.py and checked against its classes
(tests/test_qwen3_5.py):

- the linear layers' projections are stored split, ``in_proj_qkv`` ([q | k | v] over all heads) /
  ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, where Qwen3-Next interleaves them per k-head in
  ``in_proj_qkvz`` / ``in_proj_ba``: the same rows in another order (checkpoint/hf_split.py); the
  conv's channels are [q | k | v] over all heads in both, so ``conv1d`` is read as it is;
- the published configs are the vision-language ``qwen3_5`` / ``qwen3_5_moe`` whose ``text_config``
  is the text model and whose text tower's weights sit under ``model.language_model.``: both
  wrappers are read (text tower only; the vision tower and the MTP block are not read, as
  transformers' own Qwen3_5ForCausalLM ignores them), the export is the text class;
- RoPE is interleaved multimodal (``mrope_section``): for text every position row is the same, so
  it is plain partial RoPE (text_config.py);
- the dense family has a dense MLP on every layer; the MoE family an MoE on every layer with the
  top-k always renormalised and the gated shared expert (the class dropped Qwen3-Next's
  ``decoder_sparse_step``, ``mlp_only_layers`` and ``norm_topk_prob``: a config asking otherwise is
  refused by name);
- the class defaults (dense: 4096 wide, 32 layers, 4 KV heads; MoE: 2048, 40 layers, 2 KV heads, 256
  experts top-8; both vocab 248320), and tied embeddings are exported (Qwen3.5's small sizes tie).
Norms ((1 + w) zero-centred, the gated norm with plain w), the gated attention, head_dim 256,
partial_rotary_factor 0.25 and full_attention_interval 4 are Qwen3-Next's. Torch-free."""
