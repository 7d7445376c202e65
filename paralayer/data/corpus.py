"""An offline, learnable English-like corpus (``data.path: null``): a small probabilistic grammar,
generated deterministically so every machine trains on the same bytes without a download."""
from __future__ import annotations

import os
import random
from typing import Any, List, Sequence

from paralayer.data.cache import atomic_write_bytes, file_lock

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
    with file_lock(path + ".lock"):
        if os.path.isfile(path):
            return path
        rng = random.Random(seed)
        parts: List[bytes] = []
        size = 0
        while size < n_bytes:
            line = (_paragraph(rng) + "\n").encode("utf-8")
            parts.append(line)
            size += len(line)
        atomic_write_bytes(path, b"".join(parts))
    return path


def default_corpus_path(cache_dir: str, n_bytes: int = 2_000_000, seed: int = 0) -> str:
    return os.path.join(cache_dir, f"corpus-v1-seed{seed}-{n_bytes}.txt")
