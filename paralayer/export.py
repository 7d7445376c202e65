"""``python -m paralayer.export RUN_DIR --out DIR``: the old spelling of ``paralayer export`` (the
module moved to paralayer/checkpoint/export.py); kept so the commands documented before still run."""
import sys

from paralayer.commands import run

NOTE = "note: `python -m paralayer.export` is now `paralayer export` (or `python -m paralayer export`)"

if __name__ == "__main__":
    print(NOTE, file=sys.stderr)
    sys.exit(run(["export", *sys.argv[1:]]))
