"""The per-field checks of a typed Config (types are already the schema's; layout rules live in
resolve/). Imports neither OmegaConf nor torch: the launcher's loading (load.py) and a rank's
plain read of resolved.yaml (plain.py) both end here."""
from __future__ import annotations

from typing import Any

from paralayer.config import model_checks
from paralayer.config.schema import (
    BACKENDS,
    COMPILE_BACKENDS,
    DATA_FORMATS,
    DEVICES,
    EP_DISPATCH,
    FP8_RECIPES,
    MUON_ADJUST_LR,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE,
    ROUTERS,
    SCHEDULES,
    WANDB_MODES,
    Config,
    ConfigError,
)
from paralayer.inputs import bounds


def _choice(field_name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(field_name, f"'{value}' is not one of: {', '.join(map(str, choices))}")


def _positive(field_name: str, value: Any, minimum: int = 1) -> None:
    if value is None or value < minimum:
        raise ConfigError(field_name, f"must be >= {minimum}, got {value}")


def validate_values(cfg: Config) -> None:
    """Per-field checks (types are already enforced by the schema); layout rules live in resolve/."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "seq_len"):
        _positive(f"model.{name}", getattr(m, name))
    _positive("model.moe.num_experts", m.moe.num_experts, 0)
    _positive("model.moe.top_k", m.moe.top_k)
    _positive("model.moe.every", m.moe.every)
    _positive("model.moe.ffn_hidden", m.moe.ffn_hidden, 0)
    if m.moe.capacity_factor is not None and m.moe.capacity_factor <= 0:
        raise ConfigError("model.moe.capacity_factor", f"must be > 0 or null (dropless), got {m.moe.capacity_factor}")
    _choice("model.moe.router", m.moe.router, ROUTERS)
    model_checks.check_model_keys(cfg)  # the family keys (head_dim, RoPE kinds, windows, MLA, MTP, groups)
    if not (m.init == "random" or m.init.startswith("hf:")):
        raise ConfigError("model.init", f"'{m.init}' is not one of: random, hf:PATH")
    for name in ("tp", "pp", "vpp", "cp", "ep"):
        _positive(f"parallel.{name}", getattr(p, name))
    if isinstance(p.dp, str):
        if p.dp != "auto":
            try:
                p.dp = int(p.dp)
            except ValueError:
                raise ConfigError("parallel.dp", f"'{p.dp}' is not a positive integer or 'auto'") from None
    if not isinstance(p.dp, str):
        if isinstance(p.dp, bool) or not isinstance(p.dp, int):
            raise ConfigError("parallel.dp", f"'{p.dp}' is not a positive integer or 'auto'")
        _positive("parallel.dp", p.dp)
    _choice("parallel.schedule", p.schedule, SCHEDULES)
    _choice("parallel.zero", p.zero, (0, 1, 2, 3))
    _choice("parallel.recompute", p.recompute, RECOMPUTE)
    if p.ep_dispatch is not None:
        _choice("parallel.ep_dispatch", p.ep_dispatch, EP_DISPATCH)
    if isinstance(p.recompute_every, bool) or not isinstance(p.recompute_every, int) \
            or not 1 <= p.recompute_every <= 1024:
        raise ConfigError("parallel.recompute_every", f"'{p.recompute_every}' is not an integer from 1 to 1024 "
                          "(recompute=full: every k-th layer recomputed)")
    if p.pp_layout is not None:
        if len(p.pp_layout) > 1024 or any(isinstance(x, bool) or (not isinstance(x, int)) or not 0 <= x <= 1024
                                          for x in p.pp_layout):
            raise ConfigError("parallel.pp_layout", "must list layer counts from 0 to 1024 (0 only on the first or "
                              "last chunk), one per pipeline chunk (at most 1024 chunks)")
    for name in ("global_batch", "micro_batch", "steps"):
        _positive(f"train.{name}", getattr(t, name))
    _positive("train.warmup_steps", t.warmup_steps, 0)
    _positive("train.log_every", t.log_every)
    _positive("train.threads", t.threads, 0)
    _choice("train.precision", t.precision, PRECISIONS)
    _choice("train.fp8.recipe", t.fp8.recipe, FP8_RECIPES)
    _choice("train.fp8.base_precision", t.fp8.base_precision, ("auto", "bf16", "fp32"))
    for name in ("bf16_first_blocks", "bf16_last_blocks"):
        n = getattr(t.fp8, name)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= m.n_layers:
            raise ConfigError(f"train.fp8.{name}", f"'{n}' is not an integer from 0 to model.n_layers={m.n_layers}")
    _choice("train.compile_backend", t.compile_backend, COMPILE_BACKENDS)
    _check_muon(t)
    _check_qk_clip(cfg)
    _check_norm_up(cfg)
    _check_fp8_cache(cfg)
    if t.stop_at_step is not None and not (1 <= t.stop_at_step <= t.steps):
        raise ConfigError("train.stop_at_step", f"must be between 1 and train.steps={t.steps}, got {t.stop_at_step}")
    _choice("data.format", cfg.data.format, DATA_FORMATS)
    c = cfg.cluster
    _choice("cluster.backend", c.backend, BACKENDS)
    _choice("cluster.device", c.device, DEVICES)
    _positive("cluster.nodes", c.nodes)
    if c.devices_per_node is not None:
        _positive("cluster.devices_per_node", c.devices_per_node)
    if c.device_memory_gib is not None and c.device_memory_gib <= 0:
        raise ConfigError("cluster.device_memory_gib", f"must be > 0, got {c.device_memory_gib}")
    if c.peak_tflops is not None and c.peak_tflops <= 0:
        raise ConfigError("cluster.peak_tflops", f"must be > 0, got {c.peak_tflops}")
    if c.peak_fp8_tflops is not None and c.peak_fp8_tflops <= 0:
        raise ConfigError("cluster.peak_fp8_tflops", f"must be > 0, got {c.peak_fp8_tflops}")
    if c.comm_sm_fraction is not None and not 0.0 <= c.comm_sm_fraction < 1.0:
        raise ConfigError("cluster.comm_sm_fraction", f"must be in [0, 1) (the device's share communication "
                          f"kernels take; null: GPUs 20/132, CPU 0), got {c.comm_sm_fraction}")
    _positive("checkpoint.every", cfg.checkpoint.every, 0)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _choice("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    bounds.check_bounds(cfg)


def _check_muon(t: Any) -> None:
    """train.optimizer and train.muon.* (read whatever the optimizer, so a typo never waits)."""
    _choice("train.optimizer", t.optimizer, OPTIMIZERS)
    mu = t.muon
    _choice("train.muon.adjust_lr", mu.adjust_lr, MUON_ADJUST_LR)
    if isinstance(mu.ns_steps, bool) or not isinstance(mu.ns_steps, int) or not 1 <= mu.ns_steps <= 20:
        raise ConfigError("train.muon.ns_steps",
                          f"'{mu.ns_steps}' is not an integer from 1 to 20 (Newton-Schulz steps)")
    if not 0.0 <= mu.momentum < 1.0:
        raise ConfigError("train.muon.momentum", f"'{mu.momentum}' is not a number in [0, 1)")
    if mu.lr is not None and not mu.lr > 0:
        raise ConfigError("train.muon.lr", f"'{mu.lr}' is not a positive number or null (= train.lr)")


def _check_qk_clip(cfg: Any) -> None:
    """train.muon.qk_clip_tau: a positive number with train.optimizer=muon, or null; refused where the
    rescale would not bound the logit (q/k norms undo it)."""
    tau = cfg.train.muon.qk_clip_tau
    if tau is None:
        return
    field_name = "train.muon.qk_clip_tau"
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ConfigError(field_name, f"'{tau}' is not a positive number or null (off; Kimi K2 used 100)")
    if cfg.train.optimizer != "muon":
        raise ConfigError(field_name, f"QK-clip is MuonClip's: set train.optimizer=muon (got "
                                      f"'{cfg.train.optimizer}') or qk_clip_tau=null")
    if cfg.model.qk_norm:
        raise ConfigError(field_name, "model.qk_norm normalises q and k after W_q/W_k, undoing the rescale; "
                                      "set qk_clip_tau=null (the norm already bounds the logits)")


def _check_norm_up(cfg: Any) -> None:
    """parallel.recompute=norm_up where it is built: one tp and cp rank (DeepSeek-V3 trains
    without TP; under tp/cp the norms' outputs are gathered or sharded copies, not what the
    rebuild replaces, and neither is measured), eager blocks, and models whose every norm is a
    block's pre-norm or MLA's latent norm (qk_norm, post_norms and Gated DeltaNet's gated norm
    are norms too, and are not rebuilt: refused rather than half done)."""
    if cfg.parallel.recompute != "norm_up":
        return
    m, p = cfg.model, cfg.parallel
    for field_name, bad, why in (
            ("parallel.tp", p.tp != 1, "1 (tensor parallel's norms are not rebuilt)"),
            ("parallel.cp", p.cp != 1, "1 (the ring keeps copies of q, k, v)"),
            ("train.compile", bool(cfg.train.compile), "false (rebuilt regions are eager)"),
            ("model.qk_norm", bool(m.qk_norm), "false (its per-head norms are not rebuilt)"),
            ("model.post_norms", bool(m.post_norms), "false (its post-norms are not rebuilt)"),
            ("model.linear.k_heads", m.linear.k_heads != 0, "0 (Gated DeltaNet's norm is not rebuilt)")):
        if bad:
            raise ConfigError(field_name, f"parallel.recompute=norm_up is built with {field_name}={why}; "
                                          "use recompute none, swiglu, core_attn, selective or full")


def _check_fp8_cache(cfg: Any) -> None:
    """train.fp8.cache_activations: a boolean, with FP8 training and a recompute that keeps the MoE
    SwiGLU's inputs (what it stores in FP8) on a model with MoE blocks."""
    on = cfg.train.fp8.cache_activations
    field_name = "train.fp8.cache_activations"
    if not isinstance(on, bool):
        raise ConfigError(field_name, f"'{on}' is not true or false")
    if not on:
        return
    if cfg.train.precision != "fp8":
        raise ConfigError(field_name, f"caches activations in FP8 under train.precision=fp8 (got "
                                      f"'{cfg.train.precision}'); set it false or train.precision=fp8")
    if cfg.parallel.recompute not in ("swiglu", "norm_up"):
        raise ConfigError(field_name, "stores the MoE SwiGLU's inputs that its recomputation keeps: needs "
                                      f"parallel.recompute swiglu or norm_up (got '{cfg.parallel.recompute}')")
    if cfg.model.moe.num_experts == 0:
        raise ConfigError(field_name, "caches the MoE SwiGLU's inputs: the model has no MoE block "
                                      "(model.moe.num_experts=0)")
    if cfg.train.compile:
        raise ConfigError(field_name, "is not built with train.compile=true (its checkpoint keeps the inputs as "
                                      "they are)")
