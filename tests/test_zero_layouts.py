"""ZeRO under every tensor mode: the GPT demo (tied head, fused head-major qkv) trains under
2d, 2.5d, 3d and sequence parallelism with ZeRO exactly as without it (``test_gpt_model`` and
``test_sequence`` prove the layouts equal to one process)."""

import functools
import sys
from pathlib import Path

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import tensor_of
from helpers.runs import data_rows, engine_run, state_numel, token_batches

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from demos.gpt import model as gpt_model  # noqa: E402

CFG = gpt_model.preset("tiny", n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64)
STEPS, BATCH, SEQ = 3, 8, 16


def _batches():
    return token_batches(STEPS, BATCH, SEQ, CFG.vocab_size, seed=7)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(ctx, batches):
    build = lambda: gpt_model.GPT(CFG, seed=0).double()  # noqa: E731
    example = data_rows(batches[0][0], ctx)
    run = engine_run(
        ctx, build, batches, gpt_model.GPTLoss(), _adamw, probe=state_numel, example_inputs=example
    )
    return run.losses, run.state, run.probed


# name: (world, tensor config, zero stage)
LAYOUTS = {
    "dp2-2d4-stage3": (8, tensor_of("dp2-2d4"), 3),
    "dp2-2.5d4-stage3": (8, tensor_of("dp2-2.5d4"), 3),
    "2.5d8-depth2-stage2": (8, tensor_of("2.5d8"), 2),
    "3d8-stage3": (8, tensor_of("3d8"), 3),
    "dp2-sequence2-stage2": (4, tensor_of("dp2-sequence2"), 2),
    "dp2-sequence2-stage3": (4, tensor_of("dp2-sequence2"), 3),
}


@functools.cache
def _without_zero(world: int, tensor: tuple) -> list:
    """Every rank's run of the layout without ZeRO: one run for the stages that share it."""
    config = dict(parallel=dict(tensor=dict(tensor)))
    return run_distributed(_train, world, _batches(), config=config, timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_under_tensor_modes_equals_the_layout_without(name):
    world, tensor, stage = LAYOUTS[name]
    config = dict(parallel=dict(tensor=tensor))
    plain = _without_zero(world, tuple(sorted(tensor.items())))
    zero = run_distributed(_train, world, _batches(), config=dict(config, zero=stage), timeout=300)
    data = world // tensor["size"]
    for rank in range(world):
        losses, final, held = zero[rank]
        # float64; ZeRO only reorders the data-parallel sums (see test_zero.py)
        assert losses == pytest.approx(plain[rank][0], rel=1e-10)
        for k, v in plain[rank][1].items():
            torch.testing.assert_close(final[k], v, rtol=1e-6, atol=1e-10, msg=f"{rank} {k}")
        # rows split over the data ranks (sequence: data x sequence ranks share the weights)
        split = data * (tensor["size"] if tensor["mode"] == "sequence" else 1)
        assert held <= plain[rank][2] / split + 64 * split, (held, plain[rank][2])
