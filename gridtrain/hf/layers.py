"""``transformers``' own layer classes that the planner treats as one of its kinds, handed down
to ``parallel/`` through the table it defines for them (``parallel/`` names no library
class): ``Conv1D`` (GPT-2, OpenAI GPT, ImageGPT...), a Linear whose weight is ``[in, out]``."""

from __future__ import annotations

from gridtrain.parallel.tensor.base import register_transposed_linear


def register_layers() -> None:
    """Register ``transformers``' layer classes with the planner (``import gridtrain.hf`` does;
    ``gridtrain.adapters`` imports it for any model holding a ``transformers`` layer)."""
    from transformers.pytorch_utils import Conv1D

    register_transposed_linear(Conv1D)
