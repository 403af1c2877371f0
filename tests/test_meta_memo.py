"""The planner's meta runs answer a repeated operation from a table (``meta_memo.py``): every
answer must be the one the meta kernels give, and in-place operations must always run.

Each model runs on meta twice under a recorder that sees every call and its result: once
through the planner's ``run_on_meta`` (the table below the recorder, warmed by a first run)
and once as plain meta execution. The calls and the shapes, strides and dtypes they return
must be the same, call by call. One process: no collective is involved.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import hf_zoo, tiny_lm
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from gridtrain.parallel.tensor.trace import run_on_meta


class _Recorder(TorchFunctionMode):
    """(function name, result metadata) of every call, in order."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((getattr(func, "__name__", repr(func)), _meta(out)))
        return out


def _meta(out):
    if isinstance(out, Tensor):
        return (tuple(out.shape), out.stride(), out.dtype, out.device.type)
    if isinstance(out, tuple | list):
        return [_meta(x) for x in out]
    return type(out).__name__


class _InPlace(nn.Module):
    """In-place shape changes and a result that is its own input, repeated: a table that
    answered ``unsqueeze_`` or returned a copy for ``contiguous`` would change shapes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        for _ in range(3):
            y = self.lin(x).clone()
            y.unsqueeze_(0)
            y.mul_(2.0)
            x = y.squeeze(0).contiguous() + 1
        return x


MODELS = {
    "tiny lm": (lambda: tiny_lm.build_model(0), lambda: torch.zeros(2, 8, dtype=torch.long)),
    "hf llama": (lambda: hf_zoo.build("llama"), lambda: torch.zeros(2, 8, dtype=torch.long)),
    "in-place": (_InPlace, lambda: torch.zeros(4, 6, dtype=torch.float64)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_table_answers_equal_the_meta_kernels(name):
    build, example = MODELS[name]
    model = build().to(torch.float64)
    run_on_meta(model, example())  # warms the table: every call below may be answered from it
    memo = _Recorder()
    run_on_meta(model, example(), modes=(memo,))

    plain = _Recorder()
    twin, x = copy.deepcopy(model).to("meta"), example().to("meta")
    with torch.no_grad(), torch.device("meta"), plain:
        twin(x)
    assert len(memo.calls) == len(plain.calls), (len(memo.calls), len(plain.calls))
    for i, (got, want) in enumerate(zip(memo.calls, plain.calls, strict=True)):
        assert got == want, f"call {i}: {got} from the table, {want} from the meta kernels"
