"""The discipline for untrusted input, one place every command goes through (torch-free).

Recipes, overrides, profiles, config.json, data files, run folders and checkpoints come from
outside: ``untrusted`` checks a path before it is opened (no /proc, no FIFO, no overwrite of what
is not ours) and reads bounded; ``depth`` bounds a file's size and nesting before a parser recurses
into it; ``bounds`` the range of every number and text a recipe may hold; ``interpolation`` which
``${...}`` a recipe may hold (no resolvers, no environment); ``echo`` escapes what is echoed back;
``strict_json`` keeps what goes out as ``--json`` parseable; ``idx_header`` reads and checks a
Megatron shard's header (for the resolver and for data/). Bad input is exit 2, one line naming
the field or file.

It sits beside ``paralayer.config`` (it raises the schema's ConfigError), below everything else.
"""
