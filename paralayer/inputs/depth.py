"""How deep and how large a recipe, an override value or a config.json may be, checked before any
parser that recurses sees it.

Why: PyYAML's composer, OmegaConf's node tree and ``json`` all recurse once per nesting level, so a
file nested a few hundred levels deep ends in a RecursionError (and YAML aliases can multiply a
small file into a huge tree). Our own scans come first and are iterative: PyYAML's event stream
(its scanner and parser keep explicit stacks) for YAML, and a bracket count outside strings for
JSON. Whatever exceeds a limit is a :class:`ConfigError` naming the file and line (or the field)
and the limit. Imports no torch.
"""
from __future__ import annotations

import itertools
import re
from typing import Optional

from paralayer.config.schema import ConfigError

#: deepest nesting of maps and lists (a recipe needs ~4: cluster.slurm.sbatch_extra.KEY)
MAX_DEPTH = 32
#: largest recipe or cluster profile file (the shipped ones are 1-2 KB)
MAX_FILE_BYTES = 64 * 1024
#: nodes a YAML document may expand to, aliases counted at their full size
MAX_NODES = 20_000
#: longest value of one command-line override
MAX_VALUE_CHARS = 16 * 1024
#: largest Hugging Face config.json (real ones are a few KB)
MAX_JSON_BYTES = 1024 * 1024

_NODE_START = ("MappingStartEvent", "SequenceStartEvent")
_NODE_END = ("MappingEndEvent", "SequenceEndEvent")


def check_yaml_text(text: str, field: str, where: Optional[str]) -> None:
    """Raise unless the YAML ``text`` nests at most MAX_DEPTH levels and expands (aliases included)
    to at most MAX_NODES nodes. ``where`` names the file in the message (None: a value); a YAML
    syntax error is left to the loader, which reports it with its line."""
    import yaml

    # each open collection: [anchor, nodes inside, height]; an anchor's (nodes, height) for aliases
    stack: list[list] = []
    anchors: dict[str, tuple[int, int]] = {}
    total = 0
    try:
        for ev in yaml.parse(text, Loader=yaml.SafeLoader):
            kind = type(ev).__name__
            if kind in _NODE_START:
                stack.append([getattr(ev, "anchor", None), 1, 0])
                if len(stack) > MAX_DEPTH:
                    _too_deep(field, where, ev)
                continue
            if kind in _NODE_END:
                anchor, nodes, height = stack.pop()
                size = (nodes, height + 1)
            elif kind == "ScalarEvent":
                anchor, size = ev.anchor, (1, 0)
            elif kind == "AliasEvent":
                anchor, size = None, anchors.get(ev.anchor, (1, 0))
            else:
                continue
            if anchor:
                anchors[anchor] = size
            total += size[0] if kind == "AliasEvent" else (1 if kind == "ScalarEvent" else 0)
            if stack:
                stack[-1][1] += size[0]
                stack[-1][2] = max(stack[-1][2], size[1])
            if len(stack) + size[1] > MAX_DEPTH:
                _too_deep(field, where, ev)
            if total > MAX_NODES or (stack and stack[0][1] > MAX_NODES):
                raise ConfigError(field, f"{_at(where, ev)}expands to more than {MAX_NODES:,} values "
                                  "(aliases counted at their full size); the limit is "
                                  f"{MAX_NODES:,}")
    except yaml.YAMLError:
        return  # the loader reports it, with the file and line


def _at(where: Optional[str], ev) -> str:
    if where is None:
        return ""
    mark = getattr(ev, "start_mark", None)
    return f"{where} line {mark.line + 1}: " if mark is not None else f"{where}: "


def _too_deep(field: str, where: Optional[str], ev) -> None:
    raise ConfigError(field, f"{_at(where, ev)}nested more than {MAX_DEPTH} levels deep (maps and lists); "
                      f"the limit is {MAX_DEPTH}")


def check_file_size(path, field: str, limit: int = MAX_FILE_BYTES) -> None:
    try:
        size = path.stat().st_size
    except OSError:
        return  # the reader names what is wrong with it
    if size > limit:
        raise ConfigError(field, f"{path}: {size:,} bytes; a recipe or profile file may hold at most {limit:,}")


def check_value(field: str, value: str) -> None:
    """One override value: its length, and (for a YAML list or map) its nesting."""
    if len(value) > MAX_VALUE_CHARS:
        raise ConfigError(field, f"the value is {len(value):,} characters long; at most {MAX_VALUE_CHARS:,}")
    if value.lstrip().startswith(("[", "{")):
        check_yaml_text(value, field, None)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = {ord("["): "+", ord("{"): "+", ord("]"): "-", ord("}"): "-"}


def json_depth(text: str) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings not counted)."""
    signs = _JSON_STRING.sub("", text)
    signs = re.sub(r"[^\[\]{}]", "", signs).translate(_BRACKETS)
    steps = (1 if s == "+" else -1 for s in signs)
    return max(itertools.accumulate(steps), default=0)


def check_json_text(text: str, where: str) -> Optional[str]:
    """The problem with a JSON text before ``json`` parses it (too large, too deep), or None."""
    if len(text) > MAX_JSON_BYTES:
        return f"{where}: {len(text):,} bytes; at most {MAX_JSON_BYTES:,}"
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        return f"{where}: nested {depth} levels deep; the limit is {MAX_DEPTH}"
    return None
