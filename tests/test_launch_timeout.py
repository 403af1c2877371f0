"""``timeout_s`` bounds every collective: WORLD (init_process_group) and every group new_group made."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from helpers.harness import run_distributed

import gridtrain as gt

PM = gt.ParallelMode
TIMEOUT_S = 2.0
# the late ranks stay at most this long: well past the timeout, well inside the harness's
LATE_S = 6.0


def _wait_for_a_late_peer(ctx, marks: str):
    """Rank 0 waits on its TENSOR group ([0, 1], made by new_group), rank 2 on WORLD; 1 and 3
    never join, so both must give up after timeout_s. The late ones stay until both waiting
    ranks have given up (a file each in ``marks``), LATE_S at most: leaving earlier could end
    a wait by a lost peer instead of the timeout; staying longer only costs time."""
    mode = {0: PM.TENSOR, 2: PM.GLOBAL}.get(ctx.global_rank)
    if mode is None:
        deadline = time.monotonic() + LATE_S
        while len(os.listdir(marks)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=ctx.group(mode))
    except Exception as err:  # noqa: BLE001 - the timeout is what we measure
        return time.monotonic() - start, f"{type(err).__name__}: {err}"
    finally:
        open(os.path.join(marks, str(ctx.global_rank)), "w").close()
    return time.monotonic() - start, "no error"


def test_collectives_time_out_after_timeout_s(tmp_path):
    config = dict(parallel=dict(tensor=dict(size=2, mode="1d")), timeout_s=TIMEOUT_S)
    results = run_distributed(_wait_for_a_late_peer, 4, str(tmp_path), config=config, timeout=120)
    for rank in (0, 2):
        elapsed, error = results[rank]
        assert error != "no error", f"rank {rank}: the collective completed without its peers"
        # gloo checks its deadline while waiting; 3 s of slack for a loaded CI machine
        assert TIMEOUT_S - 0.5 <= elapsed <= TIMEOUT_S + 3.0, (rank, elapsed, error)


def _timeout_of(ctx):
    return ctx.config.timeout_s


def test_launch_argument_overrides_the_config_and_is_checked():
    assert run_distributed(_timeout_of, 1, config=dict(timeout_s=7)) == [7.0]
    cfg = gt.Config.from_dict(dict(timeout_s=7))
    with pytest.raises(gt.ConfigError, match="timeout_s must be a number > 0 and <= 1e.09 .*got 0"):
        gt.launch(cfg, rank=0, world_size=1, host="127.0.0.1", port=1, timeout_s=0)
    assert not dist.is_initialized()
