"""Validation: the held-out loss every ``train.eval_every`` steps, under any layout.

What is computed. ``val_loss`` is the mean next-token cross-entropy over ``train.eval_batches``
(K) global batches of the validation dataset, defined exactly as the training ``loss`` (DESIGN.md;
the MoE aux loss is not part of it). Eval batch k (0-based) is what training step k+1 would read
from that dataset: with ``data.valid`` (read in order, no shuffle) sequences k·B … (k+1)·B−1,
B = ``train.global_batch``; the same K batches at every eval. Each dp rank takes its share, each
cp rank its zigzag shard, and the share is split into the training's microbatches. Any dataset
with the training dataset's ``get_batch(step, dp_rank, dp_size, global_batch)`` can be evaluated.

How, per layout. pp = 1: the model's forward and the training's ``loss_fn`` per microbatch. pp > 1:
a forward-only pass over the pp group (paralayer/parallel/pipeline/forward_only.py); the training's
schedule is not touched. tp: under ``loss_parallel`` as in training. cp: ring attention and the
cp loss weight (both inside the model and ``loss_fn``). ep: the same all-to-all dispatch. dp and
ZeRO: each rank's mean loss averaged over dp·cp, as the training loss is.

What it leaves as it found it, so the training trajectory is bit-identical with and without
eval: no gradients (``torch.no_grad``); the RNG state (forked); the MoE routing statistics and
the sigmoid router's load counter (``count_stats`` off during eval); FSDP2 parameters (every
FSDP module is resharded afterwards, as the optimizer step left them: under ZeRO-2 a forward
outside backward would otherwise keep them gathered); the pipeline schedule and the optimizer
(never called). It runs after the step's record is made, so the step's time leaves it out.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from paralayer.data.errors import DataError
from paralayer.parallel.tensor import loss_parallel_ctx


@dataclasses.dataclass
class Validator:
    """The validation dataset and when to evaluate it (``train.eval_every``, ``train.eval_batches``)."""

    dataset: Any
    every: int
    batches: int

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


def build_valid_dataset(cfg: Any):
    """The held-out data through the training's own builder, read in order: ``data.valid`` (a
    corpus read with data.format), else ``data.valid_fraction`` (the held-out tail of each source,
    disjoint from training; paralayer/data/dataset.py build_valid_dataset)."""
    from paralayer.data.dataset import build_valid_dataset as build

    data = cfg.data
    valid = getattr(data, "valid", None)
    if not valid and not float(getattr(data, "valid_fraction", 0.0) or 0.0) > 0:
        raise DataError("train.eval_every > 0 needs held-out data: set data.valid=PATH or data.valid_fraction",
                        field="data.valid")
    cache_dir = data.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "paralayer")
    try:
        return build(data, cfg.model.seq_len, cfg.train.seed, cache_dir, global_batch=cfg.train.global_batch,
                     vocab_size=cfg.model.vocab_size, path=valid or None)
    except DataError as exc:  # the same checks as data.path, reported under data.valid
        if exc.field != "data.path" or not valid:
            raise
        raise DataError(exc.reason, field="data.valid", file=exc.file, line=exc.line) from None


def build_validator(run: Any, dataset: Any = None) -> Optional[Validator]:
    """None when ``train.eval_every`` is 0; else a :class:`Validator` over ``dataset`` (default:
    ``data.valid``). Warns on rank 0 when the dataset holds fewer than K global batches (they wrap)."""
    t = run.cfg.train
    every = int(getattr(t, "eval_every", 0) or 0)
    if every <= 0:
        return None
    dataset = dataset if dataset is not None else build_valid_dataset(run.cfg)
    batches = int(getattr(t, "eval_batches", 1) or 1)
    n, need = len(dataset), batches * t.global_batch
    if n < need and dist.get_rank() == 0:
        print(f"paralayer: warning: data.valid holds {n} sequences, fewer than train.eval_batches·"
              f"train.global_batch = {need}; the eval batches wrap around", flush=True)
    return Validator(dataset=dataset, every=every, batches=batches)


def maybe_evaluate(validator: Optional[Validator], run: Any, step: int, record: dict) -> None:
    """At an eval step, ``record["val_loss"]`` (then metrics.jsonl, the console and W&B have it)."""
    if validator is None or not validator.due(step):
        return
    record["val_loss"] = validation_loss(run, validator.dataset, validator.batches)


def validation_loss(run: Any, dataset: Any, batches: int) -> float:
    """The mean next-token CE over ``batches`` global batches of ``dataset``; the same on every rank."""
    with _eval_state(run):
        total = torch.zeros((), dtype=torch.float32, device=run.device)
        for k in range(batches):
            tokens, labels = eval_batch(run, dataset, k)
            total = total + _batch_loss(run, tokens, labels)
        local = (total / batches).reshape(1)
        dp_cp = run.meshes["dp_cp"]
        if dp_cp.size() > 1:  # as the training loss: the mean over the data and context ranks
            dist.all_reduce(local, group=dp_cp.get_group())
            local /= dp_cp.size()
    return float(local[0])


def eval_batch(run: Any, dataset: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and labels of eval batch ``k`` (0-based): its dp share, its cp shard."""
    from paralayer.runtime.batch import rank_batch

    return rank_batch(run, dataset, k + 1)


def _batch_loss(run: Any, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """This rank's mean loss over the batch's microbatches (as the training step's local loss)."""
    m, dtype, tp = run.scaling.microbatches, run.autocast_dtype, run.degree["tp"]
    if run.degree["pp"] > 1:
        from paralayer.parallel.pipeline.forward_only import forward_loss

        return forward_loss(run.built.chunks, run.meshes["pp"].get_group(), len(run.plan.stage_layers),
                            run.plan.schedule, run.loss_fn, tokens, labels, m, loss_parallel=tp > 1,
                            autocast_dtype=dtype)
    model = run.built.chunks[0]
    loss_sum = torch.zeros((), dtype=torch.float32, device=run.device)
    for mb_tokens, mb_labels in zip(tokens.chunk(m), labels.chunk(m)):
        with loss_parallel_ctx(tp > 1), torch.autocast(run.device.type, dtype=dtype, enabled=dtype is not None):
            loss = run.loss_fn(model(mb_tokens), mb_labels)
        loss_sum = loss_sum + loss.detach().float() / m
    return loss_sum


@contextlib.contextmanager
def _eval_state(run: Any) -> Iterator[None]:
    """No grad, RNG forked, MoE statistics paused; FSDP modules resharded afterwards."""
    moe = [layer.feed_forward for c in run.built.chunks for layer in c.layers.values()
           if hasattr(layer.feed_forward, "count_stats")]
    counting = [ff.count_stats for ff in moe]
    devices = [run.device] if run.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=run.device.type):
            for ff in moe:
                ff.count_stats = False
            yield
    finally:
        for ff, was in zip(moe, counting):
            ff.count_stats = was
        _reshard(run.built.chunks)


def _reshard(chunks) -> None:
    from torch.distributed.fsdp import FSDPModule

    for chunk in chunks:
        for mod in chunk.modules():
            if isinstance(mod, FSDPModule):
                mod.reshard()
