"""The base of every config section: strict, and an unknown key is an error naming the closest."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from gridtrain.config.errors import unknown_key
from gridtrain.config.limits import STRICT


class Section(BaseModel):
    """A config section: unknown keys are errors that suggest the closest known key."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        # before pydantic's own extra="forbid" check, whose message lacks the suggestion
        if isinstance(data, dict):
            allowed = list(cls.model_fields)
            for key in data:
                if key not in allowed:
                    raise ValueError(unknown_key(str(key), allowed))
        return data


class SwitchSection(Section):
    """A section that can also be switched on with ``True`` (which takes its defaults)."""

    @model_validator(mode="before")
    @classmethod
    def _true_is_default(cls, data: Any) -> Any:
        return {} if data is True else data
