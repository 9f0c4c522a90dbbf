"""Fixtures of this directory: tiny model directories and an empty STAGEMESH_HOME."""

from tests.model_dirs import home, sharded_model, tiny_model

__all__ = ["home", "sharded_model", "tiny_model"]
