"""``fp8``: float8 matmuls in the model's ``nn.Linear`` layers, through torchao's float8 training.

torchao swaps each chosen ``nn.Linear`` for a ``Float8Linear`` that casts its input,
weight and output gradient to float8 with a scale (per tensor or per row) around each
of the three matmuls, and keeps the parameters themselves in their dtype: the
optimizer, the checkpoints and ZeRO see the same ``weight``/``bias`` parameters as
before. Hopper and later run these as float8 tensor-core GEMMs; elsewhere torch's
``_scaled_mm`` emulates them, so CPU runs check the numerics, not the speed.
"""

from __future__ import annotations

import fnmatch
import logging

from torch import nn

logger = logging.getLogger("gridtrain")


def _eligible(module: nn.Module, name: str, options, tied: set[int]) -> bool:
    if not isinstance(module, nn.Linear) or id(module.weight) in tied:
        return False  # a weight shared with an embedding is an LM head, whatever its name
    if any(fnmatch.fnmatch(name, pattern) for pattern in options.skip):
        return False
    dims = (module.in_features, module.out_features)
    # float8 GEMMs need both dimensions divisible by 16; small ones do not pay for the casts
    return all(d % 16 == 0 and d >= options.min_features for d in dims)


def convert_to_fp8(model: nn.Module, options) -> list[str]:
    """Swap the eligible ``nn.Linear`` layers of ``model`` in place; returns their names."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:  # pragma: no cover - torchao is in requirements.txt
        raise ImportError("fp8 needs torchao: pip install torchao") from err
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    chosen = [name for name, m in model.named_modules() if _eligible(m, name, options, tied)]
    if not chosen:
        logger.warning(
            "fp8: no nn.Linear layer has both dimensions >= fp8.min_features (%d) and "
            "divisible by 16 outside fp8.skip %s; the model trains as before",
            options.min_features,
            options.skip,
        )
        return []
    wanted = set(chosen)
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(options.recipe),
        module_filter_fn=lambda _m, fqn: fqn in wanted,
    )
    logger.info("fp8 (%s): %d Linear layers, e.g. %s", options.recipe, len(chosen), chosen[:3])
    return chosen
