"""One rehearsed rank: the training runtime's build and one optimizer step, on fake tensors.

Why it can run a 1,024-rank layout on a laptop: the process joins torch's fake process group
(``FakeStore``, backend ``"fake"``: every collective completes at once, moving nothing) as the
chosen rank of the full world, and everything after the model's meta build runs under
``FakeTensorMode`` (``to_empty`` inside the mode gives weights with shapes and no storage). The
build is the training runtime's own (``train.build_model``, ``build_optimizer``,
``make_loss_fn``, the ZeRO-0/1 reducer, ``PipelineRunner``, ``clip_grad_norm``); what differs is
only what cannot run on fake data:

- tokens are synthetic (no dataset is read; data loading is not a layout question);
- the pipeline's P2P warm-up vote (an all-reduce and ``.item()``) is replaced by the static
  stage shapes it would agree on (``PipelineRunner(rehearse=True)``);
- the step's scalars (loss, grad norm) stay tensors: nothing is read back to Python;
- MoE routers spread tokens evenly over the experts (split sizes of the all-to-all are data);
- the global batch is cut to the fewest microbatches that reach the schedule's steady state
  (reported; the plan is evaluated for the same batch, so the two are compared like for like).
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from paralayer import config as config_mod
from paralayer.config import Config


class RehearsalError(RuntimeError):
    """The runtime could not build or step this rank; the message names the rank and the module."""


def _init_fake(rank: int, world: int) -> None:
    from paralayer.compat import fake_store

    dist.init_process_group("fake", rank=rank, world_size=world, store=fake_store())


def _module_of(exc: BaseException) -> str:
    """The innermost frame of ours in the traceback: the module where the runtime failed."""
    tb = exc.__traceback__
    where = "?"
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        if "paralayer" in fn and "rehearse" not in fn:
            mod = fn.split("paralayer", 1)[1].strip("/").replace("/", ".").removesuffix(".py")
            where = f"paralayer.{mod}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _tokens(cfg: Config, plan: dict, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the step's batch (synthetic ids), sharded over cp as training does."""
    cp = int(plan["degrees"]["cp"])
    m = int(plan["microbatches"])
    s = cfg.model.seq_len
    tokens = torch.zeros((cfg.train.micro_batch * m, s), dtype=torch.long)
    labels = torch.zeros((cfg.train.micro_batch * m, s), dtype=torch.long)
    if cp > 1:
        from paralayer.parallel.context import zigzag_shard

        tokens = zigzag_shard(tokens, 1, cp, cp_rank)
        labels = zigzag_shard(labels, 1, cp, cp_rank)
    return tokens, labels


def _step(cfg: Config, plan: dict, built: Any, opt: Any, reducer: Any, runner: Any, loss_fn: Any,
          tokens: torch.Tensor, labels: torch.Tensor, meshes: Any, autocast_dtype: Any) -> None:
    """The body of train()'s step loop, minus what reads data back to Python."""
    from paralayer.parallel import data as dpar
    from paralayer.parallel import tied_embeddings as tied
    from paralayer.parallel.tensor import local_tensor, loss_parallel_ctx
    from paralayer.runtime import train as T

    d = plan["degrees"]
    tp, pp = int(d["tp"]), int(d["pp"])
    m = int(plan["microbatches"])
    zero = int(cfg.parallel.zero)
    opt.zero_grad(set_to_none=True)
    if runner is not None:
        loss_sum = runner.step(tokens, labels, autocast_dtype=autocast_dtype)
    else:
        loss_sum = torch.zeros(())
        for mb_tokens, mb_labels in zip(tokens.chunk(m), labels.chunk(m)):
            with loss_parallel_ctx(tp > 1):
                with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    logits = built.chunks[0](mb_tokens)
                loss = loss_fn(logits, mb_labels)
                aux = built.chunks[0].aux_loss()
                total = loss if aux is None else loss + cfg.model.moe.aux_loss_coef * aux
                (total / m).backward()
            loss_sum = loss_sum + loss.detach() / m
    if reducer is not None:
        reducer.reduce()
    elif zero >= 2 and meshes.expert is not None:
        for p in built.expert_params:
            if p.grad is not None:
                local_tensor(p.grad).div_(meshes.size("ep"))
    tie = bool(cfg.model.tie_embeddings)
    if tie:
        tied.sum_tied_grads(built.chunks, built.tied_group)
    T._global_loss(loss_sum, meshes)
    dpar.clip_grad_norm(
        built.params, cfg.train.grad_clip, meshes["pp"].get_group() if pp > 1 else None,
        built.expert_params, meshes["ep"].get_group() if meshes.expert is not None else None,
        skip_norm=tied.head_copy(built.chunks) if tie else (), as_tensor=True)
    opt.step()


def rehearse_rank(cfg: Config, plan: dict, rank: int) -> dict:
    """Build and step ``rank`` of ``plan``'s world on fake tensors; measure what it holds, sends
    and computes. Raises :class:`RehearsalError` naming the rank and the module on failure."""
    from paralayer.compat import private

    FakeTensorMode = private("torch._subclasses.fake_tensor", "FakeTensorMode")

    from paralayer.parallel import data as dpar
    from paralayer.parallel import tied_embeddings as tied
    from paralayer.parallel.mesh import build_mesh
    from paralayer.runtime import rehearse_memory as rmem
    from paralayer.runtime import train as T
    from paralayer.runtime.rehearse_comm import CollectiveCounter, group_axes, group_sizes
    from paralayer.runtime.rehearse_flops import LocalFlopCounter

    t0 = time.perf_counter()
    world = int(plan["world_size"])
    d = plan["degrees"]
    tp, pp, cp = int(d["tp"]), int(d["pp"]), int(d["cp"])
    m = int(plan["microbatches"])
    _init_fake(rank, world)
    phase = "build"
    try:
        meshes = build_mesh(plan, "cpu")
        coords = {ax: meshes.local_rank(ax) for ax in ("pp", "dp", "cp", "tp")}
        if meshes.expert is not None:
            coords["ep"] = meshes.local_rank("ep")
        autocast_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
        with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
            torch.manual_seed(cfg.train.seed)
            built = T.build_model(cfg, plan, meshes, torch.device("cpu"))
            opt, _sched = T.build_optimizer(cfg, built, meshes)
            reducer = None
            dp_cp = meshes["dp_cp"]
            if int(cfg.parallel.zero) <= 1 and dp_cp.size() > 1:
                edp = meshes["edp"].get_group() if meshes.expert is not None else None
                reducer = dpar.GradReducer(built.params, dp_cp.get_group(), dp_cp.size(), built.expert_params,
                                           edp, microbatches=m, divide=dp_cp.size() * (m if pp > 1 else 1))
            built.tied_group = None
            extra_axes, extra_groups = {}, {}
            if cfg.model.tie_embeddings and pp > 1 and plan.get("schedule") not in ("zbv", "dualpipev"):
                w = meshes.world.mesh
                built.tied_group = tied.pair_group(w.permute(1, 2, 3, 0).reshape(-1, w.shape[0]).tolist(), rank)
                if built.tied_group is not None:
                    extra_axes[built.tied_group.group_name] = "pp"
                    extra_groups["pp"] = built.tied_group
            loss_fn = T.make_loss_fn(cfg, plan, cfg.model.seq_len - 1)
            runner = None
            if pp > 1:
                from paralayer.parallel.pipeline import PipelineRunner

                runner = PipelineRunner(built.chunks, meshes["pp"], plan, loss_fn, torch.device("cpu"),
                                        microbatch_shape=(cfg.train.micro_batch, cfg.model.seq_len // cp),
                                        loss_parallel=tp > 1,
                                        aux_loss_coef=cfg.model.moe.aux_loss_coef if cfg.model.moe.num_experts else 0.0,
                                        scale_grads=reducer is None, rehearse=True,
                                        autocast_dtype=autocast_dtype)
            tokens, labels = _tokens(cfg, plan, meshes.local_rank("cp"))
            phase = "step"
            counter = CollectiveCounter(group_axes(meshes, extra_axes), group_sizes(meshes, extra_groups))
            saved = rmem.SavedPeak([*built.params, tokens, labels])
            flops = LocalFlopCounter(fake_mode)
            with flops, saved, counter:
                _step(cfg, plan, built, opt, reducer, runner, loss_fn, tokens, labels, meshes, autocast_dtype)
            out = {
                "rank": rank, "coords": coords,
                "memory_bytes": {"params": rmem.param_bytes(built.params), "grads": rmem.grad_bytes(built.params),
                                 "optimizer": rmem.optimizer_bytes(opt), "activations": int(saved.peak_bytes)},
                "collectives": counter.table(),
                "flops": float(flops.get_total_flops()),
                "flops_by_op": {str(k): float(v) for k, v in flops.get_flop_counts().get("Global", {}).items()},
                "flops_by_module": {mod: float(sum(v.values())) for mod, v in flops.get_flop_counts().items()
                                    if os.environ.get("PARALAYER_REHEARSE_FLOPS_BY_MODULE")},
            }
    except Exception as exc:  # noqa: BLE001 - reported as the rank's failure, exit 2
        raise RehearsalError(f"rank {rank}: the runtime could not {phase} at this layout in {_module_of(exc)}: "
                             f"{type(exc).__name__}: {exc}") from exc
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    mb = out["memory_bytes"]
    mb["total"] = mb["params"] + mb["grads"] + mb["optimizer"] + mb["activations"]
    out["seconds"] = time.perf_counter() - t0
    out["host_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main(argv: list[str]) -> int:
    """``python -m paralayer.runtime.rehearse_rank DIR RANK``: DIR holds resolved.yaml and plan.json
    (what a training rank reads); writes DIR/rank-RANK.json, or the error's one line to stderr."""
    run_dir, rank = argv[0], int(argv[1])
    torch.set_num_threads(1)
    cfg = config_mod.from_yaml_file(os.path.join(run_dir, "resolved.yaml"))
    with open(os.path.join(run_dir, "plan.json")) as f:
        plan = json.load(f)
    try:
        out = rehearse_rank(cfg, plan, rank)
    except RehearsalError as exc:
        print(str(exc), file=sys.stderr, flush=True)
        if os.environ.get("PARALAYER_DEBUG"):
            import traceback

            traceback.print_exception(exc.__cause__ or exc)
        return 2
    with open(os.path.join(run_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
