"""The error of a Hugging Face checkpoint we cannot represent or read (torch-free)."""
from __future__ import annotations


class HFFormatError(ValueError):
    """A Hugging Face checkpoint we cannot represent or read; the message names the file/field."""
