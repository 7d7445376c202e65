"""Front door: ``python launch.py recipe=NAME [key=value ...] [--dry-run] [--json] [-m]``."""
import sys

from paralayer.cli import main

sys.exit(main(sys.argv[1:]))
