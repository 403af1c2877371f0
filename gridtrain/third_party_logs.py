"""Third-party log notices that tell a gridtrain user nothing, dropped by a narrow filter.

Building a Hugging Face model imports ``transformers.modeling_utils``, which imports torchao
(a requirement, for ``fp8``) for its quantizers; ``gridtrain.amp.fp8`` imports it too.
torchao registers some Enum classes as pytree constants, and torch logs a deprecation
warning for each (``<enum 'KernelPreference'> is an Enum subclass ...``), on every rank: a
notice for torchao's maintainers, four lines in a two-rank run. The import happens in the
user's script (``AutoModelForCausalLM...``), out of gridtrain's reach, so instead of wrapping
it this filter sits on torch's pytree logger from ``import gridtrain`` on and drops exactly
those records (an Enum class defined in torchao); every other record passes, gridtrain's
own warnings included.
"""

from __future__ import annotations

import enum
import logging

PYTREE_LOGGER = "torch.utils._pytree"


class _TorchaoEnumNotice(logging.Filter):
    """Rejects torch's "Enum subclass ... register_constant() is deprecated" for torchao's enums."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        cls = args[0] if args else None
        from_torchao = (
            isinstance(cls, type)
            and issubclass(cls, enum.Enum)
            and cls.__module__.split(".")[0] == "torchao"
        )
        return not (from_torchao and "register_constant" in str(record.msg))


def drop_known_notices() -> None:
    """Install the filters above (once; importing gridtrain does it)."""
    logger = logging.getLogger(PYTREE_LOGGER)
    if not any(isinstance(f, _TorchaoEnumNotice) for f in logger.filters):
        logger.addFilter(_TorchaoEnumNotice())
