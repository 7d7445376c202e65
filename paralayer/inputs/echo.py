"""Text the front door echoes back, made safe for one terminal line.

Why: error messages quote what the user typed (a value, a key, a file name). A newline in it
would break the one-line-per-error rule, and an ANSI escape or other control character would
reach the terminal and act there. Every error line goes through :func:`one_line` where it is
printed, so no message has to remember to escape its values. Imports no torch.
"""
from __future__ import annotations

import re

#: C0/C1 controls and DEL, the line and paragraph separators, and bidi overrides
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
#: longest line we print for one error
MAX_LINE = 2000


def _escape(m: re.Match) -> str:
    c = m.group(0)
    if c in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def one_line(text: str, limit: int = MAX_LINE) -> str:
    """``text`` with every control character shown repr-style (``\\n``, ``\\x1b``), cut to ``limit``."""
    text = _UNSAFE.sub(_escape, str(text))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def has_unsafe(text: str) -> bool:
    """``text`` holds a character :func:`one_line` would escape (a control, DEL, a line separator,
    a bidi override): such a name is refused where it would become a file."""
    return bool(_UNSAFE.search(text))


def markup_safe(text: str) -> str:
    """One line, with rich's markup brackets escaped (for text printed through a rich console)."""
    from rich.markup import escape

    return escape(one_line(text))
