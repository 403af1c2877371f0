"""A tensor mode added the way the README says: this folder and one ``register_mode`` line.

'toy1d' is 1d under another name: its geometry (``geometry.py``, torch-free) is 1d's with
its own name and runtime, its runtime half (``runtime.py``) 1d's layers on that geometry.
``tests/test_mode_registry.py`` registers it and trains through it.
"""
