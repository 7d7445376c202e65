"""Tokenizers: raw UTF-8 bytes (the default, vocab 256) or a Hugging Face ``tokenizers`` JSON file."""
from __future__ import annotations

import hashlib
import os
from typing import Iterable, List, Optional, Sequence

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]", "<sep>")


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

        from paralayer.data.errors import DataError

        if not os.path.isfile(path):
            raise DataError("no such file", field="data.tokenizer", file=path)
        self.path = os.path.abspath(path)
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise DataError(f"not a tokenizers JSON file ({str(exc).splitlines()[0] if str(exc) else exc!r})",
                            field="data.tokenizer", file=path) from None
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
