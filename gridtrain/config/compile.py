"""``compile``: ``torch.compile`` per repeated block or of the whole model
(``gridtrain.engine.compile``). Unset, it is on for a CUDA device and off on the CPU
(``gridtrain.engine.speed``); ``False`` keeps the model eager."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from gridtrain.config.errors import closest
from gridtrain.config.section import SwitchSection


class CompileConfig(SwitchSection):
    """``compile``: torch.compile per repeated block (``gridtrain.engine.compile``);
    ``True`` takes the defaults, which a CUDA run also gets when the key is unset."""

    backend: str = Field(
        "inductor", description="torch.compile backend: inductor, aot_eager, eager, ..."
    )
    mode: (
        Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None
    ) = Field(None, description="torch.compile mode (None: the backend's default)")
    fullgraph: bool = Field(False, description="fail on a graph break inside a block")
    dynamic: bool | None = Field(
        None, description="dynamic shapes: None lets torch decide after a shape change"
    )
    per_block: bool | None = Field(
        None,
        description="compile each entry of the model's block list (transformer.h, layers); "
        "False: the whole model; None: per block where tensor or pipeline parallelism or ZeRO "
        "3 put collectives or hooks in the model, else whole",
    )
    loss: bool | None = Field(
        None,
        description="compile the criterion too, so the LM head's cross entropy reads the bf16 "
        "logits once and never writes them in fp32; None: unless a tensor mode or chunked_loss "
        "puts collectives or deferred logits in it",
    )
    options: dict[str, Any] | None = Field(
        None,
        description="backend options passed to torch.compile(options=...), e.g. inductor's "
        "{'coordinate_descent_tuning': True}; not together with mode",
    )

    @model_validator(mode="after")
    def _options_known(self) -> CompileConfig:
        """torch.compile takes a mode or options, and inductor ignores a misspelt option
        silently until it compiles: both are refused here, before any process starts."""
        if self.options is None:
            return self
        if self.mode is not None:
            raise ValueError(
                f"compile.mode ({self.mode!r}) and compile.options cannot both be set (torch."
                "compile takes one): a mode is a preset of options, so give its options instead"
            )
        if self.backend == "inductor":
            import torch._inductor  # only here: the schema otherwise loads without torch

            known = set(torch._inductor.list_options())
            # torch.compile reads 'a-b' as 'a_b'
            unknown = sorted(k for k in self.options if k.replace("-", "_") not in known)
            if unknown:
                close = closest(unknown[0], known)
                hint = f" (did you mean '{close}'?)" if close else ""
                raise ValueError(
                    f"compile.options: unknown inductor option {unknown[0]!r}{hint}; "
                    "torch._inductor.list_options() lists the allowed ones"
                )
        return self
