"""paralayer: declarative hybrid-parallel transformer training.

The package root holds only the front door (cli, commands, __main__) and the tools every layer
uses (compat, clock). Two older module paths stay runnable as spellings of a command, without a
module of their own here: ``python -m paralayer.report DIR`` (DESIGN's contract: ``paralayer
report``) and ``python -m paralayer.export RUN_DIR --out DIR`` (``paralayer export``, with a note).
:class:`_CommandSpelling` answers ``python -m`` for those names and hands the arguments to the
command table (paralayer/commands.py: ``OLD_SPELLINGS``); importing them is an ImportError.
"""
import importlib.machinery
import sys

__version__ = "0.1.0"

#: module path -> the command of paralayer/commands.py it spells
OLD_SPELLINGS = {"paralayer.report": "report", "paralayer.export": "export"}


class _CommandSpelling:
    """Meta path finder and loader of :data:`OLD_SPELLINGS` (``python -m`` asks for their code)."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in OLD_SPELLINGS:
            return None
        return importlib.machinery.ModuleSpec(name, cls, origin="paralayer.commands")

    @staticmethod
    def create_module(spec):
        return None

    @staticmethod
    def exec_module(module):
        raise ImportError(f"{module.__name__} is a command, not a module: run `python -m {module.__name__}` "
                          f"or `paralayer {OLD_SPELLINGS[module.__name__]}`", name=module.__name__)

    @staticmethod
    def get_code(name):
        src = f"import sys\nfrom paralayer.commands import run_old_spelling\nsys.exit(run_old_spelling({name!r}))\n"
        return compile(src, f"<paralayer: python -m {name}>", "exec")


if not any(f is _CommandSpelling for f in sys.meta_path):
    sys.meta_path.insert(0, _CommandSpelling)  # before the path finders: the names are always commands
