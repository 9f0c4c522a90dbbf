"""Tensor-parallel building blocks. Each layer owns its sharding and its weight loading."""
