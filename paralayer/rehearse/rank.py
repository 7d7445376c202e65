"""One rehearsed rank: the training runtime's build and one optimizer step, on fake tensors.

Why it can run a 1,024-rank layout on a laptop: the process joins torch's fake process group
(``FakeStore``, backend ``"fake"``: every collective completes at once, moving nothing) as the
chosen rank of the full world, and everything after the model's meta build runs under
``FakeTensorMode`` (``to_empty`` inside the mode gives weights with shapes and no storage). The
build and the step are the training runtime's own named steps (``train.build_model``,
``build_optimizer``, ``build_reducer``, ``build_runner``, ``forward_backward``,
``reduce_and_clip_tensors``, the optimizer's step); what differs is only what cannot run on fake
data:

- tokens are synthetic (no dataset is read; data loading is not a layout question);
- the pipeline's P2P warm-up vote (an all-reduce and ``.item()``) is replaced by the static
  stage shapes it would agree on (``PipelineRunner(rehearse=True)``);
- the step's scalars (loss, grad norm) stay tensors: nothing is read back to Python;
- MoE routers spread tokens evenly over the experts (split sizes of the all-to-all are data);
- the global batch is cut to the fewest microbatches that reach the schedule's steady state
  (reported; the plan is evaluated for the same batch, so the two are compared like for like);
- for a GPU layout, MLA's attention core runs the memory-efficient kernel's op (SDPA's choice on a
  GPU for its unequal q/k and v widths), not the CPU's math path.
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
        # the frame's module name, not its path: a checkout may sit under a folder named rehearse or
        # paralayer (git clone's default), which a path would take for the package
        mod = str(tb.tb_frame.f_globals.get("__name__", ""))
        if mod.startswith("paralayer.") and not mod.startswith("paralayer.rehearse."):
            where = f"{mod}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _tokens(run: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the step's batch (synthetic ids), sharded over cp as training does."""
    cfg, d = run.cfg, run.degree
    m = int(run.plan.microbatches)
    shape = (cfg.train.micro_batch * m, cfg.model.seq_len)
    tokens = torch.zeros(shape, dtype=torch.long)
    labels = torch.zeros(shape, dtype=torch.long)
    if d["cp"] > 1:
        from paralayer.parallel.context import zigzag_shard

        cp_rank = run.meshes.local_rank("cp")
        tokens = zigzag_shard(tokens, 1, d["cp"], cp_rank)
        labels = zigzag_shard(labels, 1, d["cp"], cp_rank)
    return tokens, labels


def build_run(cfg: Config, plan: Any, meshes: Any, fake_mode: Any) -> Any:
    """train.setup() without what needs real data or real values: the dataset (synthetic tokens
    instead) and the peak-FLOP/s agreement (a broadcast read back with ``.item()``). The mesh is
    built before the fake mode (its rank tables are real tensors)."""
    from paralayer.runtime import train as T

    device = torch.device("cpu")
    torch.manual_seed(cfg.train.seed)
    built = T.build_model(cfg, plan, meshes, device, materialize=fake_mode)  # split/shard on meta
    # the tied pair (tied embeddings, or MTP's embedding copy under pp) is read off the mesh's rank
    # table with .tolist(): under the fake mode that table turns fake and has no values to read
    tied_group = T.build_tied_group(cfg, plan, meshes)
    with fake_mode:
        return _finish_run(cfg, plan, meshes, built, device, tied_group)


def _finish_run(cfg: Config, plan: Any, meshes: Any, built: Any, device: torch.device, tied_group: Any) -> Any:
    from paralayer.runtime import mtp_step, precision
    from paralayer.runtime import train as T

    opt, sched = T.build_optimizer(cfg, built, meshes)
    scaling = T.grad_scaling(plan, meshes)
    run = T.RankRun(cfg=cfg, plan=plan, device=device, meshes=meshes, built=built, opt=opt, sched=sched,
                    scaling=scaling, reducer=T.build_reducer(scaling, built, meshes), runner=None, dataset=None,
                    # the MTP depths' loss joins the gradient, as runtime/train.py builds it
                    loss_fn=T.make_loss_fn(cfg, plan, cfg.model.seq_len - 1, mtp_step.mtp_chunk(built.chunks)),
                    tied_group=tied_group,
                    autocast_dtype=precision.autocast_dtype(precision.mode(cfg, device, meshes.size("dp_cp"))),
                    ckpt_dir=None, rehearsing=True)
    gpu = str(getattr(plan, "device", "cpu")) != "cpu"
    for c in built.chunks:  # MoE: even routing, no statistics read back (module docstring)
        for mod in c.modules():
            if hasattr(mod, "even_routing"):
                mod.even_routing = True
                mod.count_stats = False
            if gpu and hasattr(mod, "fused_kernel"):  # MLA: the attention kernel a GPU would run
                mod.fused_kernel = True
        if getattr(c, "mtp", None) is not None:  # L_MTP joins the gradient; its value is not read
            c.mtp.read_loss = False  # (count_stats, model/mtp.py, gates the MTP pass itself)
    # MuonClip: each attention records its heads' max logit in forward, as the runtime's; the rescale
    # after the step reads those values (data-dependent), so it is not run on fake tensors
    run.qk_clip = T.qk_clip.build(cfg, built, meshes)
    run.runner = T.build_runner(run)
    return run


def _gathered_through_step(run: Any) -> bool:
    """ZeRO-2 under FSDP: weights stay gathered from forward to backward, under a pipeline too (its
    stages neither reshard after forward nor after each microbatch's backward under ZeRO-2:
    parallel/pipeline/stage_hooks.py ``stage_reducing_each_microbatch``)."""
    return int(run.cfg.parallel.zero) == 2 and run.meshes.size("dp_cp") > 1


def _fsdp_gather_dtype(run: Any) -> "torch.dtype | None":
    """The dtype FSDP2 gathers the weights in (MixedPrecisionPolicy's param_dtype; None: their own),
    as runtime/build.py passes it to ``apply_fsdp``."""
    from paralayer.runtime import precision

    return precision.fsdp_param_dtype(precision.mode(run.cfg, run.device, run.meshes.size("dp_cp")))


def step(run: Any, tokens: torch.Tensor, labels: torch.Tensor) -> None:
    """train.train_step() on fake tensors: the same forward, backward, reduction, clipping and
    update, with the loss and the grad norm left as tensors (nothing to read back)."""
    from paralayer.runtime import moe_step
    from paralayer.runtime import train as T

    run.opt.zero_grad(set_to_none=True)
    moe_step.reset(run.built.chunks)
    if run.qk_clip is not None:
        run.qk_clip.reset()
    local_loss = T.forward_backward(run, tokens, labels)
    T.reduce_and_clip_tensors(run, local_loss)
    run.opt.step()
    moe_step.update_bias(run.built.chunks, run.cfg, run.meshes)
    run.sched.step()


def _ep_bytes(run: Any, reset: bool = False) -> dict:
    """The MoE blocks' ``ep_bytes_sent`` (parallel/expert_node.py) summed: {local, intra_node,
    inter_node}; ``reset``: and zero them."""
    total: dict = {}
    for chunk in run.built.chunks:
        for mod in chunk.modules():
            sent = getattr(mod, "ep_bytes_sent", None) or {}
            for k, v in sent.items():
                total[k] = total.get(k, 0) + int(v)
                if reset:
                    sent[k] = 0
    return total


def rehearse_rank(cfg: Config, plan_d: dict, rank: int) -> dict:
    """Build and step ``rank`` of the plan's world on fake tensors; measure what it holds, sends
    and computes. Raises :class:`RehearsalError` naming the rank and the module on failure."""
    from paralayer.compat import private
    from paralayer.rehearse import memory as rmem
    from paralayer.rehearse.comm import CollectiveCounter, group_axes, group_sizes
    from paralayer.rehearse.flops import LocalFlopCounter
    from paralayer.runtime import train as T

    FakeTensorMode = private("torch._subclasses.fake_tensor", "FakeTensorMode")
    t0, c0 = time.perf_counter(), time.process_time()
    plan = T.as_plan(plan_d)
    _init_fake(rank, int(plan.world_size))
    phase = "build"
    try:
        from paralayer.parallel.mesh import build_mesh

        meshes = build_mesh(plan, "cpu")
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        run = build_run(cfg, plan, meshes, fake_mode)
        with fake_mode:
            coords = {ax: meshes.local_rank(ax) for ax in ("pp", "dp", "cp", "tp")}
            if meshes.expert is not None:
                coords["ep"] = meshes.local_rank("ep")
            extra = {"pp": run.tied_group} if run.tied_group is not None else {}
            tokens, labels = _tokens(run)
            phase = "step"
            counter = CollectiveCounter(group_axes(meshes, {g.group_name: a for a, g in extra.items()}),
                                        group_sizes(meshes, extra))
            counter.dp_names = {meshes[a].get_group().group_name for a in ("dp_cp", "dp")}
            _ep_bytes(run, reset=True)  # the pipeline stages' shape inference ran the MoE blocks at build
            saved = rmem.SavedPeak([*run.built.params, tokens, labels])
            flops = LocalFlopCounter(fake_mode)
            with flops, saved, counter:
                step(run, tokens, labels)
            params = run.built.params
            weights = rmem.param_bytes(params, _gathered_through_step(run), _fsdp_gather_dtype(run))
            out = {
                "rank": rank, "coords": coords,
                # autocast's bf16 copies of the weights count with the weights, as the plan counts them
                "memory_bytes": {"params": weights + saved.weight_copy_bytes,
                                 "grads": rmem.grad_bytes(params),
                                 # + QK-clip's max-logit buffers (MuonClip's state beside Muon's momentum)
                                 "optimizer": rmem.optimizer_bytes(run.opt) + rmem.qk_clip_bytes(run.qk_clip),
                                 "activations": int(saved.peak_bytes)},
                "collectives": counter.table(),
                "flops": float(flops.get_total_flops()),
                "flops_by_op": {str(k): float(v) for k, v in flops.get_flop_counts().get("Global", {}).items()},
                "weight_copy_bytes": saved.weight_copy_bytes,
                "weight_copies_per_weight": max(saved.copies_per_weight.values(), default=0),
            }
            sent = _ep_bytes(run)
            if sent:  # the expert rows this rank sent, by destination (plan: comm.ep's *_node_bytes)
                out["ep_bytes_by_destination"] = sent
    except Exception as exc:  # noqa: BLE001 - reported as the rank's failure, exit 2
        raise RehearsalError(f"rank {rank}: the runtime could not {phase} at this layout in {_module_of(exc)}: "
                             f"{type(exc).__name__}: {exc}") from exc
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    mb = out["memory_bytes"]
    mb["total"] = mb["params"] + mb["grads"] + mb["optimizer"] + mb["activations"]
    out["seconds"] = time.perf_counter() - t0
    out["cpu_seconds"] = time.process_time() - c0  # this rank's own CPU time: what a busy machine's wall hides
    out["host_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main(argv: list[str]) -> int:
    """``python -m paralayer.rehearse.rank DIR RANK``: DIR holds resolved.yaml and plan.json
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
