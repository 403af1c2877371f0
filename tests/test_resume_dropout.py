"""A resumed run with dropout ends bit-identical to an uninterrupted one, under data parallelism
and under 1d tensor parallelism, when it fast-forwards its loader to the saved position as a
step-based script does (``demos/gpt/train.py --resume``): the loader's iterators never draw
from the global RNG, so skipping batches shifts no dropout mask.

Also: a tensor mode that cuts the batch (2d) refuses, at ``get_dataloader``, a last batch
it could not split.
"""

from __future__ import annotations

import pytest
import torch
from helpers.harness import run_distributed
from helpers.layouts import layout
from helpers.models import adamw_halving, classifier_net
from helpers.runs import engine_step, start_engine
from torch.utils.data import TensorDataset

import gridtrain as gt

TIMEOUT = 300
D_IN, N_CLASSES, SAMPLES, BATCH, STEPS, STOP = 16, 8, 24, 4, 8, 4
LAYOUTS = {name: layout(name)[1] for name in ("dp2", "1d2")}  # both on 2 ranks


def _forever(loader):
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _train(ctx, path: str, resume: bool):
    """Steps 0..STEPS-1 (or, resuming, from the saved step on), a checkpoint after STOP steps:
    (losses, the dense weights at the end)."""
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(
        torch.randn(SAMPLES, D_IN, generator=g), torch.randint(N_CLASSES, (SAMPLES,), generator=g)
    )
    loader = gt.data.get_dataloader(data, BATCH, shuffle=True, seed=5)
    torch.manual_seed(7)
    engine, sched = start_engine(
        classifier_net(dropout=0.2), gt.nn.CrossEntropyLoss(), adamw_halving,
        example_inputs=torch.zeros(BATCH, D_IN),
    )  # fmt: skip
    first = 0
    if resume:
        extra: dict = {}
        gt.load_checkpoint(path, engine.model, engine.optimizer, sched, extra=extra)
        first = extra["step"]
    batches = _forever(loader)
    for _ in range(first):  # the data position: the batches an uninterrupted run saw
        next(batches)
    losses = []
    for step in range(first, STEPS):
        x, y = next(batches)
        losses.append(engine_step(engine, x, y, ctx))
        if step + 1 == STOP and not resume:
            gt.save_checkpoint(
                path, 0, engine.model, engine.optimizer, sched, sharded=True, extra={"step": STOP}
            )
    return losses, gt.full_state_dict(engine.model)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resume_with_dropout_and_a_fast_forward_is_bit_identical(tmp_path, layout):
    path = str(tmp_path / "ckpt")
    whole = run_distributed(_train, 2, path, False, config=LAYOUTS[layout], timeout=TIMEOUT)
    resumed = run_distributed(_train, 2, path, True, config=LAYOUTS[layout], timeout=TIMEOUT)
    for (losses, state), (tail, resumed_state) in zip(whole, resumed, strict=True):
        assert tail == losses[STOP:], "every loss after the resume, bit for bit"
        for key, value in state.items():
            assert torch.equal(resumed_state[key], value), key


def _loader(ctx, samples: int, drop_last: bool):
    data = TensorDataset(torch.zeros(samples, D_IN))
    try:
        gt.data.get_dataloader(data, BATCH, drop_last=drop_last)
    except ValueError as err:
        return str(err)
    return None


def test_2d_refuses_a_last_batch_it_cannot_split_at_the_start():
    config = dict(parallel=dict(tensor=dict(size=4, mode="2d")))  # batch cut into q = 2 blocks
    errors = run_distributed(_loader, 4, 9, False, config=config, timeout=TIMEOUT)
    for error in errors:  # 9 samples in batches of 4: the last holds 1, which 2 blocks cannot
        assert error is not None and "last batch of each epoch holds 1 samples" in error, error
        assert "'2d'" in error and "divisible by 2" in error and "drop_last=True" in error
    assert run_distributed(_loader, 4, 9, True, config=config, timeout=TIMEOUT) == [None] * 4
    assert run_distributed(_loader, 4, 10, False, config=config, timeout=TIMEOUT) == [None] * 4
