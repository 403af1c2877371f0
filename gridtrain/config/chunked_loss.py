"""``chunked_loss``: the LM head and its cross entropy in token chunks, so the
``[tokens, vocab]`` logits never exist whole (``gridtrain.parallel.tensor.chunked_loss``)."""

from __future__ import annotations

from pydantic import Field

from gridtrain.config.limits import Count
from gridtrain.config.section import SwitchSection


class ChunkedLossConfig(SwitchSection):
    """``chunked_loss``: the LM head and its cross entropy in token chunks
    (``gridtrain.parallel.tensor.chunked_loss``); ``True`` takes the defaults."""

    chunk_tokens: Count = Field(
        8192, description="tokens per chunk: one chunk's logits exist at a time"
    )
    recompute: bool = Field(
        False,
        description="False: each chunk's gradients are taken in the forward and only scaled in "
        "the backward (no matmul twice; keeps a hidden-sized gradient and the head weight's; "
        "fp16 runs always recompute, as a chunk's weight gradient could overflow fp16); True: "
        "recompute each chunk's logits in the backward (one more head matmul, least memory)",
    )

    @staticmethod
    def check_zero_stage(zero_stage: int | None) -> None:
        """ZeRO 3 frees the head's gathered weights after the model's forward, before the
        chunked loss would use them; raises ``ValueError`` for that pairing."""
        if zero_stage == 3:
            raise ValueError(
                "chunked_loss computes the LM head after the model's forward, when ZeRO stage 3 "
                "(FSDP2) has already freed the head's gathered weights: use chunked_loss with "
                "zero.stage 1 or 2, or zero.stage 3 without chunked_loss"
            )
