"""The model store: the default model fetched and imported once, and `--model DIR` resolved.

Importing this package pulls in neither torch nor transformers; only the one-time GGUF import
(`fetch_default_model` on a fresh home) does.
"""

from foundation.modelstore.errors import ModelError
from foundation.modelstore.layout import (
    ModelFiles,
    check_model_dir,
    check_weights,
    read_config,
    weight_files,
)
from foundation.modelstore.store import (
    DEFAULT_MODEL,
    fetch_default_model,
    resolve_model,
    stagemesh_home,
)

__all__ = [
    "DEFAULT_MODEL",
    "ModelError",
    "ModelFiles",
    "check_model_dir",
    "check_weights",
    "fetch_default_model",
    "read_config",
    "resolve_model",
    "stagemesh_home",
    "weight_files",
]
