"""Front door: ``python launch.py recipe=NAME [key=value ...] [--dry-run] [--json] [-m]``."""
import sys

from paralayer.cli import exit_process, main

exit_process(main(sys.argv[1:]))
