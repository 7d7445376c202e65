"""FP8 training (train.precision=fp8, paralayer/model/float8.py): one process against torchao's own
Float8Linear, each layout against one process, planted errors that must fail, and the resolver's
refusals (exit 2, one line, before any rank starts)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import paralayer.runtime.train  # noqa: E402,F401 - imported once, before the ranks fork
from paralayer.config import ModelConfig  # noqa: E402
from paralayer.model import float8 as f8  # noqa: E402
from paralayer.model.transformer import Transformer, init_weights  # noqa: E402
from tests.dist import max_rel_err, run_ranks, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5
#: 64-wide blocks: every GEMM's K and N stay multiples of 16 after tp 2 (the resolver's rule)
BASE = ["recipe=tiny", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_hidden=64",
        "model.vocab_size=64", "model.seq_len=32", "model.n_layers=2", "model.init_std=0.2",
        "train.steps=4", "train.lr=3e-3", "train.warmup_steps=1", "train.adam_eps=1e-5", "train.precision=fp8",
        "train.threads=1", "train.global_batch=4", "train.micro_batch=1", "parallel.tp=1", "parallel.dp=1",
        "data.format=tokens", "data.shuffle=false", "logging.wandb.mode=disabled", "logging.progress=false",
        "checkpoint.every=0", "cluster.device=cpu", "cluster.peak_tflops=1.0"]


# ------------------------------------------------------------------ one process against torchao
def _model(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        m = Transformer(cfg, cfg.vocab_size)
    return m


def _grads_and_loss(model: nn.Module, tokens: torch.Tensor) -> tuple[float, dict]:
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _oracle_pair(recipe: str, config=None):
    """Our conversion and torchao's ``convert_to_float8_training`` of a copy, same weights."""
    from torchao.float8 import convert_to_float8_training

    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=64, vocab_size=64, seq_len=32,
                      init_std=0.2)
    ours = _model(cfg)
    f8.convert_blocks(ours, recipe, [0, 1], emulate=True)
    ours.to_empty(device="cpu")
    init_weights(ours, cfg, 0, torch.device("cpu"))
    plain = _model(cfg)
    plain.to_empty(device="cpu")
    plain.load_state_dict(ours.state_dict())
    oracle = convert_to_float8_training(copy.deepcopy(plain), config=config or f8.recipe_config(recipe, True),
                                        module_filter_fn=lambda m, fqn: fqn.startswith("layers."))
    return ours, oracle, plain


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_process_equals_torchao_float8linear(recipe):
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    ours, oracle, plain = _oracle_pair(recipe)
    assert sum(isinstance(m, f8.Fp8Linear) for m in ours.modules()) == 14  # 7 GEMMs x 2 blocks
    lo, go = _grads_and_loss(ours, tokens)
    lr, gr = _grads_and_loss(oracle, tokens)
    lp, gp = _grads_and_loss(plain, tokens)
    assert lo == lr and all(torch.equal(go[n], gr[n]) for n in gr)
    # FP8 is not fp32: the casts change the numbers (else this test could not tell them apart)
    assert abs(lo - lp) / lp > 1e-5


def test_a_cast_skipped_in_backward_fails_the_oracle():
    """Planted in our model: the input-gradient GEMM left in high precision (its output-gradient
    and weight casts skipped); against the right oracle it must fail."""
    from torchao.float8.config import CastConfig, ScalingType

    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    good = f8.recipe_config("tensorwise", True)
    off = CastConfig(scaling_type=ScalingType.DISABLED)
    bad = copy.copy(good)  # past the config's own checks, which refuse a lone skipped cast
    object.__setattr__(bad, "cast_config_grad_output", off)
    object.__setattr__(bad, "cast_config_weight_for_grad_input", off)
    ours, oracle, _ = _oracle_pair("tensorwise")
    for m in ours.modules():
        if isinstance(m, f8.Fp8Linear):
            m.config = bad
    lo, go = _grads_and_loss(ours, tokens)
    lr, gr = _grads_and_loss(oracle, tokens)
    assert lo == lr  # the forward is untouched
    worst = max(float((go[n] - gr[n]).norm() / gr[n].norm()) for n in gr if "layers" in n)
    assert worst > 1e-3, worst


def _blockwise_reference(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Tile by tile, in loops: amax, scale 448/amax, round to e4m3, back."""
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], cols):
            t = x[i:i + rows, j:j + cols]
            s = 448.0 / t.abs().max().clamp(min=1e-12)
            out[i:i + rows, j:j + cols] = (t * s).clamp(-448, 448).to(torch.float8_e4m3fn).float() / s
    return out


def test_blockwise_tiles_and_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=g) * torch.logspace(-2, 2, 256)[:, None]
    for rows, cols in ((1, 128), (128, 128), (128, 1)):
        assert torch.equal(f8.qdq_tiles(x, rows, cols), _blockwise_reference(x, rows, cols))
    a = torch.randn(2, 128, 256, generator=g, requires_grad=True)
    w = torch.randn(128, 256, generator=g, requires_grad=True)
    y = f8._BlockwiseMatmul.apply(a, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    a2, dy2 = a.detach().reshape(-1, 256), dy.reshape(-1, 128)
    wq = _blockwise_reference(w.detach(), 128, 128)
    assert torch.allclose(y.reshape(-1, 128), _blockwise_reference(a2, 1, 128) @ wq.t(), rtol=1e-6, atol=1e-5)
    assert torch.allclose(a.grad.reshape(-1, 256), _blockwise_reference(dy2, 1, 128) @ wq, rtol=1e-6, atol=1e-5)
    want_gw = _blockwise_reference(dy2.t().contiguous(), 1, 128) @ _blockwise_reference(a2, 128, 1)
    assert torch.allclose(w.grad, want_gw, rtol=1e-6, atol=1e-5)
    # the FP8 grads are not the plain ones
    assert not torch.allclose(w.grad, dy2.t() @ a2, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------ layouts against one process
def _run(rank, world, overrides):
    from paralayer.runtime.train import train
    from tests.dist import cfg_and_plan

    cfg, plan = cfg_and_plan(overrides)
    return [(r["loss"], r["grad_norm"]) for r in train(cfg, plan)]


def _errs(got, ref) -> tuple[float, float]:
    return (max_rel_err([x[0] for x in got], [x[0] for x in ref]),
            max_rel_err([x[1] for x in got], [x[1] for x in ref]))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_tokens(str(tmp_path_factory.mktemp("fp8") / "tokens.jsonl"), 16, 32, 64)


@pytest.fixture(scope="module")
def reference(data):
    return run_ranks(_run, 1, BASE + [f"data.path={data}"], timeout_s=300)[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.dp=2", "parallel.zero=3"],
                                    ["parallel.pp=2"], ["parallel.cp=2"]], ids=["tp2", "dp2z3", "pp2", "cp2"])
def test_tensorwise_layout_equals_one_process(layout, data, reference):
    got = run_ranks(_run, 2, BASE + [f"data.path={data}"] + layout, timeout_s=600)[0]
    el, en = _errs(got, reference)
    assert el < TOL and en < TOL, (layout, el, en)


def _per_shard_amax(x, reduce_amax=False, device_mesh=None, scaling_granularity=None, axiswise_dim=None):
    """Planted: the amax of this rank's shard only."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(x, DTensor):
        return torch.max(torch.abs(x))
    amax = torch.max(torch.abs(x.to_local()))  # each rank its own: declared the same everywhere
    return DTensor.from_local(amax, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)


def _per_shard_fsdp_scales(module):
    """Planted: each FP8-gathered weight's scale from its ZeRO-3 shard, not the whole weight."""
    from torch.distributed.tensor import DTensor

    for m in module.modules():
        if isinstance(m, f8.Fp8Linear) and isinstance(m.weight, DTensor):
            w = m.weight._local_tensor
            amax = w._tensor.abs().max().double().clamp(min=1e-12)
            w._precomputed_scale = (448.0 / amax).float().reshape(())


@pytest.mark.timeout(900)
def test_a_scale_per_shard_fails(monkeypatch, data, reference):
    """Under tp (a weight's tensorwise amax of its shard) and under ZeRO-3 (the FP8 all-gather's
    scale of a shard): the same layouts that match above now miss one process."""
    import torchao.float8
    import torchao.float8.float8_utils as fu

    monkeypatch.setattr(fu, "tensor_to_amax", _per_shard_amax)
    got = run_ranks(_run, 2, BASE + [f"data.path={data}", "parallel.tp=2"], timeout_s=600)[0]
    assert max(_errs(got, reference)) > 1e-4
    monkeypatch.undo()
    monkeypatch.setattr(torchao.float8, "precompute_float8_dynamic_scale_for_fsdp", _per_shard_fsdp_scales)
    got = run_ranks(_run, 2, BASE + [f"data.path={data}", "parallel.dp=2", "parallel.zero=3"], timeout_s=600)[0]
    assert max(_errs(got, reference)) > 1e-4


# ------------------------------------------------------------------ refusals, before any rank starts
@pytest.mark.parametrize("extra,field,words", [
    (["train.fp8.recipe=delayed"], "train.fp8.recipe", "tensorwise, rowwise, blockwise"),
    (["cluster=a100-80gb-8x"], "train.precision", "valid: fp32, bf16"),
    (["parallel.tp=4", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_hidden=96", "parallel.dp=1"],
     "train.precision", "multiples of 16"),
    (["model.moe.num_experts=4", "parallel.ep=2", "parallel.dp=2"], "train.precision", "parallel.ep=1"),
    (["train.fp8.recipe=blockwise"], "train.precision", "multiples of 128"),
    (["train.fp8.recipe=rowwise", "parallel.cp=2"], "train.fp8.recipe", "valid with cp > 1"),
])
def test_bad_fp8_input_exits_2_with_one_line(extra, field, words):
    r = subprocess.run([sys.executable, "launch.py", "recipe=tiny", "train.precision=fp8", "parallel.tp=1",
                        *extra, "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:") and field in ln]
    assert lines and any(words in ln for ln in lines), r.stdout + r.stderr
