"""QK-clip (Kimi K2's MuonClip, issue #47 item 5) on one rank: ``train()`` against a plain reference.

The reference is written here from the Kimi K2 report (arXiv 2507.20534 §2.1, Algorithm 1) on top of
tests/test_muon.py's plain Muon loop: a forward pre-hook on each attention recomputes its q and k
from the weights (RoPE as the model turns them) and keeps each head's largest causal logit of the
step, S_max^h = scale · max q_i·k_j; after the update each head with S_max^h > τ gets
γ_h = τ / S_max^h and
- GQA: the group's smallest γ (Megatron-Core's grouped rule), W_q^h and the group's W_k by √γ;
- MLA: q's nope rows and kv_b's k-nope rows by √γ_h, q's rope rows by γ_h, kv_a (the shared rope
  key) and v untouched.
Loss, grad norm and the step's max logit must agree over 4 steps at init std 0.2, with τ low enough
that heads are clipped (counted), and a plant (γ where √γ belongs) must not.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.dist import cfg_and_plan, paired, run_ranks, write_tokens
from tests.test_muon import BASE, GB, SEQ, STEPS, VOCAB, _reference

TOL = 1e-5
MLA = ["model.n_kv_heads=4", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=16",
       "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16",
       "model.rope.type=yarn", "model.rope.factor=4.0", "model.rope.original_max_position=16",
       "model.rope.mscale=1.0", "model.rope.mscale_all_dim=1.0"]
#: GPT-OSS's q/k biases and a sliding window on every layer (the bias rows scale with their weights)
BIAS_WINDOW = ["model.attn_bias=true", "model.sliding_window=8"]
EXTRA = {"gqa": [], "mla": MLA, "mla-plain-q": MLA + ["model.mla.q_lora_rank=null"],
         "gqa-bias-window": BIAS_WINDOW}
#: τ of each attention kind at init std 0.2: some heads clipped at each step, not all after the first
TAU = {"gqa": 10.0, "mla": 5.0, "mla-plain-q": 5.0, "gqa-bias-window": 8.0}


class ReferenceClip:
    """The report's MuonClip step, written plainly (heads reshaped, not our per-row factors)."""

    def __init__(self, model, cfg, tau: float):
        from paralayer.model.attention import Attention
        from paralayer.model.latent_attention import LatentAttention

        self.cfg, self.tau, self.smax = cfg, tau, {}
        self.mods = [m for m in model.modules() if isinstance(m, (Attention, LatentAttention))]
        for m in self.mods:
            m.register_forward_pre_hook(self.record)

    @torch.no_grad()
    def record(self, mod, args):
        from paralayer.model.positions import apply_rope

        x, cos, sin = args[:3]  # a windowed layer also takes its chunk's mask
        b, s, _ = x.shape
        H = self.cfg.model.n_heads
        if hasattr(mod, "kv_b"):  # MLA
            q = (mod.wq(x) if mod.wq is not None else mod.q_b(mod.q_a_norm(mod.q_a(x))))
            q = q.view(b, s, H, mod.nope + mod.rope).transpose(1, 2)
            latent, k_rot = mod.kv_a(x).split([mod.rank, mod.rope], dim=-1)
            k_nope = mod.kv_b(mod.kv_a_norm(latent)).view(b, s, H, -1).transpose(1, 2)[..., :mod.nope]
            k_rot = apply_rope(k_rot.view(b, 1, s, mod.rope), cos, sin)
            logits = (q[..., :mod.nope] @ k_nope.transpose(-1, -2)
                      + apply_rope(q[..., mod.nope:], cos, sin) @ k_rot.transpose(-1, -2)) * mod.scale
        else:
            hd, KV = mod.head_dim, self.cfg.model.n_kv_heads
            q = apply_rope(mod.wq(x).view(b, s, H, hd).transpose(1, 2), cos, sin)
            k = apply_rope(mod.wk(x).view(b, s, KV, hd).transpose(1, 2), cos, sin)
            logits = q @ k.repeat_interleave(H // KV, dim=1).transpose(-1, -2) / hd ** 0.5
        seen = torch.ones(s, s, dtype=torch.bool).tril()
        if mod.window is not None:  # a sliding-window layer: key j seen by query i when i - j < w
            seen &= ~torch.ones(s, s, dtype=torch.bool).tril(-mod.window)
        m = logits.masked_fill(~seen, float("-inf")).amax(dim=(0, 2, 3))
        self.smax[mod] = torch.maximum(self.smax[mod], m) if mod in self.smax else m

    @torch.no_grad()
    def __call__(self) -> dict:
        clipped, top = 0, max(float(s.max()) for s in self.smax.values())
        H, KV = self.cfg.model.n_heads, self.cfg.model.n_kv_heads
        for mod, s in self.smax.items():
            gamma = torch.clamp(self.tau / s, max=1.0)
            if hasattr(mod, "kv_b"):
                w = (mod.wq if mod.wq is not None else mod.q_b).weight.view(H, mod.nope + mod.rope, -1)
                w[:, :mod.nope] *= gamma.sqrt().view(H, 1, 1)
                w[:, mod.nope:] *= gamma.view(H, 1, 1)
                mod.kv_b.weight.view(H, mod.nope + mod.v_dim, -1)[:, :mod.nope] *= gamma.sqrt().view(H, 1, 1)
            else:
                g = gamma.view(KV, H // KV).min(dim=1).values  # one γ per key head: its group's smallest
                mod.wq.weight.view(KV, H // KV, mod.head_dim, -1).mul_(g.sqrt().view(KV, 1, 1, 1))
                mod.wk.weight.view(KV, mod.head_dim, -1).mul_(g.sqrt().view(KV, 1, 1))
                if mod.wq.bias is not None:  # q = W_q x + b_q scales as a whole
                    mod.wq.bias.view(KV, -1).mul_(g.sqrt().view(KV, 1))
                    mod.wk.bias.view(KV, -1).mul_(g.sqrt().view(KV, 1))
                gamma = g.repeat_interleave(H // KV)
            clipped += int((gamma < 1).sum())
        self.smax = {}
        return {"max_logit": top, "qk_clipped_heads": clipped}


def _both(rank, world, overrides, plants, tau):
    from paralayer.optim import qk_clip
    from paralayer.runtime import train as T

    cfg, plan = cfg_and_plan(BASE + overrides + [f"train.muon.qk_clip_tau={tau}"])
    good = qk_clip.head_gammas
    runs = []
    for plant in plants:
        if plant == "gamma_not_sqrt":  # q and k each scaled by γ: the logit by γ²
            qk_clip.head_gammas = lambda s, t, kv=None: good(s, t, kv) ** 2
        try:
            runs.append([{k: r[k] for k in ("step", "loss", "grad_norm", "max_logit", "qk_clipped_heads")}
                         for r in T.train(cfg, plan)])
        finally:
            qk_clip.head_gammas = good
    return runs, _reference(cfg, overrides[0].split("=", 1)[1], lambda model: ReferenceClip(model, cfg, tau))


def _err(ours, ref) -> float:
    return max(max(abs(a[k] - b[k]) / abs(b[k]) for k in ("loss", "grad_norm", "max_logit"))
               for a, b in paired(ours, ref))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(EXTRA))
def test_one_rank_equals_the_reports_muonclip_and_gamma_for_sqrt_gamma_fails(kind, tmp_path):
    data = f"data.path={write_tokens(os.path.join(tmp_path, 't.jsonl'), GB * STEPS, SEQ, VOCAB)}"
    (ours, planted), ref = run_ranks(_both, 1, [data] + EXTRA[kind], [None, "gamma_not_sqrt"], TAU[kind])[0]
    err, err_plant = _err(ours, ref), _err(planted, ref)
    counts = [r["qk_clipped_heads"] for r in ref]
    print(f"{kind}: ours vs the report's MuonClip: max rel err {err:.2e}; gamma for sqrt(gamma): "
          f"{err_plant:.2e}; heads clipped per step {counts} of 8; max logit "
          f"{[round(r['max_logit'], 2) for r in ref]}")
    assert err <= TOL, (ours, ref)
    assert [r["qk_clipped_heads"] for r in ours] == counts
    assert sum(counts) > 0 and min(counts) < 8, counts  # it fired, and chose heads
    assert err_plant > 100 * TOL, (planted, ref)


# ------------------------------------------------------------------ the pieces
def test_head_max_logits_is_the_masked_max_and_chunks_agree(monkeypatch):
    from paralayer.model import max_logit

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 10, 8, generator=g), torch.randn(2, 3, 10, 8, generator=g)
    full = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.3
    pos = torch.arange(10)
    for window in (None, 3):
        seen = (pos[:, None] >= pos[None, :]) & ((pos[:, None] - pos[None, :] < window) if window else True)
        want = full.masked_fill(~seen, float("-inf")).amax(dim=(0, 2, 3))
        assert torch.allclose(max_logit.head_max_logits(q, k, 0.3, window), want, atol=1e-6), window
        for chunk in (2 * 10 * 10, 2 * 3 * 10):  # one head at a time; then 3 query rows of one head
            monkeypatch.setattr(max_logit, "CHUNK_ELEMENTS", chunk)
            assert torch.allclose(max_logit.head_max_logits(q, k, 0.3, window), want, atol=1e-6), (window, chunk)
        monkeypatch.undo()
    unmasked = full.amax(dim=(0, 2, 3))
    assert (unmasked > max_logit.head_max_logits(q, k, 0.3)).any()  # the mask matters on this draw
    # context parallel: each rank's zigzag queries against every rank's keys, positions masking
    from paralayer.parallel.context.zigzag import zigzag_indices

    q, k = torch.randn(2, 6, 8, 8, generator=g), torch.randn(2, 3, 8, 8, generator=g)
    for window in (None, 3):
        k_pos = torch.cat([zigzag_indices(8, 2, r) for r in range(2)])
        per_rank = [max_logit.head_max_logits(q[:, :, zigzag_indices(8, 2, r)], k[:, :, k_pos], 0.3, window,
                                              zigzag_indices(8, 2, r), k_pos) for r in range(2)]
        want = max_logit.head_max_logits(q, k, 0.3, window)
        assert torch.allclose(torch.maximum(*per_rank), want, atol=1e-6), window
        wrong = max_logit.head_max_logits(q[:, :, zigzag_indices(8, 2, 1)], k[:, :, k_pos], 0.3, window)
        assert not torch.allclose(wrong, per_rank[1], atol=1e-3), window  # the positions matter


def test_gammas_per_head_and_per_group():
    from paralayer.optim.qk_clip import head_gammas

    s = torch.tensor([50.0, 200.0, 80.0, 400.0, -float("inf"), 90.0])
    assert head_gammas(s, 100.0).tolist() == pytest.approx([1, 0.5, 1, 0.25, 1, 1])
    assert head_gammas(s, 100.0, 3).tolist() == pytest.approx([0.5, 0.5, 0.25, 0.25, 1, 1])


@pytest.mark.parametrize("bad,why", [(["train.muon.qk_clip_tau=100"], "train.optimizer=muon"),
                                     (["train.optimizer=muon", "train.muon.qk_clip_tau=0"], "positive"),
                                     (["train.optimizer=muon", "train.muon.qk_clip_tau=-3"], "positive"),
                                     (["train.optimizer=muon", "train.muon.qk_clip_tau=100", "model.qk_norm=true"],
                                      "model.qk_norm")])
def test_bad_qk_clip_input_exits_2_naming_the_field(bad, why):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "launch.py", "recipe=tiny", *bad, "--dry-run"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "train.muon.qk_clip_tau" in r.stderr and why in r.stderr, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ------------------------------------------------------------------ the plan's time
@pytest.mark.parametrize("extra", [[], MLA])
def test_plan_prices_the_max_logit_gemm_as_torch_counts_it(extra):
    """max_logit_flops = layers × sequences × the FLOPs torch's counter sees in one sequence's
    head_max_logits (GQA and MLA)."""
    from torch.utils.flop_counter import FlopCounterMode

    from paralayer.config import load_config
    from paralayer.model.max_logit import head_max_logits
    from paralayer.resolve.cost.optimizer_step import max_logit_flops

    cfg = load_config(BASE + extra + ["train.muon.qk_clip_tau=10"])
    m = cfg.model
    d_qk = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim if extra else m.d_model // m.n_heads
    q, k = torch.randn(1, m.n_heads, m.seq_len, d_qk), torch.randn(1, m.n_kv_heads, m.seq_len, d_qk)
    with FlopCounterMode(display=False) as fc:
        head_max_logits(q, k, 0.1)
    per_seq = fc.get_total_flops()
    assert per_seq > 0
    degrees = {"tp": 1, "dp": 1}
    assert max_logit_flops(cfg, degrees, m.n_layers) == m.n_layers * GB * per_seq
    assert max_logit_flops(load_config(BASE + extra), degrees, m.n_layers) == 0.0


def test_plan_adds_it_to_the_step_and_ranks_with_it():
    """The planner's step time grows by max_logit_flops at the attention rate (llama3-8b, 64 H100),
    and --plan's ranked rows are what predict gives each."""
    from paralayer.config import load_config
    from paralayer.resolve import planner
    from paralayer.resolve.cost.machine import machine_for
    from paralayer.resolve.cost.optimizer_step import max_logit_flops

    ov = ["recipe=llama3-8b", "cluster=h100-80gb-8x", "cluster.nodes=8", "parallel.tp=1", "parallel.dp=64",
          "parallel.zero=2", "train.optimizer=muon"]
    off, on = (planner.predict(load_config(ov + x)) for x in ([], ["train.muon.qk_clip_tau=100"]))
    assert on["step_time_s"] - off["step_time_s"] == pytest.approx(on["optimizer_s"] - off["optimizer_s"], rel=1e-9)
    big = load_config(ov + ["train.muon.qk_clip_tau=100"])
    mach = machine_for(big)
    want = (max_logit_flops(big, {"tp": 1, "dp": 64}, big.model.n_layers)
            / (mach.peak_tflops * 1e12 * (mach.attention_efficiency or mach.efficiency)))
    assert on["optimizer_s"] - off["optimizer_s"] == pytest.approx(want, rel=1e-9) and want > 0
    print(f"llama3-8b on 64 H100, ZeRO-2: QK-clip's max logit adds {want * 1e3:.1f} ms to a "
          f"{off['step_time_s']:.3f} s step")
    rows = planner.plan_layouts(big, top=3)  # --plan ranks with it: each row is what predict gives
    assert rows
    for d in rows:
        c = planner.config_for(big, d)
        assert c.train.muon.qk_clip_tau == 100
        assert planner.predict(c)["step_time_s"] == pytest.approx(d["step_time_s"], rel=1e-6), d["degrees"]


# ------------------------------------------------------------------ the plan's memory
#: GQA: tiny (4 heads over tp 2, dp 2); MLA: deepseek-v3-tiny (dp 2 · ep 2, its MTP block's attention too)
HELD = {"gqa": ["recipe=tiny"], "mla": ["recipe=deepseek-v3-tiny"]}
MUONCLIP = ["train.optimizer=muon", "train.muon.qk_clip_tau=100"]


def _plan(ov):
    from paralayer.config import load_config
    from paralayer.resolve import resolve

    cfg = load_config(ov)
    return cfg, resolve(cfg).to_dict()


def check_clip_states(out: dict, plan: dict) -> None:
    """Each rehearsed rank's optimizer states (Muon's momentum, AdamW's moments, QK-clip's max logits,
    measured from the runtime's own tensors) are the plan's to the byte (pp 1: one figure)."""
    assert out["ok"] and out["ranks"], out.get("errors")
    for r in out["ranks"]:
        assert r["memory_bytes"]["optimizer"] == plan["memory_per_device_bytes"]["optimizer"], (r["rank"], r["ratios"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(HELD))
def test_rehearsal_holds_the_plans_qk_clip_buffers_and_a_plan_without_them_fails(kind, monkeypatch):
    """The plan counts QK-clip's buffer where the runtime keeps it: one fp32 per local head per
    softmax attention of the rank (n_heads/tp; whole on every data and expert rank), with the
    optimizer's states. The rehearsal (rank 0, the runtime's QKClip built on fake tensors) holds
    exactly that; a plan that leaves the buffer out (the planted omission) does not match it."""
    from paralayer import rehearse as R
    from paralayer.resolve.memory import muon_states

    cfg, plan = _plan(HELD[kind] + MUONCLIP)
    assert not plan["errors"] and plan["degrees"]["pp"] == 1, plan["errors"]
    _, muon_only = _plan(HELD[kind] + MUONCLIP[:1])
    m = cfg.model
    buffers = 4 * (m.n_heads // plan["degrees"]["tp"]) * (m.n_layers + m.mtp.depth)
    assert plan["memory_per_device_bytes"]["optimizer"] - muon_only["memory_per_device_bytes"]["optimizer"] == buffers
    out = R.rehearse(cfg, plan, [0])
    check_clip_states(out, plan)
    for r in out["ranks"]:  # and Muon's Newton-Schulz FLOPs and moves (tp's rows, MLA's, MTP's) are the plan's
        assert r["agrees"]["flops"] and r["agrees"]["comm"] and r["plan_optimizer_step"]["flops"] > 0, r["ratios"]
    monkeypatch.setattr(muon_states, "qk_clip_bytes", lambda *a: 0)
    _, planted = _plan(HELD[kind] + MUONCLIP)
    with pytest.raises(AssertionError):
        check_clip_states(out, planted)
