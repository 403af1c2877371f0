"""The parity harness itself (``helpers/runs.py``, ``helpers/harness.py``): under ZeRO 3 a run
reports instead of hanging, and the gradients it reads back from the optimizer are the dense
ones the reference computes."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from helpers.harness import PORT_BLOCK, free_port, run_distributed
from helpers.models import TinyTransformer
from helpers.runs import (
    assert_grads_close,
    dense_lm_loss,
    engine_run,
    global_losses,
    lm_loss,
    reference_run,
    seeded,
    token_batches,
)

import gridtrain as gt

TIMEOUT = 60
BATCHES = token_batches(2, 4, 8, 32)


def _fsdp2_gradients(ctx):
    """What parity tests used to send back under ZeRO 3: ``p.grad`` as FSDP2 leaves it."""
    model = torch.nn.Linear(8, 8)
    engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    grads = None
    for _ in range(2):
        engine.zero_grad()
        engine.backward(engine(torch.ones(4, 8)).square().mean())
        engine.step()
        grads = grads or {n: p.grad for n, p in engine.model.named_parameters()}
    return grads


def test_a_zero3_shard_in_a_result_fails_fast_instead_of_hanging():
    # The queue shares a result tensor's storage from a background thread once the function
    # has returned; an FSDP2 gradient (a DTensor over a buffer FSDP2 manages) crashed the
    # worker there, and the call waited out its whole timeout. Now each rank copies its
    # result before it tears down and refuses a DTensor by name: a failure in seconds.
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"result\['weight'\] is a DTensor"):
        run_distributed(_fsdp2_gradients, 2, config=dict(zero=3), timeout=TIMEOUT)
    assert time.monotonic() - start < TIMEOUT / 2, "reported, not timed out"


def _build():
    return seeded(lambda: TinyTransformer(vocab=32, hidden=16, heads=2, seq=8), 0)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _engine_run(ctx):
    return engine_run(ctx, _build, BATCHES, lm_loss, _adamw, grad_steps=2)


@pytest.mark.parametrize(
    "config", [dict(zero=3), dict(zero=dict(stage=3, offload=True))], ids=["zero3", "gemini"]
)
def test_a_zero3_run_reads_back_the_dense_gradients(config):
    dense_loss = dense_lm_loss
    ref = reference_run(_build, BATCHES, dense_loss, _adamw, grad_steps=2)
    runs = run_distributed(_engine_run, 2, config=config, timeout=TIMEOUT)
    # float64: the data-parallel halves only reorder sums (measured <= 1e-16 on gradients)
    assert global_losses(runs) == pytest.approx(ref.losses, rel=1e-12)
    for rank, run in enumerate(runs):
        assert max(run.shares.values()) <= 0.5, (rank, run.shares)  # really sharded
        for step in range(2):  # a gradient recovered from the moments of each step
            assert_grads_close(run.grads[step], ref, step, f"rank {rank}", rtol=1e-10, atol=1e-14)


def test_each_test_process_draws_ports_from_its_own_block(monkeypatch):
    """Under pytest-xdist, worker gwN's ports lie in its own block below the kernel's ephemeral
    range: two test processes never hand the same port to their rank 0s."""
    first, size = PORT_BLOCK
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    for n in (0, 3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{n}")
        ports = [free_port() for _ in range(5)]
        low = first + n * size
        assert all(low <= p < low + size for p in ports), (n, ports)
        assert low + size <= ephemeral_low, "a bind to port 0 could be handed one of them"
        assert len(set(ports)) == 5, ports
        for p in ports:  # each is free when handed out
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


def _rank(ctx):
    return ctx.global_rank


def _abort_on_rank_1(ctx):
    import os

    if ctx.global_rank == 1:
        os.abort()  # as glibc does on a corrupted heap ("malloc_consolidate(): invalid chunk")
    return ctx.global_rank


def test_a_rank_whose_process_dies_fails_the_call_at_once_naming_the_signal():
    # it used to wait out the whole timeout (240 s in test_conformance) for a report that a
    # dead process never sends
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed:\n.*ended \(signal SIGABRT\)"):
        run_distributed(_abort_on_rank_1, 2, timeout=TIMEOUT)
    assert time.monotonic() - start < TIMEOUT / 2, "reported, not timed out"
    assert run_distributed(_rank, 2) == [0, 1], "the next call gets a whole pool again"
