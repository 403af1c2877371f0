"""Tensor-parallel layer implementations, one file per mode; ``layers.py`` dispatches."""
