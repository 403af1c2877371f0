"""Every key of the config schema says what it is: a field without a description would
reach users as a bare name in errors and the printed schema."""

import typing

from pydantic import BaseModel

import gridtrain as gt


def _sections(model: type[BaseModel], seen: set) -> None:
    """``model`` and every section model its fields hold, however nested (lists, unions)."""
    seen.add(model)
    for field in model.model_fields.values():
        stack = [field.annotation]
        while stack:
            tp = stack.pop()
            stack.extend(typing.get_args(tp))
            if isinstance(tp, type) and issubclass(tp, BaseModel) and tp not in seen:
                _sections(tp, seen)


def test_every_field_of_every_section_has_a_description():
    seen: set = set()
    _sections(gt.Config, seen)
    names = {m.__name__ for m in seen}
    # the walk reaches the nested sections, so a new section cannot slip past it
    assert {"TensorConfig", "PipelineConfig", "GradientHandlerConfig", "Fp8Config"} <= names
    bare = [
        f"{m.__name__}.{k}" for m in seen for k, f in m.model_fields.items() if not f.description
    ]
    assert not bare, f"fields without a description: {bare}"
