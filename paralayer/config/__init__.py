"""The recipe as a typed config: schema (schema.py), loading, overrides and sweeps (load.py),
and Hugging Face config.json import (hf_config.py). ``paralayer.config`` is the public face."""
from paralayer.config.load import *  # noqa: F401,F403
from paralayer.config.load import (  # noqa: F401 - names callers import from paralayer.config
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    MoEConfig,
    all_keys,
    from_yaml_file,
    load_config,
    profile_names,
    recipe_names,
    sweep_axes,
    to_dict,
    to_yaml,
    validate_values,
)
