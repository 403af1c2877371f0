"""Tensor parallelism: one package per mode, each exporting its ``TensorMode`` spec (``spec.py``),
found by name in ``registry.py``; the plan's data model in ``plan.py``, made and applied by
``parallelize.py``."""
