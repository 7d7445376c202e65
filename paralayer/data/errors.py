"""DataError: bad training data, reported as one line that names data.path, the file and, where
known, the line or row. Torch-free, so the pre-launch check (preflight.py) and the runtime share it."""
from __future__ import annotations

from typing import Optional


class DataError(ValueError):
    """The data named by ``data.path`` (or ``data.tokenizer``) cannot be used: the launcher exits 2."""

    def __init__(self, message: str, field: str = "data.path", file: Optional[str] = None,
                 line: Optional[int] = None):
        where = file or ""
        if file and line is not None:
            where = f"{file}:{line}"
        text = f"{field}: {where}: {message}" if where else f"{field}: {message}"
        super().__init__(text)
        self.field, self.file, self.line, self.reason = field, file, line, message
