"""Training data: tokenizers, an offline corpus, packed datasets and a stateless global-batch sampler.

Conventions (every format)
--------------------------
* A dataset is N sequences of exactly ``seq_len`` token ids (``model.seq_len``).
* The model input is the whole sequence; the labels are the same ids shifted left by one inside the
  sequence, the last position ignored (``-100``), see :func:`labels_for`. The loss (cross-entropy with
  ``ignore_index=-100``) is therefore the mean over the ``seq_len - 1`` real next-token predictions —
  the Hugging Face convention (``model(input_ids, labels=input_ids)``).
* ``format=tokens``: a JSONL file, one ``{"input_ids": [...]}`` per line, each exactly ``seq_len``
  long; line i is sequence i (file order, nothing dropped or reordered).
* ``format=text | jsonl | parquet``: read through ``datasets.load_dataset("text" | "json" |
  "parquet", data_files=PATH)`` on the local file(s) (text: one document per line; jsonl/parquet: the
  ``data.text_field`` column), each document tokenised and followed by the tokenizer's EOS/separator
  id, the documents concatenated in file order and the stream cut into ``seq_len`` chunks (the
  incomplete tail is dropped).
* ``data.path: null``: a corpus generated offline by :func:`make_corpus` (format text).

The tokenised/packed result is cached in ``cache_dir`` (one ``.npy`` per (file, size, mtime,
format, text field, tokenizer content, seq_len)); ranks that build it at the same time take a file
lock, so one builds and the others read.

Sampling: :func:`global_batch_indices` is a pure function of (step, global_batch, n_sequences,
shuffle, seed). With ``shuffle=false`` step k (1-based) takes sequences (k−1)·B … k·B−1 in order,
wrapping around at the end of the data; with ``shuffle=true`` the same positions index a permutation
of the sequences drawn per epoch from (seed, epoch). Each dp rank takes a contiguous share of the
global batch (:func:`rank_share`), so any dp size sees the same global batch. The sampler has no
state: the resume state is the step number only.

Network: this module never touches the network. It sets ``HF_DATASETS_OFFLINE=1`` and
``HF_HUB_OFFLINE=1`` before ``datasets`` is imported (and forces the flags on if it already was).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import random
import tempfile
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Optional, Sequence

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

IGNORE_INDEX = -100
FORMATS = ("text", "jsonl", "parquet", "tokens")
_CACHE_VERSION = 1
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]", "<sep>")


# ---------------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """Bytes of UTF-8: ids 0..255, vocab 256. Documents are separated by byte 0 (NUL), which
    never occurs in ordinary text."""

    vocab_size = 256
    eos_id = 0
    name = "byte"

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (``tokenizers.Tokenizer.from_file``).

    ``eos_id`` is the first of ``<|endoftext|> </s> <|end_of_text|> <eos> <|eos|> [SEP] <sep>``
    found in the vocabulary; without one, documents are joined with nothing between them.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise FileNotFoundError(f"data.tokenizer: no such file: {path}")
        self.path = os.path.abspath(path)
        self._tok = Tokenizer.from_file(self.path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id: Optional[int] = None
        for t in _EOS_CANDIDATES:
            i = self._tok.token_to_id(t)
            if i is not None:
                self.eos_id = int(i)
                break
        with open(self.path, "rb") as f:
            self.name = "hf-" + hashlib.sha256(f.read()).hexdigest()[:16]

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(path: Optional[str] = None):
    """``None`` → :class:`ByteTokenizer`; a path → :class:`HFTokenizer` from that JSON file."""
    return ByteTokenizer() if not path else HFTokenizer(path)


# ---------------------------------------------------------------------------------- corpus
_NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Henry", "Iris", "Jack",
          "Lena", "Max", "Nora", "Oscar", "Paul", "Rosa"]
_NOUNS = [("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("child", "children"),
          ("farmer", "farmers"), ("teacher", "teachers"), ("king", "kings"), ("girl", "girls"),
          ("boy", "boys"), ("horse", "horses"), ("fox", "foxes"), ("sailor", "sailors"),
          ("baker", "bakers"), ("doctor", "doctors"), ("friend", "friends"), ("robot", "robots")]
_THINGS = ["apple", "book", "river", "house", "garden", "bridge", "letter", "stone", "song",
           "window", "boat", "road", "tree", "lamp", "map", "cake", "door", "hill", "ship", "coin"]
_ADJS = ["small", "big", "old", "young", "red", "green", "quiet", "happy", "tired", "bright",
         "dark", "warm", "cold", "clever", "brave", "lazy"]
_TRANS = [("sees", "see", "saw"), ("finds", "find", "found"), ("likes", "like", "liked"),
          ("carries", "carry", "carried"), ("opens", "open", "opened"), ("paints", "paint", "painted"),
          ("builds", "build", "built"), ("reads", "read", "read"), ("wants", "want", "wanted"),
          ("keeps", "keep", "kept"), ("watches", "watch", "watched"), ("makes", "make", "made")]
_INTRANS = [("sleeps", "sleep", "slept"), ("runs", "run", "ran"), ("sings", "sing", "sang"),
            ("waits", "wait", "waited"), ("laughs", "laugh", "laughed"), ("walks", "walk", "walked"),
            ("works", "work", "worked"), ("dreams", "dream", "dreamed")]
_PREPS = ["near", "under", "behind", "beside", "across", "inside", "over", "by"]
_ADVS = ["slowly", "quickly", "quietly", "happily", "again", "today", "often", "never"]
_TIMES = ["In the morning", "At night", "Every day", "After the rain", "Before dinner",
          "On Sunday", "Later", "Once upon a time"]
_CONJ = ["because", "while", "and then", "but", "so", "when"]


def _zipf_choice(rng: random.Random, items: Sequence[Any]) -> Any:
    # Zipf-like weights: common words are much more common, as in real text.
    weights = _ZIPF_CACHE.get(len(items))
    if weights is None:
        weights = _ZIPF_CACHE[len(items)] = [1.0 / (i + 1) for i in range(len(items))]
    return rng.choices(items, weights=weights, k=1)[0]


_ZIPF_CACHE: dict = {}


def _noun_phrase(rng: random.Random, plural: bool) -> str:
    if not plural and rng.random() < 0.25:
        return _zipf_choice(rng, _NAMES)
    noun = _zipf_choice(rng, _NOUNS)[1 if plural else 0]
    det = rng.choice(["the", "some", "many", "two"] if plural else ["the", "a", "this", "that"])
    if rng.random() < 0.45:
        noun = f"{_zipf_choice(rng, _ADJS)} {noun}"
    return f"{det} {noun}"


def _object(rng: random.Random) -> str:
    thing = _zipf_choice(rng, _THINGS)
    s = f"{rng.choice(['the', 'a', 'her', 'his', 'their'])} "
    if rng.random() < 0.35:
        s += f"{_zipf_choice(rng, _ADJS)} "
    s += thing
    if rng.random() < 0.25:
        s += f" {rng.choice(_PREPS)} the {_zipf_choice(rng, _THINGS)}"
    return s


def _clause(rng: random.Random, past: bool) -> str:
    plural = rng.random() < 0.35
    subj = _noun_phrase(rng, plural)
    form = 2 if past else (1 if plural else 0)
    if rng.random() < 0.6:
        verb = _zipf_choice(rng, _TRANS)[form]
        s = f"{subj} {verb} {_object(rng)}"
    else:
        verb = _zipf_choice(rng, _INTRANS)[form]
        s = f"{subj} {verb}"
        if rng.random() < 0.5:
            s += f" {rng.choice(_PREPS)} the {_zipf_choice(rng, _THINGS)}"
    if rng.random() < 0.3:
        s += f" {_zipf_choice(rng, _ADVS)}"
    return s


def _sentence(rng: random.Random, past: bool) -> str:
    s = _clause(rng, past)
    if rng.random() < 0.3:
        s = f"{rng.choice(_TIMES)}, {s}"
    if rng.random() < 0.3:
        s += f" {rng.choice(_CONJ)} {_clause(rng, past)}"
    s = s[0].upper() + s[1:]
    return s + ("?" if rng.random() < 0.05 else ".")


def _paragraph(rng: random.Random) -> str:
    past = rng.random() < 0.5  # one tense per paragraph: a long-range regularity to learn
    return " ".join(_sentence(rng, past) for _ in range(rng.randint(3, 8)))


def _atomic_write_bytes(path: str, data: bytes) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+") as f:
        try:
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - not POSIX
            pass
        yield


def make_corpus(path: str, n_bytes: int = 2_000_000, seed: int = 0) -> str:
    """Write a learnable English-like text corpus to ``path`` (one paragraph per line), offline and
    deterministically: a small probabilistic grammar (names, noun phrases with agreement, transitive
    and intransitive verbs in one tense per paragraph, prepositional phrases, Zipf-weighted fixed
    vocabulary of ~150 words). Same (n_bytes, seed) → the same bytes on any machine.

    Cached by path: an existing file is kept as it is. The write is atomic (temp file + rename), so
    concurrent callers never see a partial file. Returns ``path``. Size: the first paragraph
    boundary at or past ``n_bytes``.
    """
    if os.path.isfile(path):
        return path
    with _file_lock(path + ".lock"):
        if os.path.isfile(path):
            return path
        rng = random.Random(seed)
        parts: List[bytes] = []
        size = 0
        while size < n_bytes:
            line = (_paragraph(rng) + "\n").encode("utf-8")
            parts.append(line)
            size += len(line)
        _atomic_write_bytes(path, b"".join(parts))
    return path


def default_corpus_path(cache_dir: str, n_bytes: int = 2_000_000, seed: int = 0) -> str:
    return os.path.join(cache_dir, f"corpus-v1-seed{seed}-{n_bytes}.txt")


# ---------------------------------------------------------------------------------- labels
def labels_for(input_ids: torch.Tensor) -> torch.Tensor:
    """Labels for next-token prediction inside each sequence: ``labels[..., i] = ids[..., i+1]``,
    the last position ``-100`` (ignored by ``cross_entropy(ignore_index=-100)``)."""
    ids = torch.as_tensor(input_ids)
    labels = torch.full_like(ids, IGNORE_INDEX, dtype=torch.long)
    labels[..., :-1] = ids[..., 1:]
    return labels


# ---------------------------------------------------------------------------------- sampling
@functools.lru_cache(maxsize=8)
def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch)]).permutation(n)


def global_batch_indices(step: int, global_batch: int, n_sequences: int, shuffle: bool,
                         seed: int) -> List[int]:
    """The sequence indices of step ``step``'s (1-based) global batch.

    Position p = (step−1)·global_batch + j (j < global_batch) of the endless stream; epoch
    e = p // n_sequences. ``shuffle=False``: index p mod n (file order, wrapping around).
    ``shuffle=True``: index perm_e[p mod n], perm_e a permutation drawn from (seed, e).
    Pure function: the sampler's only state is the step.
    """
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    if global_batch < 1 or n_sequences < 1:
        raise ValueError(f"need global_batch >= 1 and n_sequences >= 1, got {global_batch}, {n_sequences}")
    start = (step - 1) * global_batch
    pos = np.arange(start, start + global_batch, dtype=np.int64)
    if not shuffle:
        return (pos % n_sequences).tolist()
    out = np.empty(global_batch, dtype=np.int64)
    epochs = pos // n_sequences
    for e in np.unique(epochs):
        m = epochs == e
        out[m] = _epoch_permutation(n_sequences, seed, int(e))[pos[m] % n_sequences]
    return out.tolist()


def rank_share(indices: Sequence[int], dp_rank: int, dp_size: int) -> List[int]:
    """dp rank r's contiguous share ``indices[r·B/dp:(r+1)·B/dp]`` of a global batch of B."""
    b = len(indices)
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
    if b % dp_size:
        raise ValueError(f"train.global_batch {b} is not divisible by dp={dp_size}")
    per = b // dp_size
    return list(indices[dp_rank * per:(dp_rank + 1) * per])


# ---------------------------------------------------------------------------------- dataset
@dataclass
class TokenDataset:
    """N sequences of ``seq_len`` token ids (``array``: [N, seq_len], uint16/int32, memory-mapped
    from the cache) and the sampler settings. Stateless: :meth:`get_batch` depends on the step only.
    """

    array: np.ndarray
    seq_len: int
    shuffle: bool
    seed: int
    global_batch: Optional[int] = None
    source: str = ""
    tokenizer_name: str = "byte"
    from_cache: bool = False

    @property
    def n_sequences(self) -> int:
        return int(self.array.shape[0])

    def __len__(self) -> int:
        return self.n_sequences

    def sequences(self, indices: Sequence[int]) -> torch.Tensor:
        """LongTensor [len(indices), seq_len]."""
        idx = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(np.asarray(self.array[idx], dtype=np.int64))

    def global_indices(self, step: int, global_batch: Optional[int] = None) -> List[int]:
        gb = global_batch or self.global_batch
        if not gb:
            raise ValueError("global_batch not given (pass it to build_dataset or get_batch)")
        return global_batch_indices(step, gb, self.n_sequences, self.shuffle, self.seed)

    def get_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1,
                  global_batch: Optional[int] = None) -> torch.Tensor:
        """This dp rank's share of step ``step``'s (1-based) global batch: LongTensor
        [global_batch/dp_size, seq_len]. Labels: :func:`labels_for`."""
        return self.sequences(rank_share(self.global_indices(step, global_batch), dp_rank, dp_size))


def _file_fingerprint(path: str) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _data_files(path: str) -> List[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if not f.startswith(".") and os.path.isfile(os.path.join(path, f)))
        if not files:
            raise FileNotFoundError(f"data.path: directory {path} holds no files")
        return files
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.path: no such file: {path}")
    return [path]


def _read_tokens(files: List[str], seq_len: int, vocab_size: Optional[int]) -> np.ndarray:
    rows: List[List[int]] = []
    for fname in files:
        with open(fname, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    ids = obj["input_ids"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"data.format=tokens: {fname}:{lineno}: expected "
                                     f'{{"input_ids": [...]}} ({e.__class__.__name__}: {e})') from None
                if len(ids) != seq_len:
                    raise ValueError(f"data.format=tokens: {fname}:{lineno}: {len(ids)} ids, "
                                     f"model.seq_len is {seq_len} (each line must be exactly seq_len)")
                rows.append(ids)
    if not rows:
        raise ValueError(f"data.format=tokens: no sequences in {files}")
    arr = np.asarray(rows, dtype=np.int64)
    if arr.min() < 0 or (vocab_size is not None and arr.max() >= vocab_size):
        raise ValueError(f"data.format=tokens: ids must lie in [0, {vocab_size}), found "
                         f"[{arr.min()}, {arr.max()}] (model.vocab_size)")
    return arr


def _load_hf(fmt: str, files: List[str], cache_dir: str):
    import datasets

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    with contextlib.suppress(Exception):
        datasets.disable_progress_bars()
    builder = {"text": "text", "jsonl": "json", "parquet": "parquet"}[fmt]
    return datasets.load_dataset(builder, data_files=files, split="train",
                                 cache_dir=os.path.join(cache_dir, "hf-datasets"))


def _pack(fmt: str, files: List[str], tokenizer, seq_len: int, text_field: str,
          cache_dir: str) -> np.ndarray:
    ds = _load_hf(fmt, files, cache_dir)
    field = "text" if fmt == "text" else text_field
    if field not in ds.column_names:
        raise ValueError(f"data.text_field: no column {field!r} in {files[0]} "
                         f"(columns: {', '.join(ds.column_names)})")
    eos = getattr(tokenizer, "eos_id", None)
    chunks: List[np.ndarray] = []
    carry = np.zeros(0, dtype=np.int64)
    for batch in ds.select_columns([field]).iter(batch_size=1000):
        texts = [t for t in batch[field] if isinstance(t, str) and t]
        if not texts:
            continue
        stream: List[int] = []
        for ids in tokenizer.encode_batch(texts):
            stream.extend(ids)
            if eos is not None:
                stream.append(eos)
        buf = np.concatenate([carry, np.asarray(stream, dtype=np.int64)])
        n = len(buf) // seq_len
        if n:
            chunks.append(buf[: n * seq_len].reshape(n, seq_len))
        carry = buf[n * seq_len:]
    if not chunks:
        raise ValueError(f"data.path: {files} holds fewer than model.seq_len={seq_len} tokens")
    return np.concatenate(chunks)


def build_dataset(data_cfg, seq_len: int, seed: int, cache_dir: str, *,
                  global_batch: Optional[int] = None,
                  vocab_size: Optional[int] = None) -> TokenDataset:
    """Build (or load from ``cache_dir``) the packed dataset that ``data_cfg``
    (:class:`paralayer.config.DataConfig`: path, format, shuffle, tokenizer, text_field) describes.

    ``seed`` seeds the shuffle (``train.seed``); ``global_batch`` (``train.global_batch``) is the
    default for :meth:`TokenDataset.get_batch`; ``vocab_size`` (``model.vocab_size``), when given,
    is checked against the tokenizer and the ids. ``data.path: null`` → the offline corpus of
    :func:`make_corpus` in ``cache_dir``.
    """
    fmt = data_cfg.format
    if fmt not in FORMATS:
        raise ValueError(f"data.format: {fmt!r} is not one of {', '.join(FORMATS)}")
    os.makedirs(cache_dir, exist_ok=True)
    path = data_cfg.path
    if path is None:
        path = make_corpus(default_corpus_path(cache_dir))
        fmt = "text"
    files = _data_files(path)
    tokenizer = None if fmt == "tokens" else load_tokenizer(data_cfg.tokenizer)
    tok_name = "none" if tokenizer is None else tokenizer.name
    if tokenizer is not None and vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size}, {data_cfg.tokenizer or 'byte-level'})")
    key_src = {"v": _CACHE_VERSION, "files": [_file_fingerprint(f) for f in files], "format": fmt,
               "text_field": data_cfg.text_field if fmt in ("jsonl", "parquet") else None,
               "tokenizer": tok_name, "seq_len": int(seq_len)}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:20]
    cache_file = os.path.join(cache_dir, f"packed-{fmt}-{seq_len}-{key}.npy")
    from_cache = True
    if not os.path.isfile(cache_file):
        with _file_lock(cache_file + ".lock"):
            if not os.path.isfile(cache_file):
                from_cache = False
                if fmt == "tokens":
                    arr = _read_tokens(files, seq_len, vocab_size)
                else:
                    arr = _pack(fmt, files, tokenizer, seq_len, data_cfg.text_field, cache_dir)
                hi = int(arr.max()) if arr.size else 0
                arr = arr.astype(np.uint16 if hi < 2**16 else np.int32)
                bio = io.BytesIO()
                np.save(bio, arr)
                meta = {"max_id": hi, "n_sequences": int(arr.shape[0]), "key": key_src}
                _atomic_write_bytes(cache_file + ".json", json.dumps(meta).encode())
                _atomic_write_bytes(cache_file, bio.getvalue())  # last: its presence = complete
    arr = np.load(cache_file, mmap_mode="r")
    with open(cache_file + ".json") as f:
        max_id = json.load(f)["max_id"]
    if vocab_size is not None and max_id >= vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size}: the data ({path}) holds id {max_id}")
    return TokenDataset(array=arr, seq_len=int(seq_len), shuffle=bool(data_cfg.shuffle),
                        seed=int(seed), global_batch=global_batch, source=os.path.abspath(path),
                        tokenizer_name=tok_name, from_cache=from_cache)
