"""Every decoder-only causal LM family of the installed ``transformers``, tiny, under 1d2, 2d4,
pp2 and sequence 2, from the config alone: each cell equals the same model trained in one
plain process, or is refused at ``gt.initialize`` with a ``gt.PlanError`` naming what it
lacks. Never a silent mismatch, never another error.

The families are ``transformers``' own list (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), each
class once, built tiny by ``helpers.hf_zoo`` (2 layers, hidden 32, vocabulary 64, 8 tokens,
2 steps); ``hf_sweep_table.SKIPPED`` lists those left out and why (found by building each:
``hf_zoo.survey()``). ``make test`` sweeps ``QUICK`` (the families issue 32 names and one of
each other kind of code, 30; ``QUICK_2D`` of them under 2d4) and ``QUICK_EXTRA`` (the refusals
no other family shows); ``GT_SWEEP=all`` (or ``python tests/test_hf_sweep.py all``, which
prints the table; ``... dory,llama seq2`` prints those cells) sweeps every family. One
distributed call per layout runs every family in turn (``gt.initialize`` many times in one
launch), and one more the plain runs, half on each process; float64, or float32 where the
family's MoE kernels take no float64.

Equal means: the global losses of both steps, every parameter's first-step gradient (read
off SGD's momentum) and ``gt.full_state_dict`` after training (every key of the dense
``state_dict``, tied aliases included) agree with the plain run; and each rank holds at most
``HELD[layout]`` of the dense parameters outside experts where the layout shards them.
A refusal is filed under a short reason (``hf_sweep_table.REASONS``) that must be the one
``hf_sweep_table.EXPECTED`` gives the cell.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_zoo
from helpers.harness import run_distributed
from helpers.hf_sweep_table import EXPECTED, FLOAT32, KNOWN, REASONS, SKIPPED
from helpers.runs import (
    data_rows,
    engine_step,
    global_losses,
    local_numel,
    reference_run,
    start_engine,
    stepped_grads,
    token_batches,
)

import gridtrain as gt

STEPS, BATCH, SEQ = 2, 4, 8
LAYOUTS = {
    "1d2": (2, dict(parallel=dict(tensor=dict(size=2, mode="1d")))),
    "2d4": (4, dict(parallel=dict(tensor=dict(size=4, mode="2d")))),
    "pp2": (2, dict(parallel=dict(pipeline=2), num_microbatches=2)),
    "seq2": (2, dict(parallel=dict(tensor=dict(size=2, mode="sequence")))),
}
# the most of the dense parameters outside experts one rank may hold where the layout shards
# them (2-layer models: embeddings and heads are a large part; a replica holds 1.0)
HELD = {"1d2": 0.8, "2d4": 0.6, "pp2": 0.85}
# float64: layouts differ from one process only by summation order, but many families' norms
# and activations round to float32 inside (OLMo2, Apertus): ~1e-8 absolute, a few 1e-5 relative
# on small weights; float32 leaves ~1e-6. A dropped soft cap, multiplier or stale weight moves
# a loss by percent and a weight by a whole SGD step (lr 0.1 x gradient).
TOL = {torch.float64: dict(rtol=1e-5, atol=1e-7), torch.float32: dict(rtol=2e-4, atol=2e-5)}
# what make test sweeps: the families issue 32 names, then one of each other kind of code
QUICK = [
    *("gpt_neox", "opt", "qwen3", "gemma2", "olmo2", "starcoder2", "granite", "cohere"),
    *("llama", "mistral", "qwen2", "gemma", "gemma3_text", "phi", "phi3", "gpt2", "gptj"),
    *("falcon", "bloom", "mpt", "xglm", "biogpt", "stablelm", "nemotron", "nanochat"),
    *("mixtral", "qwen3_moe", "mamba", "gpt_bigcode", "jetmoe"),
]
# 2d4 runs 4 ranks on CI's 2 cores, each importing every family's code: make test sweeps the
# named families there and one of each 2d outcome (norm forms, experts, fused and unequal blocks)
QUICK_2D = [
    *("gpt_neox", "opt", "qwen3", "gemma2", "olmo2", "starcoder2", "granite", "cohere"),
    *("llama", "gemma", "phi3", "gpt2", "nemotron", "nanochat", "mixtral", "mamba"),
    "gpt_bigcode",
]
# cells make test adds: each refusal issue 32 added for what a layout cannot run exactly
# (refused at gt.initialize: no step, no plain run)
QUICK_EXTRA = {
    "seq2": ["minimax", "phimoe", "dory", "llama4_text"],
    "pp2": ["hrm_text"],
    "1d2": ["phimoe"],
}


def families(layout_name: str | None = None) -> list[str]:
    """The model types swept under ``layout_name`` (None: under any): ``QUICK`` (``QUICK_2D``
    under 2d4) and ``QUICK_EXTRA``; with ``GT_SWEEP=all`` every causal LM class of
    ``transformers`` but ``SKIPPED``; with ``GT_SWEEP=llama,opt`` those."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    which = os.environ.get("GT_SWEEP", "")
    if which == "all":
        return [m for m in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if m not in SKIPPED]
    if which:
        return which.split(",")
    if layout_name is None:
        return list(dict.fromkeys([*QUICK, *(f for x in QUICK_EXTRA.values() for f in x)]))
    return (QUICK_2D if layout_name == "2d4" else QUICK) + QUICK_EXTRA.get(layout_name, [])


def dtype_of(name: str) -> torch.dtype:
    return torch.float32 if name in FLOAT32 else torch.float64


def lm_loss(out, labels):
    return gt.nn.CrossEntropyLoss()(out.logits.reshape(-1, hf_zoo.VOCAB), labels.reshape(-1))


def dense_loss(out, labels):
    return F.cross_entropy(out.logits.reshape(-1, hf_zoo.VOCAB), labels.reshape(-1))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batches() -> list:
    return [(dict(input_ids=x), y) for x, y in token_batches(STEPS, BATCH, SEQ, hf_zoo.VOCAB)]


@cache
def reference() -> dict[str, object]:
    """Family -> its plain run (``reference_run``: one process, no gridtrain), for every
    family a layout may find equal (``EXPECTED`` refuses the others everywhere), computed on
    the test pool's two processes, half each (they import the families' code the layouts run
    next)."""
    names = [n for n in families() if set(LAYOUTS) - set(EXPECTED.get(n, {}))]
    ranks = run_distributed(_plain_runs, 2, names, batches(), timeout=900)
    return {name: run for runs in ranks for name, run in runs.items()}


def _plain_runs(ctx, names: list[str], data) -> dict:
    """This process's share of ``names``, each trained in plain PyTorch (the launched context
    is not used)."""
    mine = names[ctx.global_rank :: ctx.world_size()]
    return {
        n: reference_run(functools.partial(hf_zoo.build, n, dtype_of(n)), data, dense_loss, sgd)
        for n in mine
    }


@cache
def plain_run(name: str):
    """``name``'s plain run: ``reference()``'s, else computed here (a family ``EXPECTED``
    refuses everywhere that a layout found equal)."""
    ref = reference().get(name)
    return ref or reference_run(
        functools.partial(hf_zoo.build, name, dtype_of(name)), batches(), dense_loss, sgd
    )


def _cell(ctx, name: str, dtype, data) -> dict:
    """One family under this launch's layout, on this rank."""
    model = hf_zoo.build(name, dtype)
    dense = _numel(model, torch.Tensor.numel)
    try:
        engine, _ = start_engine(model, lm_loss, sgd)
    except gt.PlanError as err:
        return dict(refused=str(err))
    losses, grads = [], None
    for step, batch in enumerate(data):
        losses.append(engine_step(engine, *data_rows(batch, ctx), ctx))
        if step == 0:
            grads = stepped_grads(
                None, gt.full_optimizer_state_dict(engine.model, engine.optimizer)
            )
    held = _numel(engine.model, local_numel) / dense
    state = gt.full_state_dict(engine.model)
    first = ctx.global_rank == 0  # dense values are alike on every rank: ship one
    return dict(
        losses=losses,
        held=held,
        plan=str(engine.plan) if first else None,
        grads=grads if first else None,
        state=state if first else None,
    )


def _numel(model, count) -> int:
    """Parameters outside experts (the tensor plan keeps experts whole: their spread is
    ``moe.expert_parallel_size``'s business), counted by ``count``."""
    return sum(count(p) for n, p in model.named_parameters() if ".experts." not in n)


def _sweep(ctx, names: list[tuple[str, torch.dtype]], data) -> dict:
    out = {}
    for name, dtype in names:
        start = time.perf_counter()
        try:
            out[name] = _cell(ctx, name, dtype, data)
        except Exception:  # noqa: BLE001 - reported per cell
            out[name] = dict(error=traceback.format_exc())
        out[name]["seconds"] = time.perf_counter() - start
    return out


@cache
def layout(name: str) -> dict[str, list[dict]]:
    """Family -> every rank's cell, for one layout (one distributed call)."""
    world, config = LAYOUTS[name]
    names = [(n, dtype_of(n)) for n in families(name)]
    ranks = run_distributed(_sweep, world, names, batches(), config=config, timeout=900)
    return {family: [r[family] for r in ranks] for family, _ in names}


def verdict(family: str, layout_name: str) -> str:
    """'=' when the cell equals one process (asserted), else the refusal's message."""
    cells = layout(layout_name)[family]
    errors = [c["error"] for c in cells if "error" in c]
    assert not errors, f"{family} under {layout_name} failed:\n{errors[0]}"
    refused = {c.get("refused") for c in cells}
    if refused != {None}:
        assert None not in refused, f"{family} under {layout_name}: refused on some ranks only"
        return refused.pop()
    ref, tol, tag = plain_run(family), TOL[dtype_of(family)], f"{family} {layout_name}"
    torch.testing.assert_close(global_losses([c["losses"] for c in cells]), ref.losses, **tol)
    rank0 = cells[0]
    assert set(rank0["state"]) == set(ref.state), f"{tag}: state dict keys differ"
    for key, value in ref.state.items():
        torch.testing.assert_close(rank0["state"][key], value, **tol, msg=_msg(f"{tag} {key}"))
    for key, g in ref.grads[0].items():
        torch.testing.assert_close(rank0["grads"][key], g, **tol, msg=_msg(f"{tag} grad {key}"))
    bound = HELD.get(layout_name)
    if bound is not None:
        held = max(c["held"] for c in cells)
        assert held <= bound, f"{tag}: a rank holds {held:.2f} of the model"
    return "="


def _msg(tag: str):
    return lambda detail: f"{tag}: {detail}"


def reason_of(verdict_or_message: str) -> str:
    """'=' for an equal cell, else the short reason a refusal is filed under (``REASONS``)."""
    if verdict_or_message == "=":
        return "="
    return next((r for words, r in REASONS if words in verdict_or_message), verdict_or_message)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_every_family(layout_name):
    """Every family equals one process, or is refused for the reason ``EXPECTED`` gives; the
    ``KNOWN`` defects of other parts (GT_SWEEP=all only) are reported, not asserted."""
    got, want = {}, {}
    for family in families(layout_name):
        if layout_name in KNOWN.get(family, {}):
            continue
        got[family] = reason_of(verdict(family, layout_name))
        want[family] = EXPECTED.get(family, {}).get(layout_name, "=")
    wrong = {f: (got[f], want[f]) for f in got if got[f] != want[f]}
    assert not wrong, "\n".join(f"{f}: got {g!r}, expected {w!r}" for f, (g, w) in wrong.items())


def main(which: str, layouts: str) -> None:
    """Print every cell's verdict: ``python tests/test_hf_sweep.py [all|FAMILY,...]
    [LAYOUT,...]``."""
    if which != "quick":
        os.environ["GT_SWEEP"] = which
    for layout_name in layouts.split(","):
        start = time.perf_counter()
        layout(layout_name)
        print(f"# {layout_name}: {time.perf_counter() - start:.1f} s", flush=True)
        for family in families(layout_name):
            try:
                v = verdict(family, layout_name)
                print(f"{layout_name} {family} {reason_of(v)!r} {v[:300]!r}", flush=True)
            except AssertionError as err:
                text = str(err)  # a traceback's last lines say what failed
                print(f"{layout_name} {family} FAILED {text[:200] + text[-2500:]!r}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:], *("quick", ",".join(LAYOUTS))[len(sys.argv) - 1 :])
