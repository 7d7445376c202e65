"""``python -m paralayer ...``: the front door, as ``paralayer`` and ``python launch.py`` (paralayer/cli.py)."""
from paralayer.cli import entry

if __name__ == "__main__":
    entry()
