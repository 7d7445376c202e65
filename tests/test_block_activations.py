"""One block's saved set against the plan's per-token elements (memory.act_elems_per_token), for
MLA, MoE and qk_norm blocks at the full models' widths, fp32 and bf16 under autocast.

The block runs on fake tensors, as the rehearsal runs it (paralayer/rehearse/rank.py: even routing,
the GPU attention kernel for a GPU layout), so DeepSeek-V3's and Qwen3-235B's widths cost no memory.
Counted as rehearse/memory.py counts: storages saved for backward inside the block, parameters,
RoPE tables and autocast's weight copies (counted with the weights) excluded. The whole-rank
rehearsal at full size (docs/models.md) agreed at 1.000 once these terms were right; before, the
bf16 MoE block was 17% over its plan and the MLA block one d_model per token short.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from paralayer import config as config_mod
from paralayer.model.transformer import Transformer
from paralayer.rehearse.memory import weight_copy_of
from paralayer.resolve import rules
from paralayer.resolve.memory import activations as memory_activations
from paralayer.resolve.memory import states as memory_states

GPU = ["cluster=h800-80gb-8x", "cluster.nodes=1", "cluster.devices_per_node=1"]
CASES = {
    "deepseek-v3": ["recipe=deepseek-v3", "model.moe.first_k_dense=1"] + GPU,
    "qwen3-235b-a22b": ["recipe=qwen3-235b-a22b", "model.moe.first_k_dense=1"] + GPU,
    "deepseek-v3-no-q-lora-top4": ["recipe=deepseek-v3", "model.moe.first_k_dense=1", "model.mla.q_lora_rank=null",
                                   "model.moe.top_k=4"] + GPU,
    "deepseek-v3-tiny-cpu": ["recipe=deepseek-v3-tiny", "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=8"],
}


#: the measured side of _block_saved, by its arguments: a model's saved storages do not depend on the plan's
#: functions the planted tests patch (resolve/memory), so a block measured once is judged again, not rebuilt
_MEASURED: dict = {}


class _Past(Exception):
    """Raised after the last measured layer's forward: the layers after it and the head save nothing counted."""


def _block_saved(overrides: list[str], precision: str, mode: str = "none",
                 fake: bool = True, layers: tuple = (0, 1), fsdp: bool = False) -> list[tuple[int, float]]:
    """[(saved bytes, the plan's bytes)] of ``layers`` (by default layer 0, dense, and layer 1,
    MoE), one microbatch, under ``parallel.recompute=mode`` (built as the runtime builds it:
    apply_recompute); ``fake`` False: on real CPU tensors (small shapes only), the runtime's own
    dtypes and storages. ``fsdp``: bf16 as FSDP's mixed precision runs it (bf16 weights, no
    autocast; the plan's 'bf16-fsdp', ZeRO 2 over two data ranks)."""
    cfg = config_mod.load_config(overrides + [
        f"model.n_layers={max(2, max(layers) + 1)}", "model.mtp.depth=0", "parallel.pp=1", "parallel.ep=1",
        "parallel.dp=1",
        f"parallel.recompute={mode}", f"train.precision={precision}", "train.micro_batch=1", "train.global_batch=1"])
    lay = rules.check(cfg)
    if fsdp:
        lay.zero, lay.dp = 2, 2
    memo = (tuple(overrides), precision, mode, fake, tuple(layers), fsdp)
    if memo not in _MEASURED:
        _MEASURED[memo] = _measure(cfg, lay, mode, fake, layers, fsdp)
    total = _MEASURED[memo]
    tokens = cfg.model.seq_len // lay.cp  # under cp one rank's zigzag shard (_one_rank_snake)
    return [(total[i], memory_activations.kind_elems(cfg, lay, memory_activations.layer_kind(cfg, i), mode)
             * tokens * memory_states.ACT_BYTES[lay.precision]) for i in layers]


def _measure(cfg, lay, mode: str, fake: bool, layers: tuple, fsdp: bool) -> dict[int, int]:
    """{layer: bytes of the storages it saves for backward} over one forward up to the last of ``layers``."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from paralayer.runtime.build import apply_recompute

    key = lambda t: t.untyped_storage()._cdata  # noqa: E731 - fake storages have no address
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        if fsdp:
            torch.set_default_dtype(torch.bfloat16)
        try:
            model = Transformer(cfg.model)
        finally:
            torch.set_default_dtype(torch.float32)
        apply_recompute(model, mode, 1, cfg.train.fp8.cache_activations)
        if lay.cp > 1:
            for block in model.layers.values():
                if hasattr(block.attention, "rule_fn"):
                    _one_rank_snake(block.attention)
        for mod in model.modules():
            if hasattr(mod, "even_routing"):
                mod.even_routing, mod.count_stats = True, False
            if lay.device != "cpu" and hasattr(mod, "fused_kernel"):
                mod.fused_kernel = True
        excluded = {key(p) for p in model.parameters()}
        inside: list = [None]
        seen: dict = {i: set() for i in layers}
        total = {i: 0 for i in layers}
        held: list = []  # what was counted stays alive: a freed storage's address, reused, is a new one

        def enter(i):
            def hook(module, args):
                inside[0] = i
                excluded.update(key(t) for t in args[1:] if isinstance(t, torch.Tensor))  # cos, sin
            return hook

        def pack(t):
            i = inside[0]
            if i is not None and key(t) not in excluded and key(t) not in seen[i] and weight_copy_of(t) is None:
                seen[i].add(key(t))
                held.append(t)
                total[i] += t.untyped_storage().nbytes()
            return t

        def leave(m, a, o):
            inside[0] = None
            if m is last:
                raise _Past

        last = model.layers[str(max(layers))]
        for i in layers:
            model.layers[str(i)].register_forward_pre_hook(enter(i))
            model.layers[str(i)].register_forward_hook(leave)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=lay.precision == "bf16" and not fsdp)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            try:
                model(torch.zeros((1, cfg.model.seq_len // lay.cp), dtype=torch.long))
            except _Past:
                pass
    assert inside[0] is None and all(i in total for i in layers)
    return total


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_block_saved_set_is_the_plans(name, precision):
    for i, (got, plan) in enumerate(_block_saved(CASES[name], precision)):
        assert got > 0
        assert abs(got / plan - 1) < 1e-3, (name, precision, i, got, plan)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "deepseek-v3-tiny-cpu"])
def test_swiglu_recompute_in_the_experts_is_the_plans(name, precision):
    """recompute=swiglu in an MoE block: each routed expert's and the shared expert's silu(gate) is
    not kept (issue 46: the experts ignored it and kept 4 expert widths a row). The saved set is the
    plan's (3·k·f_E + 3·f_S), and it is smaller than recompute=none's by exactly one expert width a
    routed row plus the shared expert's width, per token."""
    cfg = config_mod.load_config(CASES[name])
    mo, seq = cfg.model.moe, cfg.model.seq_len
    width = memory_states.ACT_BYTES[precision] * seq * (mo.top_k * mo.ffn_hidden + mo.shared_ffn_hidden)
    none, swiglu = _block_saved(CASES[name], precision), _block_saved(CASES[name], precision, "swiglu")
    for i, (got, plan) in enumerate(swiglu):
        assert abs(got / plan - 1) < 1e-3, (name, precision, i, got, plan)
    assert none[1][0] - swiglu[1][0] == width, (none[1][0], swiglu[1][0], width)


#: Qwen3's block (qk_norm, q = a·head_dim wider than d_model) at one rank: at its own widths (fake
#: tensors) and at a small shape on real CPU tensors (the runtime's own dtypes, nothing faked)
QWEN3 = ["recipe=qwen3-8b", "cluster=h100-80gb-8x", "cluster.nodes=1", "cluster.devices_per_node=1",
         "parallel.tp=1", "model.seq_len=256"]
QWEN3_SMALL = QWEN3 + ["model.d_model=128", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=48",
                       "model.ffn_hidden=256", "model.vocab_size=512"]


#: Gemma 3's offset q/k norms cast back to bf16 (model/norms.py): the term is not theirs
GEMMA3 = ["recipe=gemma3-27b", "cluster=h100-80gb-8x", "cluster.nodes=1", "cluster.devices_per_node=1",
          "parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.dp=1", "model.seq_len=256",
          "model.sliding_window=null", "model.full_attention_every=0"]
SHAPES = {"qwen3-8b": (QWEN3, True), "small-real": (QWEN3_SMALL, False), "gemma3-27b": (GEMMA3, True)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective", "core_attn", "swiglu", "full"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_qk_norm_block_is_the_plans_in_every_recompute(shape, mode, precision):
    """Issue 46: qwen3-8b and qwen3-32b (selective, bf16) rehearsed 5-7% over their plan at full
    depth, one term per layer: under autocast the q/k norms' weights are fp32, so their outputs
    (the recomputed core's saved inputs q and k) are fp32, q + kv more elements per token than the
    plan counted (bf16_extra_elems, _gqa_bf16). Fails on the old plan: 1.057 (selective), 1.050
    (core_attn) at qwen3-8b's widths; real CPU tensors read the same as fake ones. Gemma 3's offset
    norms cast back to bf16: the term would make its plan 4% over (0.959)."""
    overrides, fake = SHAPES[shape]
    for i, (got, plan) in enumerate(_block_saved(overrides, precision, mode, fake=fake)):
        assert got > 0
        assert abs(got / plan - 1) < 1e-3, (shape, mode, precision, i, got, plan)


def test_a_planted_moe_cast_term_fails(monkeypatch):
    """The comparison can fail: without the bf16 MoE block's routed-row casts (bf16_extra_elems)
    DeepSeek-V3's MoE block is 17% over the plan."""
    real = memory_activations.bf16_extra_elems

    def planted(cfg, lay, mode, moe=False, linear=False):
        return real(cfg, lay, mode, False, linear)

    monkeypatch.setattr(memory_activations, "bf16_extra_elems", planted)
    got, plan = _block_saved(CASES["deepseek-v3"], "bf16")[1]
    assert got / plan > 1.1, (got, plan)


#: Qwen3-Next's two layer kinds (tiny-qwen3-next: layer 0 Gated DeltaNet, layer 3 gated full
#: attention, both MoE with the gated shared expert), and the delta rule at other widths: one
#: k-head (z a view of in_proj_qkvz's output), dk ≠ dv, conv kernel 3, chunk 32 over a 100-token
#: sequence (padded), on real CPU tensors and on a GPU layout's fake ones.
NEXT = ["recipe=tiny-qwen3-next"]
NEXT_GPU = NEXT + ["cluster=h100-80gb-8x", "cluster.nodes=1", "cluster.devices_per_node=1"]
NEXT_ODD = NEXT + ["model.linear.k_heads=1", "model.linear.head_k_dim=32", "model.linear.head_v_dim=8",
                   "model.linear.conv_kernel=3", "model.linear.chunk=32", "model.seq_len=100"]
NEXT_SHAPES = {"tiny-qwen3-next": (NEXT, False), "gpu-fake": (NEXT_GPU, True), "odd-widths": (NEXT_ODD, False)}
#: measured, the plan's per-token count against one layer's saved storages: the delta rule's
#: C×C causal mask is per microbatch (C² bytes, not counted: 0.15-0.2% at these widths); under
#: autocast the rule's bf16 casts were written term by term at tiny-qwen3-next's widths (1.002) and
#: read 0.9924-0.9926 at the odd ones. (Real CPU tensors once read 0.973-0.991 from run to run: the
#: harness let a counted storage die and took a new one at its address for the same; it now holds
#: what it counted.)
NEXT_TOL = {"fp32": 3e-3, "bf16-fsdp": 3e-3, "bf16": 1e-2}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-fsdp"])
@pytest.mark.parametrize("mode", ["none", "selective", "swiglu", "full"])
@pytest.mark.parametrize("shape", list(NEXT_SHAPES))
def test_gated_deltanet_and_gated_attention_blocks_are_the_plans(shape, mode, precision):
    """Issue 47: the plan counted a GQA set in Qwen3-Next's linear layers (tiny-qwen3-next
    rehearsed 1.57× its plan); the gated full attention's output gate (4q) and the shared expert's
    gate (h + 1) were not counted either (1.17)."""
    overrides, fake = NEXT_SHAPES[shape]
    fsdp = precision == "bf16-fsdp"
    got = _block_saved(overrides, "bf16" if fsdp else precision, mode, fake=fake, layers=(0, 3), fsdp=fsdp)
    for i, (saved, plan) in zip((0, 3), got):
        assert saved > 0
        assert abs(saved / plan - 1) < NEXT_TOL[precision], (shape, mode, precision, i, saved, plan)


@pytest.mark.parametrize("part", ["conv", "rule", "norm"])
def test_a_planted_missing_linear_term_fails(monkeypatch, part):
    """Drop one of the linear layer's counted parts (the conv's saved input and outputs, the chunked
    rule's intermediates, the gated norm): its block reads over the plan by more than the bound."""
    from paralayer.resolve.memory import linear_acts

    real = linear_acts._parts
    drop = {"conv": 0, "rule": 2, "norm": 3}[part]

    def planted(cfg, lay):
        parts = list(real(cfg, lay))
        parts[drop] = 0.0
        return tuple(parts)

    monkeypatch.setattr(linear_acts, "_parts", planted)
    saved, plan = _block_saved(NEXT, "fp32", fake=False, layers=(0, 3))[0]
    assert saved / plan - 1 > 0.05, (part, saved, plan)


def _one_rank_snake(att) -> None:
    """Context parallel's Gated DeltaNet path (parallel/context/linear_state.py) in one process: a cp
    rank without neighbours, whose hi chunk takes its lo chunk's conv tail and final state, as cp
    rank cp−1 does; it keeps what every cp rank keeps (a received tail or state is as large)."""
    from paralayer.parallel.context import linear_state

    snake = linear_state.Snake.__new__(linear_state.Snake)
    snake.group, snake.rank, snake.size, snake.prev, snake.next, snake.sent_bytes = None, 0, 1, None, None, 0
    att.conv_fn, att.rule_fn = linear_state._bind_conv(snake), linear_state._bind_rule(snake, att.chunk)


def _rerun_saved(overrides: list[str], precision: str, fsdp: bool) -> tuple[int, float]:
    """(the largest saved set of one rerun of the rule in the linear layer 0's backward under cp
    (linear_state._rule_grads), as the rehearsal's counter sees it (rehearse/memory.py SavedPeak:
    storages live already count once), the plan's: linear_acts.cp_rerun_elems), fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from paralayer.parallel.context import linear_state
    from paralayer.rehearse.memory import SavedPeak
    from paralayer.resolve.memory import linear_acts

    cfg = config_mod.load_config(overrides + ["parallel.pp=1", f"train.precision={precision}", "train.micro_batch=1",
                                              "train.global_batch=1"])
    lay = rules.check(cfg)
    if fsdp:
        lay.zero, lay.dp = 2, 2
    real, grown = linear_state.chunk_gated_delta_rule, []
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.bfloat16 if fsdp else torch.float32)
        try:
            model = Transformer(cfg.model)
            x = torch.zeros(1, cfg.model.seq_len // lay.cp, cfg.model.d_model, requires_grad=True)
        finally:
            torch.set_default_dtype(torch.float32)
        for mod in model.modules():  # the rehearsal's routing on fake tensors
            if hasattr(mod, "even_routing"):
                mod.even_routing, mod.count_stats = True, False
        _one_rank_snake(model.layers["0"].attention)
        counter = SavedPeak([*model.parameters(), x])

        def spy(*args, **kwargs):
            before = counter.live
            out = real(*args, **kwargs)
            if torch.is_grad_enabled():  # the backward's rerun (the forward's runs under no_grad)
                grown.append(counter.live - before)
            return out

        linear_state.chunk_gated_delta_rule = spy
        try:
            with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16" and not fsdp):
                model.layers["0"](x, None, None).float().sum().backward()
        finally:
            linear_state.chunk_gated_delta_rule = real
    mode = memory_states.precision_mode(lay.precision, lay.zero, lay.dp * lay.cp)
    plan = linear_acts.cp_rerun_elems(cfg, lay, mode) * (cfg.model.seq_len // lay.cp)
    assert len(grown) == 2, grown  # the hi chunk's, then the lo chunk's
    return max(grown), plan * memory_states.ACT_BYTES[lay.precision]


#: Gated DeltaNet under cp2 (issue 47): tiny-qwen3-next's widths, and the odd ones (one k-head,
#: dk ≠ dv, kernel 3, chunk 32 over a 50-token shard whose halves are padded); the linear layer only
#: (the full layer's ring is not in one process)
NEXT_CP = {"tiny-qwen3-next": NEXT + ["parallel.cp=2", "parallel.dp=1", "parallel.ep=1"],
           "odd-widths": NEXT_ODD + ["parallel.cp=2", "parallel.dp=1", "parallel.ep=1"]}
#: measured: the saved set 1.0000-1.0001 and every rerun to the byte with the mask, but under autocast at the odd
#: widths 0.9817 (0.991 at cp = 1, seq 200): the autocast count of the layer (linear_acts._autocast_total,
#: bf16_acts._linear_block_bf16) is exact only where 2·v_heads·dv = d_model: its gated norm keeps
#: 11·H·dv + 2H, not 9·H·dv + 2H, and its block casts its input twice, not three times (the cp=1 plans
#: would move: left to its own issue)
NEXT_CP_TOL = {"fp32": 3e-3, "bf16-fsdp": 3e-3, "bf16": 2e-2}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-fsdp"])
@pytest.mark.parametrize("shape", list(NEXT_CP))
def test_gated_deltanet_under_cp_keeps_the_rules_inputs_and_states(shape, precision):
    """Under cp the delta rule runs in ``_SnakeRule``, which keeps q, k, v, g, beta and the two
    received states and reruns each half's rule in backward: the layer's saved set is the plan's
    (linear_acts._cp_rule, the conv's two tails), and so is one rerun's (cp_rerun_elems), the
    transient the backward adds (it read 0.68 of the plan while the plan counted the chunked rule's
    whole set)."""
    fsdp = precision == "bf16-fsdp"
    prec = "bf16" if fsdp else precision
    saved, plan = _block_saved(NEXT_CP[shape], prec, fake=True, layers=(0, 3), fsdp=fsdp)[0]
    assert abs(saved / plan - 1) < NEXT_CP_TOL[precision], (shape, precision, saved, plan)
    rerun, rerun_plan = _rerun_saved(NEXT_CP[shape], prec, fsdp)
    # the rule's C×C causal mask (C² bytes a microbatch) is not counted: 0.85% at C = 64, 0.26% at 32
    assert 0 <= rerun / rerun_plan - 1 < 1e-2, (shape, precision, rerun, rerun_plan)


def test_a_planted_chunked_rule_under_cp_fails(monkeypatch):
    """The comparison can fail: a plan that counts the chunked rule's whole set under cp (as before
    issue 47's fix) is over the cp layer's saved set by more than the bound."""
    from paralayer.resolve.memory import linear_acts

    real = linear_acts._parts

    def planted(cfg, lay):  # the chunked rule over one rank's tokens, as at cp = 1
        one = copy.deepcopy(cfg)
        one.model.seq_len //= lay.cp
        return real(one, dataclasses.replace(lay, cp=1))

    monkeypatch.setattr(linear_acts, "_parts", planted)
    saved, plan = _block_saved(NEXT_CP["tiny-qwen3-next"], "fp32", fake=True, layers=(0, 3))[0]
    assert saved / plan < 0.9, (saved, plan)


#: recompute=norm_up (DeepSeek-V3's: the norms and MLA's up-projections rebuilt in backward): MLA
#: blocks on a GPU layout's fake tensors (the kernel keeps q, k, v as given) and on real CPU tensors
#: (CPU flash), GQA blocks dense and MoE (norms only), fp32, bf16 under autocast and under FSDP
NORM_UP = {"deepseek-v3": (CASES["deepseek-v3"], True), "deepseek-v3-tiny-cpu": (CASES["deepseek-v3-tiny-cpu"], False),
           "tiny": (["recipe=tiny", "parallel.tp=1", "parallel.dp=1", "parallel.pp=1"], False),
           "tiny-moe": (["recipe=tiny-moe", "parallel.tp=1", "parallel.dp=1", "parallel.pp=1"], False)}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-fsdp"])
@pytest.mark.parametrize("name", list(NORM_UP))
def test_norm_up_block_is_the_plans(name, precision):
    """The saved set under norm_up is the plan's (resolve/memory/norm_up_acts.py) within 1e-3
    (measured: 1.0000 on DeepSeek-V3's widths in every precision, 1.0002-1.0005 on deepseek-v3-tiny's
    MoE block, 0.9992-0.9996 on tiny-moe's, as their recompute=none sets read); on DeepSeek-V3's
    dense block it is 0.52 of none's in fp32, 0.64 under autocast."""
    overrides, fake = NORM_UP[name]
    fsdp = precision == "bf16-fsdp"
    got = _block_saved(overrides, "bf16" if fsdp else precision, "norm_up", fake=fake, fsdp=fsdp)
    for i, (saved, plan) in enumerate(got):
        assert saved > 0
        assert abs(saved / plan - 1) < 1e-3, (name, precision, i, saved, plan)


def test_a_planted_norm_up_term_fails(monkeypatch):
    """The comparison can fail: a plan that thinks the core's q, k and kv_b's output stay (the
    up-projections not rebuilt) is 28% over DeepSeek-V3's dense block."""
    from paralayer.resolve.memory import norm_up_acts

    real = norm_up_acts.norm_up_freed

    def planted(cfg, lay):
        a, ml = cfg.model.n_heads, cfg.model.mla
        dqk = ml.qk_nope_head_dim + ml.qk_rope_head_dim
        return real(cfg, lay) - 2 * a * dqk - a * (ml.qk_nope_head_dim + ml.v_head_dim)

    monkeypatch.setattr(norm_up_acts, "norm_up_freed", planted)
    monkeypatch.setattr(memory_activations, "norm_up_freed", planted)
    got, plan = _block_saved(CASES["deepseek-v3"], "fp32", "norm_up", layers=(0,))[0]  # the dense block
    assert got / plan < 0.8, (got, plan)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-tiny-cpu"])
def test_fp8_cached_swiglu_inputs_are_the_plans(name):
    """train.fp8.cache_activations under norm_up: the MoE block's gate and up (routed rows and the
    shared expert) kept in e4m3 with a fp32 scale per 1x128 tile (resolve/fp8.py cached_bytes), the
    plan's within 1e-3 (measured 1.0000 at DeepSeek-V3's widths, 1.0003 at the tiny's: its MoE
    block reads so under none too); 146 MB less than uncached on DeepSeek-V3's MoE block."""
    overrides, fake = NORM_UP[name]
    (_, _), (saved, plan) = _block_saved(overrides + ["train.fp8.cache_activations=true"], "fp8", "norm_up",
                                         fake=fake)
    assert abs(saved / plan - 1) < 1e-3, (name, saved, plan)
    uncached = _block_saved(overrides, "fp8", "norm_up", fake=fake, layers=(1,))[0][0]
    assert saved < uncached
