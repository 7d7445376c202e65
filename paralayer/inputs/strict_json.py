"""Strict JSON for ``--json``: NaN and infinities become null, never bare ``NaN`` (which is not
JSON: ``jq`` and most parsers refuse it). Inputs are bounded and finite (paralayer.inputs.bounds),
so a non-finite number here is a derived one (a ratio over a zero term); null says "no value"."""
from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """The C encoder first (a --plan --json of 100k layouts is ~200 MB); the walk only on a NaN."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        return json.dumps(finite(obj), allow_nan=False, **kwargs)
