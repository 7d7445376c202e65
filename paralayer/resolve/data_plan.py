"""The plan knows the data: tokens per source, the epochs the run implies, and bad shards, before launch.

For ``data.format=indexed`` every source's shards are read by their .idx header only (O(1) per
shard, idx_header.py), so the dry run states each source's tokens, its normalised weight and the
epochs that ``train.steps`` (or ``train.tokens``) implies, warns when a source repeats more than
:data:`REPEAT_WARN` times, and turns what is wrong (magic, version, a truncated .bin, a dtype
that cannot hold the vocabulary, a source shorter than one sequence, a blend weight ≤ 0 or NaN,
validation sharing a file with training) into plan errors: ``--dry-run`` exits 2.
Other formats: tokens are known only after prepare, so a source's tokens and epochs are null.
Torch- and numpy-free.
"""
from __future__ import annotations

import math
import os
from typing import Any, List, Optional

from paralayer.inputs.idx_header import IdxError, indexed_prefixes, read_header
from paralayer.resolve.rules import Issue

#: A source read more than this many times over the run gets a warning.
REPEAT_WARN = 4.0


def _entries(data_cfg: Any) -> tuple[list, list]:
    """([(path, weight, field)], errors): data.blend's entries, or data.path with weight 1."""
    blend = list(getattr(data_cfg, "blend", None) or [])
    if not blend:
        return ([(data_cfg.path, 1.0, "data.path")] if data_cfg.path is not None else []), []
    out, errors = [], []
    if data_cfg.path is not None:
        errors.append(Issue("data.blend", f"data.path is also set ({data_cfg.path}): a run reads data.path or "
                            "data.blend, not both (set data.path=null)"))
    for i, e in enumerate(blend):
        path = e.get("path") if hasattr(e, "get") else None
        weight = e.get("weight") if hasattr(e, "get") else None
        if path is None:
            errors.append(Issue(f"data.blend[{i}].path", "needs a path (each entry is {path: P, weight: W})"))
            continue
        try:
            w = float("nan") if isinstance(weight, bool) else float(weight)  # true is no weight
        except (TypeError, ValueError):
            w = float("nan")
        if not math.isfinite(w) or w <= 0:
            errors.append(Issue(f"data.blend[{i}].weight",
                                f"{path}: is {weight}: a weight must be a finite number > 0"))
            continue
        out.append((path, w, f"data.blend[{i}].path"))
    return out, errors


def _plain_files(path: Any) -> List[str]:
    """The files a text/jsonl/parquet/tokens path names (a file, or a directory's visible files)."""
    if isinstance(path, (list, tuple)):
        return [f for p in path for f in _plain_files(p)]
    path = str(path)
    if os.path.isdir(path):
        return sorted(os.path.join(path, n) for n in os.listdir(path)
                      if not n.startswith(".") and os.path.isfile(os.path.join(path, n)))
    return [path] if os.path.exists(path) else []


def _files(path: Any, fmt: str) -> List[str]:
    if fmt != "indexed":
        return _plain_files(path)
    try:
        return [p + ext for p in indexed_prefixes(path) for ext in (".bin", ".idx")]
    except IdxError:
        return []


def training_files(data_cfg: Any) -> List[str]:
    """Real paths of every file training reads (data.path or data.blend)."""
    entries, _ = _entries(data_cfg)
    return [os.path.realpath(f) for p, _, _ in entries for f in _files(p, data_cfg.format)]


def valid_shares(data_cfg: Any, valid_path: Any) -> List[str]:
    """The files validation (``valid_path``, read with data.format) shares with training."""
    if valid_path is None:
        return []
    train = set(training_files(data_cfg))
    return [f for f in (os.path.realpath(x) for x in _files(valid_path, data_cfg.format)) if f in train]


def _indexed_tokens(path: Any, vocab_size: int, field: str) -> tuple[Optional[int], list]:
    try:
        prefixes = indexed_prefixes(path)
        headers = [read_header(p) for p in prefixes]
    except IdxError as exc:
        return None, [Issue(field, str(exc))]
    errors = [Issue(field, f"{h.prefix}.idx: dtype {h.dtype} (code {h.dtype_code}) cannot hold model.vocab_size="
                    f"{vocab_size} ids (largest {h.max_id})") for h in headers if vocab_size - 1 > h.max_id]
    return sum(h.tokens for h in headers), errors


def plan_data(cfg: Any) -> tuple[Optional[dict], list, list]:
    """(the plan's ``data`` section or None, errors, warnings)."""
    d = cfg.data
    entries, errors = _entries(d)
    warnings: list = []
    seq = int(cfg.model.seq_len)
    positions = (float(cfg.train.tokens) / seq if getattr(cfg.train, "tokens", None)
                 else float(cfg.train.steps) * cfg.train.global_batch)
    total_w = sum(w for _, w, _ in entries) or 1.0
    frac = float(getattr(d, "valid_fraction", 0.0) or 0.0)
    sources = []
    for path, w, field in entries:
        tokens = None
        if d.format == "indexed":
            tokens, errs = _indexed_tokens(path, int(cfg.model.vocab_size), field)
            errors += errs
        src = {"path": path, "tokens": tokens, "weight": w / total_w, "epochs": None}
        if tokens is not None:
            n = tokens // seq
            if n < 1:
                errors.append(Issue(field, f"{path}: holds {tokens} tokens, fewer than one sequence "
                                    f"(model.seq_len={seq})"))
            else:
                n_train = n - (0 if frac <= 0 else max(1, min(n - 1, int(math.floor(n * frac)))))
                src["sequences"] = n_train
                src["epochs"] = positions * src["weight"] / max(n_train, 1)
                if src["epochs"] > REPEAT_WARN:
                    warnings.append(Issue(field, f"{path}: read {src['epochs']:.1f} times ({n_train:,} sequences of "
                                          f"{seq}, weight {src['weight']:.3g}, {positions:,.0f} sequences in the run): "
                                          f"a source repeated more than {REPEAT_WARN:g} times"))
        sources.append(src)
    valid = getattr(d, "valid", None)
    shared = valid_shares(d, valid) if valid is not None else []
    if shared:
        errors.append(Issue("data.valid", f"{valid}: validation and training share a file ({shared[0]})"))
    section = {"format": d.format, "seq_len": seq, "sources": sources} if sources else None
    return section, errors, warnings


def apply(cfg: Any, plan: Any) -> None:
    """Add the data section, errors and warnings to ``plan`` (resolve/plan.py calls this)."""
    section, errors, warnings = plan_data(cfg)
    if section is not None:
        plan.extra["data"] = section
    if errors:
        plan.errors.extend(i.to_dict() for i in errors)
        plan.valid = False
    plan.warnings.extend(i.to_dict() for i in warnings)
