"""The validation data layer: ``data.valid_fraction`` holds each source's last sequences out of
training (disjoint, whatever the shuffle), :func:`build_valid_dataset` returns them (blended by
the same weights under ``data.blend``) or another corpus by the same builder, unshuffled."""
from __future__ import annotations

import dataclasses

import numpy as np

from paralayer.config import DataConfig
from paralayer.data.dataset import build_dataset, build_valid_dataset
from paralayer.data.indexed import IndexedWriter

SEQ = 8


def _shard(prefix, n_seq, base):
    """Sequence i of this shard holds base + i everywhere: a row names its source and index."""
    w = IndexedWriter(str(prefix), 4)
    w.add_documents(np.repeat(base + np.arange(n_seq), SEQ), np.full(n_seq, SEQ))
    w.finalize()
    return str(prefix)


def _ids(ds, steps, gb):
    return [int(r[0]) for k in range(1, steps + 1) for r in ds.get_batch(k, global_batch=gb).numpy()]


def test_held_out_fraction_is_disjoint_and_blended(tmp_path):
    a, b = _shard(tmp_path / "a", 40, 0), _shard(tmp_path / "b", 20, 1000)
    cfg = DataConfig(path=a, format="indexed", shuffle=True, valid_fraction=0.1)
    train = build_dataset(cfg, SEQ, 0, str(tmp_path / "c"), global_batch=4)
    valid = build_valid_dataset(cfg, SEQ, 0, str(tmp_path / "c"), global_batch=4)
    assert train.n_sequences == 36 and valid.n_sequences == 4
    assert set(_ids(train, 27, 4)) == set(range(36))  # three epochs: never a held-out sequence
    assert _ids(valid, 2, 4) == [36, 37, 38, 39] * 2  # unshuffled, wrapping
    assert build_valid_dataset(dataclasses.replace(cfg, valid_fraction=0.0), SEQ, 0, str(tmp_path / "c")) is None
    # a blend: each source's tail held out, validation drawn by the same weights
    blend = [{"path": a, "weight": 2}, {"path": b, "weight": 1}]
    cfg = DataConfig(format="indexed", shuffle=True, blend=blend, valid_fraction=0.25)
    train = build_dataset(cfg, SEQ, 0, str(tmp_path / "c"), global_batch=6)
    valid = build_valid_dataset(cfg, SEQ, 0, str(tmp_path / "c"), global_batch=6)
    seen = set(_ids(train, 20, 6))
    assert seen == set(range(30)) | set(range(1000, 1015))
    v = _ids(valid, 1, 6)
    assert sorted(v) == [30, 31, 32, 33, 1015, 1016]
    # a validation corpus by path: the same builder on another path, unshuffled
    c = _shard(tmp_path / "v", 5, 5000)
    other = build_valid_dataset(DataConfig(path=a, format="indexed", shuffle=True), SEQ, 0, str(tmp_path / "c"),
                                global_batch=5, path=c)
    assert _ids(other, 1, 5) == [5000, 5001, 5002, 5003, 5004]
