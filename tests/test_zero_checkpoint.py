"""Checkpoints under ZeRO: each rank writes its rows once, and a checkpoint moves between stages
and layouts (a stage 3 run on four ranks resumes on one process with no ZeRO)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers.harness import run_distributed
from helpers.models import TinyTransformer
from helpers.runs import data_rows, engine_step, lm_loss, seeded, token_batches

import gridtrain as gt

BATCH, SEQ, VOCAB, HIDDEN = 8, 16, 64, 32
TP2 = dict(tensor=dict(size=2, mode="1d"))
FP16 = dict(mode="naive", initial_scale=2.0**10)


def _engine(ctx, batches, dtype):
    model = seeded(lambda: TinyTransformer(vocab=VOCAB, hidden=HIDDEN, seq=SEQ), 0, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x0 = data_rows(batches[0][0], ctx)
    engine, *_ = gt.initialize(model, opt, lm_loss, example_inputs=x0)
    return engine


def _steps(engine, ctx, batches):
    return [engine_step(engine, *data_rows(batch, ctx), ctx) for batch in batches]


def _save_run(ctx, batches, out, formats, dtype):
    """Two steps, save (each format a move loads: ``ckpt`` sharded, or dense; and dense as
    the reference), then a third step."""
    engine = _engine(ctx, batches, dtype)
    _steps(engine, ctx, batches[:2])
    for sharded in formats:
        gt.save_checkpoint(out / _CKPT[sharded], 2, engine.model, engine.optimizer, sharded=sharded)
    gt.save_checkpoint(out / "saved.pt", 2, engine.model, engine.optimizer)
    _steps(engine, ctx, batches[2:])
    return gt.full_state_dict(engine.model)


def _load_run(ctx, batches, ckpt, out, dtype):
    """Load under another layout, save dense again, take the third step."""
    engine = _engine(ctx, batches, dtype)
    epoch = gt.load_checkpoint(ckpt, engine.model, engine.optimizer)
    gt.save_checkpoint(out / "reloaded.pt", epoch, engine.model, engine.optimizer)
    _steps(engine, ctx, batches[2:])
    return gt.full_state_dict(engine.model)


def _stored_elements(path) -> dict[str, tuple[int, int]]:
    """fqn -> (elements in its saved chunks, elements of the dense tensor), from DCP metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {
        fqn: (sum(math.prod(c.sizes) for c in m.chunks), math.prod(m.size))
        for fqn, m in md.items()
        if isinstance(m, TensorStorageMetadata)
    }


# the checkpoint a move loads, by format (sharded: a DCP directory; dense: one file)
_CKPT = {True: "ckpt", False: "ckpt.pt"}
# name: (world, config) of a saving run
SAVES = {
    "stage3-dp4": (4, dict(zero=3)),
    "stage1-dp4": (4, dict(zero=1)),
    "stage2-dp2x1d2": (4, dict(parallel=TP2, zero=2)),
    "stage3-offload-dp4": (4, dict(zero=dict(stage=3, offload=True))),
    "fp16 stage2-dp4": (4, dict(fp16=FP16, zero=2)),
    "fp16 stage3-dp2": (2, dict(fp16=FP16, zero=3)),
}
# name: (save, load world, load config, sharded format)
MOVES = {
    "stage3-dp4 -> one process (dcp)": ("stage3-dp4", 1, {}, True),
    "stage3-dp4 -> one process (dense)": ("stage3-dp4", 1, {}, False),
    "stage1-dp4 -> stage3-dp2 (dcp)": ("stage1-dp4", 2, dict(zero=3), True),
    "stage2-dp2x1d2 -> stage1-dp4 (dcp)": ("stage2-dp2x1d2", 4, dict(zero=1), True),
    "stage3-dp4 -> stage2-dp2x1d2 (dense)": ("stage3-dp4", 4, dict(parallel=TP2, zero=2), False),
    "stage3-offload-dp4 -> stage2-dp2 (dcp)": ("stage3-offload-dp4", 2, dict(zero=2), True),
    "fp16 stage2-dp4 -> fp16 stage3-dp2 (dcp)": (
        "fp16 stage2-dp4",
        2,
        dict(fp16=FP16, zero=3),
        True,
    ),
    "fp16 stage3-dp2 -> fp16 one process (dense)": ("fp16 stage3-dp2", 1, dict(fp16=FP16), False),
}


def _batches():
    return token_batches(3, BATCH, SEQ, VOCAB, seed=0)


@pytest.fixture(scope="module")
def saving(tmp_path_factory):
    """``saving(name)``: the directory of that saving run's checkpoints, in every format a
    move (or the rows test) reads, and its weights after the third step. One run per saving
    layout, shared by the moves that load it (three moves load the same stage 3 run)."""

    @functools.cache
    def save(name):
        world, config = SAVES[name]
        formats = {sharded for s, _, _, sharded in MOVES.values() if s == name}
        formats |= {True} if name in ROWS.values() else set()
        out = tmp_path_factory.mktemp("save")
        dtype = torch.float32 if "fp16" in config else torch.float64
        after = run_distributed(
            _save_run, world, _batches(), out, sorted(formats), dtype, config=config, timeout=300
        )[0]
        return out, after

    return save


@pytest.mark.parametrize("name", list(MOVES))
def test_checkpoint_moves_between_stages_and_layouts(name, saving, tmp_path):
    save_name, load_world, load_cfg, sharded = MOVES[name]
    out, after_save = saving(save_name)
    fp16 = "fp16" in SAVES[save_name][1]
    dtype = torch.float32 if fp16 else torch.float64
    after_load = run_distributed(
        _load_run,
        load_world,
        _batches(),
        out / _CKPT[sharded],
        tmp_path,
        dtype,
        config=load_cfg,
        timeout=300,
    )[0]
    saved = torch.load(out / "saved.pt", weights_only=True)
    reloaded = torch.load(tmp_path / "reloaded.pt", weights_only=True)
    # what was loaded is exactly what was saved: weights, every optimizer moment, groups
    for k, v in saved["model"].items():
        torch.testing.assert_close(reloaded["model"][k], v, rtol=0, atol=0, msg=k)
    assert saved["optimizer"]["state"].keys() == reloaded["optimizer"]["state"].keys()
    for name_, entry in saved["optimizer"]["state"].items():
        for key, value in entry.items():
            got = reloaded["optimizer"]["state"][name_][key]
            torch.testing.assert_close(got, value, rtol=0, atol=0, msg=f"{name_} {key}")
    assert saved["optimizer"]["param_groups"] == reloaded["optimizer"]["param_groups"]
    assert saved.get("scaler") == reloaded.get("scaler")
    # and the next step lands where the saving run's did (float64; see test_zero.py). fp16:
    # one side reports the fp16 model (stages 1-2, none), the other its fp32 masters
    # (stage 3): half an fp16 ulp apart (2e-3 at the weights' magnitude of 4), while a
    # stale or wrong row is off by a whole AdamW step (lr = 1e-2)
    rtol, atol = (1e-4, 1e-8) if not fp16 else (2e-3, 2e-3)
    for k, v in after_save.items():
        torch.testing.assert_close(after_load[k].double(), v.double(), rtol=rtol, atol=atol, msg=k)


def _plain_once(ctx, batches, out):
    engine = _engine(ctx, batches, torch.float64)
    _steps(engine, ctx, batches[:1])
    gt.save_checkpoint(out / "plain", 1, engine.model, engine.optimizer, sharded=True)


# stage: the saving run whose sharded checkpoint the rows test reads (four ranks; the rows a
# rank writes are fixed at initialize, so two steps before the save show what one does)
ROWS = {1: "stage1-dp4", 3: "stage3-dp4"}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """One process's sharded checkpoint (no ZeRO), shared by both stages."""
    out = tmp_path_factory.mktemp("plain")
    run_distributed(_plain_once, 1, _batches(), out, timeout=300)
    return out / "plain"


@pytest.mark.parametrize("stage", [1, 3])
def test_sharded_checkpoint_holds_each_row_once(stage, saving, plain):
    """Four ranks write their rows once: every tensor's chunks add up to it, no more, and the
    directory holds the tensors of one process's checkpoint."""
    out, _ = saving(ROWS[stage])
    zero, plain = _stored_elements(out / _CKPT[True]), _stored_elements(plain)
    for fqn, (stored, dense) in zero.items():
        if not fqn.startswith("rng/"):
            assert stored == dense, (fqn, stored, dense)
    assert {k for k in zero if not k.startswith("rng/")} == {
        k for k in plain if not k.startswith("rng/")
    }
