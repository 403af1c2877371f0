"""Every documented call works in every layout: one small script over the layout matrix.

The README's plain-PyTorch LM (``helpers.tiny_lm``) runs under each layout below, each with
the three ways to call ``gt.initialize``: with a dataloader, with ``example_inputs=``, with
neither. For each cell, through the public API only:

* losses: the first optimizer steps give one plain process's losses;
* state dict: ``gt.full_state_dict`` after them holds plain tensors with the dense model's
  keys, shapes, dtypes and values, and ``gt.load_full_state_dict`` of the reference's state
  into a fresh engine of the layout reads back unchanged; ``gt.full_optimizer_state_dict``
  holds the reference's AdamW moments and step counts, by dense name;
* checkpoints: dense and sharded checkpoints saved by one process resume in the layout, and
  the layout's own resume in one process, each continuing on the reference's later losses;
* shares: each rank holds about 1/k of what the layout shards (parameters, AdamW state),
  and data-parallel ranks see different data, so a replicated run fails.

One distributed call per layout runs the three variants in sequence (``gt.initialize`` may
be called several times in one launch); one call of one process resumes its checkpoints.
Results are cached per layout, and the checks read them.
"""

from __future__ import annotations

import traceback
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers import tiny_lm
from helpers.harness import run_distributed
from helpers.layouts import layout
from helpers.runs import (
    data_rows,
    engine_step,
    global_losses,
    param_share,
    reference_run,
    state_share,
)

import gridtrain as gt

PM = gt.ParallelMode
STEPS, SAVE_AT = 4, 2  # the layout trains SAVE_AT steps and saves; resumes run the rest
VARIANTS = ("dataloader", "example_inputs", "neither")
FORMATS = {"dense": False, "sharded": True}
TIMEOUT = 240

# name: (world size, config, k for parameters, k for AdamW state, data-parallel size):
# each rank holds about 1/k of the dense parameters and of the dense state
LAYOUTS = {
    "dp2": (*layout("dp2"), 1, 1, 2),
    "1d2": (*layout("1d2"), 2, 2, 1),
    "2d4": (*layout("2d4"), 4, 4, 1),
    "2.5d8": (*layout("2.5d8"), 4, 4, 1),  # weights over q x q, replicated over depth
    "3d8": (*layout("3d8"), 8, 8, 1),
    "sequence2": (*layout("sequence2"), 1, 1, 1),  # weights replicated, sequence split
    "pp2": (*layout("pp2", num_microbatches=2), 2, 2, 1),
    "dp2x1d2xpp2": (*layout("dp2-1d2-pp2", num_microbatches=2), 4, 4, 2),
    "zero1": (*layout("dp2", zero=dict(stage=1)), 1, 2, 2),
    "zero2": (*layout("dp2", zero=dict(stage=2)), 1, 2, 2),
    "zero3": (*layout("dp2", zero=dict(stage=3)), 2, 2, 2),
    "gemini": (*layout("dp2", zero=dict(stage=3, offload=True)), 2, 2, 2),
}
# Norms and biases: 448 of the 8,640 parameter elements. A layout may replicate them
# (1d's row-parallel biases, norms), so a share may exceed 1/k by up to that fraction.
REPLICATED = 448 / 8640


# ---- the script, run by every rank -------------------------------------------------------------
def _engine(ctx, variant: str, seed: int, batches):
    """The README's script up to ``gt.initialize``, called as ``variant`` says."""
    model = tiny_lm.build_model(seed)
    opt, sched = tiny_lm.optimizer_and_scheduler(model)
    kwargs, loader = {}, None
    if variant == "dataloader":
        data = torch.utils.data.TensorDataset(*(torch.cat(t) for t in zip(*batches)))
        per_rank = tiny_lm.BATCH // ctx.world_size(PM.DATA)
        loader = gt.data.get_dataloader(data, batch_size=per_rank)
        kwargs["train_dataloader"] = loader
    elif variant == "example_inputs":
        kwargs["example_inputs"] = data_rows(batches[0], ctx)[0]
    engine, loader, _, _ = gt.initialize(model, opt, tiny_lm.lm_loss, lr_scheduler=sched, **kwargs)
    return engine, sched, loader


def _cell(ctx, variant: str, batches, ref_state, ref_dir: Path, out_dir: Path) -> dict:
    """Every check's data for one (layout, variant), on this rank."""
    engine, sched, loader = _engine(ctx, variant, 0, batches)
    mine = iter(loader) if loader is not None else (data_rows(b, ctx) for b in batches)
    losses = [engine_step(engine, *next(mine), ctx) for _ in range(SAVE_AT)]
    shares = (
        param_share(engine, tiny_lm.dense_numel()),
        state_share(engine, tiny_lm.dense_numel()),
    )
    state = gt.full_state_dict(engine.model)
    optim = gt.full_optimizer_state_dict(engine.model, engine.optimizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    for fmt, sharded in FORMATS.items():
        gt.save_checkpoint(out_dir / fmt, SAVE_AT, engine.model, engine.optimizer, sched, sharded)

    fresh, fresh_sched, _ = _engine(ctx, variant, 1, batches)  # other weights: loads replace them
    gt.load_full_state_dict(fresh.model, ref_state)  # before any forward
    loaded = gt.full_state_dict(fresh.model)
    resumed = {}
    # the first load lands in an engine that has not stepped: alternate which format that is
    for fmt in FORMATS if VARIANTS.index(variant) % 2 == 0 else reversed(FORMATS):
        epoch = gt.load_checkpoint(ref_dir / fmt, fresh.model, fresh.optimizer, fresh_sched)
        assert epoch == SAVE_AT, epoch
        later = batches[SAVE_AT:]
        resumed[fmt] = [engine_step(fresh, *data_rows(b, ctx), ctx) for b in later]
    first = ctx.global_rank == 0  # dense states are equal on every rank: ship one
    return dict(
        losses=losses,
        shares=shares,
        state=state if first else None,
        optim=optim if first else None,
        loaded=loaded if first else None,
        resumed=resumed,
    )


def _layout_run(ctx, batches, ref_state, ref_dir: Path, out_dir: Path) -> dict:
    """All three variants in sequence; a failing variant reports its traceback (planning
    errors are raised on every rank alike, so the next variant starts cleanly)."""
    out = {}
    for variant in VARIANTS:
        try:
            out[variant] = _cell(ctx, variant, batches, ref_state, ref_dir, out_dir / variant)
        except Exception:  # noqa: BLE001 - reported per cell by the checks
            out[variant] = traceback.format_exc()
    return out


def _one_process(ctx, batches, save_dir: Path | None, load_dirs: list[Path]) -> dict:
    """One process: train and save (``save_dir``), or resume each of ``load_dirs``' dense and
    sharded checkpoints and continue; losses of each."""
    out = {}
    if save_dir is not None:
        engine, sched, _ = _engine(ctx, "neither", 0, batches)
        out["losses"] = [engine_step(engine, x, y, ctx) for x, y in batches[:SAVE_AT]]
        save_dir.mkdir(parents=True, exist_ok=True)
        for fmt, sharded in FORMATS.items():
            gt.save_checkpoint(
                save_dir / fmt, SAVE_AT, engine.model, engine.optimizer, sched, sharded
            )
        out["losses"] += [engine_step(engine, x, y, ctx) for x, y in batches[SAVE_AT:]]
    for directory in load_dirs:
        for fmt in FORMATS:
            if not (directory / fmt).exists():
                continue  # the cell failed before saving; its checks report why
            engine, sched, _ = _engine(ctx, "neither", 1, batches)
            gt.load_checkpoint(directory / fmt, engine.model, engine.optimizer, sched)
            out[(directory.name, fmt)] = [
                engine_step(engine, x, y, ctx) for x, y in batches[SAVE_AT:]
            ]
    return out


# ---- cached runs -------------------------------------------------------------------------------
@cache
def reference(root: Path) -> dict:
    """The plain process, and one gridtrain process that saves, under ``root``, the
    checkpoints the layouts resume."""
    batches = tiny_lm.batches(STEPS)
    plain = (tiny_lm.build_model, batches, tiny_lm.lm_loss, tiny_lm.optimizer_and_scheduler)
    run = reference_run(*plain)
    at_save = reference_run(tiny_lm.build_model, batches[:SAVE_AT], *plain[2:]).optim
    one = run_distributed(_one_process, 1, batches, root / "reference", [], timeout=TIMEOUT)[0]
    return dict(
        batches=batches,
        losses=run.losses,
        states=run.states,
        optim=at_save,
        one_process=one["losses"],
    )


@cache
def layout(name: str, root: Path) -> dict:
    """Per variant: each rank's results (or the variant's traceback), and one process's
    resumes of the variant's checkpoints."""
    ref = reference(root)
    world, config, *_ = LAYOUTS[name]
    out_dir = root / name
    per_rank = run_distributed(
        _layout_run,
        world,
        ref["batches"],
        ref["states"][SAVE_AT],
        root / "reference",
        out_dir,
        config=config,
        timeout=TIMEOUT,
    )
    dirs = [out_dir / v for v in VARIANTS]
    resumed = run_distributed(_one_process, 1, ref["batches"], None, dirs, timeout=TIMEOUT)[0]
    cells = {}
    for variant in VARIANTS:
        ranks = [r[variant] for r in per_rank]
        failed = next((r for r in ranks if isinstance(r, str)), None)
        cells[variant] = dict(
            error=failed,
            ranks=ranks,
            one_process={fmt: resumed.get((variant, fmt)) for fmt in FORMATS},
        )
    return cells


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("conformance")


def _cell_results(name: str, variant: str, root: Path) -> dict:
    cell = layout(name, root)[variant]
    if cell["error"] is not None:
        pytest.fail(f"{name} / initialize with {variant} failed:\n{cell['error']}")
    return cell


# ---- the checks --------------------------------------------------------------------------------
# float64 throughout: layouts differ from one process only in the order of sums. Measured
# over the matrix: losses within 5e-16 relative, weights after two AdamW steps within 3e-12
# of their magnitude. A wrong shard, a stale ZeRO row or a lost optimizer state moves a loss
# or a weight by a whole AdamW step (lr 1e-2), seven orders of magnitude above this bound
RTOL, ATOL = 1e-9, 1e-9
CELLS = [(name, variant) for name in LAYOUTS for variant in VARIANTS]


def test_one_process_matches_plain_pytorch(root):
    ref = reference(root)
    torch.testing.assert_close(ref["one_process"], ref["losses"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("name", "variant"), CELLS)
def test_losses(name, variant, root):
    ranks = _cell_results(name, variant, root)["ranks"]
    want = reference(root)["losses"][:SAVE_AT]
    torch.testing.assert_close(
        global_losses([r["losses"] for r in ranks]), want, rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize(("name", "variant"), CELLS)
def test_state_dict(name, variant, root):
    rank0 = _cell_results(name, variant, root)["ranks"][0]
    states = reference(root)["states"]
    for got, want in ((rank0["state"], states[SAVE_AT]), (rank0["loaded"], states[SAVE_AT])):
        assert list(got) == list(want), "keys differ from the plain model's state_dict"
        for key, value in got.items():
            assert type(value) is torch.Tensor, f"{key}: {type(value).__name__}, not a tensor"
            assert (value.shape, value.dtype) == (want[key].shape, want[key].dtype), key
    for key, value in rank0["state"].items():  # trained in the layout: summation order only
        torch.testing.assert_close(value, states[SAVE_AT][key], rtol=RTOL, atol=ATOL, msg=key)
    for key, value in rank0["loaded"].items():  # loaded, then gathered: copies, exactly
        torch.testing.assert_close(value, states[SAVE_AT][key], rtol=0, atol=0, msg=key)
    want = reference(root)["optim"]
    assert rank0["optim"]["state"].keys() == want["state"].keys()
    for name, moments in want["state"].items():  # AdamW's moments: summation order only
        for key, value in moments.items():
            got = rank0["optim"]["state"][name][key]
            torch.testing.assert_close(got, value, rtol=RTOL, atol=ATOL, msg=f"{name} {key}")


@pytest.mark.parametrize(("name", "variant"), CELLS)
def test_checkpoints(name, variant, root):
    cell = _cell_results(name, variant, root)
    want = reference(root)["losses"][SAVE_AT:]
    for fmt in FORMATS:
        resumed = global_losses([r["resumed"][fmt] for r in cell["ranks"]])
        msg = f"one process's {fmt} checkpoint resumed by {name}"
        torch.testing.assert_close(resumed, want, rtol=RTOL, atol=ATOL, msg=msg)
        msg = f"{name}'s {fmt} checkpoint resumed by one process"
        torch.testing.assert_close(cell["one_process"][fmt], want, rtol=RTOL, atol=ATOL, msg=msg)


@pytest.mark.parametrize(("name", "variant"), CELLS)
def test_shares(name, variant, root):
    ranks = _cell_results(name, variant, root)["ranks"]
    _, _, k_params, k_state, dp = LAYOUTS[name]
    for rank, r in enumerate(ranks):
        params, state = r["shares"]
        for what, share, k in (("parameters", params, k_params), ("AdamW state", state, k_state)):
            assert 1 / k - 0.01 <= share <= 1 / k + REPLICATED, (
                f"rank {rank} holds {share:.3f} of the dense {what}, expected about 1/{k}"
            )
    if dp > 1:  # data-parallel ranks trained on different rows of the batch
        first = {r["losses"][0] for r in ranks if r["losses"][0] is not None}
        assert len(first) >= dp, f"{dp} data-parallel ranks reported losses {first}"
