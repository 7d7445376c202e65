"""``python -m paralayer.report DIR [DIR ...]``: the sweep report, predicted against measured per
run (table on stdout, report.csv, report.md, report.png). See :mod:`paralayer.metrics.report` (a folder: runs, table, plot)."""
from __future__ import annotations

import sys

from paralayer.metrics.report import main

if __name__ == "__main__":
    sys.exit(main())
