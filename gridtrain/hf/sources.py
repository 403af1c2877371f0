"""Where ``load_pretrained`` reads each of the model's keys from.

A directory in the model's own layout holds every key as it is (``Stored``). Hub
checkpoints are often in a family's original layout instead: Mixtral's
``model.layers.0.block_sparse_moe.experts.3.w1.weight``, one tensor per expert, where the
installed ``transformers`` fuses each layer's experts into ``model.layers.0.mlp.experts.
gate_up_proj`` ``[num_experts, 2 * ffn, hidden]``. ``transformers`` converts such keys as it
loads them, by its checkpoint conversion mapping (``get_model_conversion_mapping``:
``WeightRenaming`` for renamed keys; ``WeightConverter`` with operations such as
``MergeModulelist`` then ``Concatenate`` for fused ones). ``keys_from_mapping`` applies that
same mapping, through ``transformers``' own ``rename_source_key`` and the converters' own
``convert``, so a key the directory lacks is read from what converts into it
(``Converted``); nothing here knows a family.

Each rank still reads only its share. Where the converter first stacks one tensor per
expert (``MergeModulelist(dim=0)``, then only concatenations along other dims), the rows of
dim 0 a rank holds are its experts, and it reads only their tensors (under
``moe.expert_parallel_size`` 2, half of them); any other conversion reads its whole source
and slices the result.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gridtrain.hf.reading import PretrainedFileError

Runs = list[list[tuple[int, int]]]  # per dim, the [start, stop) runs a rank holds


class Files(Protocol):
    """The directory's weight files, as ``load_pretrained`` opened them."""

    def shape(self, key: str, file: str) -> tuple[int, ...]: ...

    def read(self, key: str, file: str, runs: Runs) -> Tensor:
        """``key`` of ``file``, only the cartesian product of ``runs`` ([]: all of it)."""


def read_runs(sliceable: Any, runs: Runs) -> Tensor:
    """The cartesian product of ``runs`` of a tensor or a safetensors slice, slice by slice."""

    def piece(prefix: list[slice], dim: int) -> Tensor:
        if dim == len(runs):
            return sliceable[tuple(prefix)]
        parts = [piece([*prefix, slice(a, b)], dim + 1) for a, b in runs[dim]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    return piece([], 0)


@dataclass(frozen=True)
class Stored:
    """A key of the directory (``key`` in ``file``) read as it is."""

    key: str
    file: str

    @property
    def name(self) -> str:
        return self.key

    def shape(self, files: Files) -> tuple[int, ...]:
        return files.shape(self.key, self.file)

    def read(self, files: Files, runs: Runs) -> Tensor:
        return files.read(self.key, self.file, runs)


@dataclass(frozen=True)
class Converted:
    """The model's ``key`` made by one ``transformers`` converter (``template``, copied for
    each use: it collects tensors) from keys of the directory: ``parts`` maps each of the
    converter's source patterns to its (key, file) pairs, in ``transformers``' order (by
    ``dot_natural_key``: expert 0, 1, ..., 10). ``first``: the converter's first target,
    the name ``transformers`` converts under."""

    key: str
    first: str
    template: Any
    parts: dict[str, list[tuple[str, str]]]
    model: nn.Module

    @property
    def name(self) -> str:
        sources = ", ".join(keys[0][0] for keys in self.parts.values())
        return f"{self.key} (converted from {sources}, ...)"

    def shape(self, files: Files) -> tuple[int, ...]:
        """The converted shape, by the converter's own operations on meta tensors."""

        def meta(key: str, file: str):
            return lambda: torch.empty(files.shape(key, file), device="meta")

        return tuple(self._convert(meta).shape)

    def read(self, files: Files, runs: Runs) -> Tensor:
        def load(key: str, file: str):
            return lambda: files.read(key, file, [])

        if runs and self._experts_first():
            take = [i for a, b in runs[0] for i in range(a, b)]  # this rank's experts
            out = self._convert(load, take)
            return read_runs(out, [[(0, out.shape[0])], *runs[1:]])
        out = self._convert(load)
        return read_runs(out, runs) if runs else out

    def _experts_first(self) -> bool:
        """Whether dim 0 of the result is the source lists' index: a stack along dim 0, then
        only concatenations along other dims (Mixtral's, Qwen's fused experts)."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        ops = self.template.operations
        return (
            len(self.template.target_patterns) == 1
            and isinstance(ops[0], MergeModulelist)
            and ops[0].dim == 0
            and all(isinstance(op, Concatenate) and op.dim != 0 for op in ops[1:])
        )

    def _convert(self, load, take: list[int] | None = None) -> Tensor:
        conv = copy.deepcopy(self.template)
        for pattern, keys in self.parts.items():
            for key, file in keys if take is None else [keys[i] for i in take]:
                conv.add_tensor(self.first, key, pattern, load(key, file))
        try:
            out = conv.convert(self.first, model=self.model, config=self.model.config)
        except PretrainedFileError:  # a file refused or damaged: named as it is
            raise
        except (RuntimeError, ValueError, IndexError) as err:
            raise ValueError(f"'{self.name}' does not convert: {err}") from None
        value = out[self.key]
        return value[0] if isinstance(value, list) else value


Source = Stored | Converted


def keys_from_mapping(
    model: nn.Module, where: dict[str, str], wanted: Iterable[str]
) -> dict[str, Source]:
    """For each key of ``wanted`` that ``where`` (the directory's key -> file) lacks, what
    ``transformers``' conversion mapping of ``model`` makes it from (as
    ``from_pretrained`` would); keys nothing converts into are left out."""
    wanted = dict.fromkeys(wanted, True)  # rename_source_key's meta_state_dict: key -> not None
    if all(k in where for k in wanted):
        return {}
    transforms = _conversion_mapping(model)
    if not transforms:
        return {}
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    found: dict[str, Source] = {}
    groups: dict[str, Converted] = {}
    for key in sorted(where, key=dot_natural_key):
        if key in wanted:
            continue
        target, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
        if pattern is None:
            if target in wanted and target not in where:
                found.setdefault(target, Stored(key, where[key]))
        else:  # a converter's input: grouped by the key it converts under
            group = groups.setdefault(
                target, Converted(target, target, by_pattern[pattern], {}, model)
            )
            group.parts.setdefault(pattern, []).append((key, where[key]))
    for first, group in groups.items():
        targets = group.template.target_patterns
        for t in targets:
            key = first.replace(targets[0], t)
            if key in wanted and key not in where:
                found[key] = replace(group, key=key)
    return found


def _conversion_mapping(model: nn.Module) -> list:
    """``transformers``' conversion mapping for ``model`` ([] where the installed version has
    none, or for a model that is not a ``transformers`` one)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    if getattr(model, "config", None) is None:
        return []
    return list(get_model_conversion_mapping(model))


__all__ = ["Converted", "Files", "Source", "Stored", "keys_from_mapping", "read_runs"]
