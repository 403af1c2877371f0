"""Every sharded layer of every tensor mode equals its dense twin: output, input gradient and
each rank's weight-gradient shard. Layers are built from dense modules through the same spec
the engine uses (the mode's ``TensorMode.layer_for``), so these are the layers a plan produces."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layer_parity import layer_parity, randn
from helpers.layouts import tensor_of
from torch import nn
from transformers.pytorch_utils import Conv1D

import gridtrain as gt
import gridtrain.hf  # noqa: F401 - registers transformers' Conv1D with the planner
from gridtrain.parallel.tensor.plan import EMBEDDING, LINEAR, NORM, PATCH
from gridtrain.parallel.tensor.registry import spec_of

B, S, H, V = 8, 3, 16, 32  # batch divisible by 4 (2d, 2.5d depth 2, 3d d^2), hidden by d^3 = 8


def ids():
    t = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
    t[0, :3] = torch.tensor([1, 3, V - 1])  # the padding row and the last vocabulary row
    return t


def act(width=H):
    return randn(7, B, S, width)


def images():
    return randn(8, B, 3, 8, 8)


def rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(H, eps=1e-6)


# (name, kind, style, options, dense factory, input, input layout, output layout)
CASES = {
    "1d": [
        ("Linear colwise", LINEAR, "colwise", {}, lambda: nn.Linear(H, 2 * H), act, "rep", "shard"),
        ("Linear colwise_gather_output", LINEAR, "colwise_gather_output", {},
         lambda: nn.Linear(H, 2 * H), act, "rep", "rep"),
        ("Linear rowwise", LINEAR, "rowwise", {}, lambda: nn.Linear(2 * H, H),
         lambda: act(2 * H), "shard", "rep"),
        ("Linear rowwise_split_input (no bias)", LINEAR, "rowwise_split_input", {},
         lambda: nn.Linear(2 * H, H, bias=False), lambda: act(2 * H), "rep", "rep"),
        ("Linear packed_colwise", LINEAR, "packed_colwise", {"packed": 3},
         lambda: nn.Linear(H, 3 * H), act, "rep", "shard:3"),
        ("Linear vocab_parallel", LINEAR, "vocab_parallel", {}, lambda: nn.Linear(H, V),
         act, "rep", "vocab"),
        ("Conv1D colwise", LINEAR, "colwise", {}, lambda: Conv1D(2 * H, H), act, "rep", "shard"),
        ("Conv1D rowwise", LINEAR, "rowwise", {}, lambda: Conv1D(H, 2 * H),
         lambda: act(2 * H), "shard", "rep"),
        ("Conv1D packed_colwise", LINEAR, "packed_colwise", {"packed": 3},
         lambda: Conv1D(3 * H, H), act, "rep", "shard:3"),
        ("Embedding embedding_colwise", EMBEDDING, "embedding_colwise", {},
         lambda: nn.Embedding(V, H, padding_idx=1), ids, "rep", "rep"),
        ("Embedding embedding_rowwise", EMBEDDING, "embedding_rowwise", {},
         lambda: nn.Embedding(V, H, padding_idx=3), ids, "rep", "rep"),
        ("PatchEmbedding", PATCH, "colwise", {}, lambda: gt.nn.PatchEmbedding(8, 4, 3, H),
         images, "rep", "rep"),
    ],
    "grid": [
        ("Linear", LINEAR, "auto", {}, lambda: nn.Linear(H, 2 * H), act, "act", "act"),
        ("Linear full-width input", LINEAR, "auto", {}, lambda: nn.Linear(H, 2 * H),
         act, "rows", "act"),
        ("Linear no bias", LINEAR, "auto", {}, lambda: nn.Linear(H, 12, bias=False),
         act, "act", "act"),
        ("Linear packed", LINEAR, "packed_colwise", {"packed": 3},
         lambda: nn.Linear(H, 3 * H), act, "act", "act:3"),
        ("Conv1D", LINEAR, "auto", {}, lambda: Conv1D(2 * H, H), act, "act", "act"),
        ("LayerNorm", NORM, "norm", {}, lambda: nn.LayerNorm(H), act, "act", "act"),
        ("nn.RMSNorm", NORM, "norm", {}, lambda: nn.RMSNorm(H), act, "act", "act"),
        ("LlamaRMSNorm", NORM, "norm", {}, rms_norm, act, "act", "act"),
        ("Embedding", EMBEDDING, "embedding_colwise", {},
         lambda: nn.Embedding(V, H, padding_idx=1), ids, "rows", "act"),
        ("VocabParallelEmbedding", EMBEDDING, "embedding_rowwise", {},
         lambda: nn.Embedding(V, H, padding_idx=1), ids, "rows", "act"),
        ("Classifier", LINEAR, "gather_output", {}, lambda: gt.nn.Classifier(H, 5),
         act, "act", "rows"),
        ("Classifier (Conv1D head)", LINEAR, "gather_output", {}, lambda: Conv1D(5, H),
         act, "act", "rows"),
        ("VocabParallelClassifier", LINEAR, "vocab_parallel", {}, lambda: nn.Linear(H, V),
         act, "act", "vocab"),
        ("PatchEmbedding", PATCH, "colwise", {}, lambda: gt.nn.PatchEmbedding(8, 4, 3, H),
         images, "rows", "act"),
    ],
}  # fmt: skip


def _at_orientation_0(case):
    """A grid case under 3d: a Linear's output is at orientation 1; everything else keeps 0."""
    name, kind, style, opts, make, x, xl, yl = case
    if kind == LINEAR and style in ("auto", "packed_colwise"):
        yl = yl.replace("act", "act1")
    return (name, kind, style, {**opts, "orientation": 0}, make, x, xl, yl)


CASES["3d"] = [_at_orientation_0(c) for c in CASES["grid"]] + [
    ("Linear at orientation 1", LINEAR, "auto", {"orientation": 1},
     lambda: nn.Linear(H, 2 * H), act, "act1", "act"),
    ("LayerNorm at orientation 1", NORM, "norm", {"orientation": 1},
     lambda: nn.LayerNorm(H), act, "act1", "act1"),
    ("Embedding to orientation 1", EMBEDDING, "embedding_colwise", {"orientation": 1},
     lambda: nn.Embedding(V, H), ids, "rows", "act1"),
    ("Classifier from orientation 1", LINEAR, "gather_output", {"orientation": 1},
     lambda: gt.nn.Classifier(H, 5), act, "act1", "rows"),
]  # fmt: skip

LAYOUTS = {
    "1d-2": (2, tensor_of("1d2"), "1d"),
    "1d-4": (4, tensor_of("1d4"), "1d"),
    "2d-4": (4, tensor_of("2d4"), "grid"),
    "2.5d-8": (8, tensor_of("2.5d8"), "grid"),
    "3d-8": (8, tensor_of("3d8"), "3d"),
}


def _run(ctx, table: str):
    out = {}
    for k, (name, kind, style, opts, make, x, xl, yl) in enumerate(CASES[table]):
        factory, options = spec_of(ctx).layer_for(name, kind, style, opts)

        def build(dense_layer, c, factory=factory, options=options):
            return factory(dense_layer, c, **options)

        out[name] = layer_parity(ctx, make, build, x(), xl, yl, seed=100 + k)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layer_equals_its_dense_twin(layout):
    world, tensor, table = LAYOUTS[layout]
    results = run_distributed(_run, world, table, config=dict(parallel=dict(tensor=tensor)))
    assert set(results[0]) == {c[0] for c in CASES[table]}
    for rank, per_layer in enumerate(results):
        for name, errs in per_layer.items():
            for what, err in errs.items():
                # float32: split matmuls, all-reduces and reduce-scatters only reorder sums of
                # <= 48 O(1) terms: a few ulps relative to max(1, |reference|) (measured
                # <= ~1e-6); a wrong shard, missing reduction or orientation is O(1)
                assert err < 1e-5, f"{layout} rank {rank} {name} {what}: {err}"
