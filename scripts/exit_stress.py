"""Count how often a finished two-process gridtrain job still exits non-zero.

Runs N (default 100) jobs through ``gridtrain run --nproc_per_node 2``. Each job
trains a small MLP data-parallel for a few steps with the engine (the default,
overlapped gradient sync), saves a checkpoint with ``gt.save_checkpoint``,
calls ``gt.destroy()`` and returns. Every job should exit 0; the script prints
each failure's last lines and the totals, and exits 1 if any job failed.

    .venv/bin/python scripts/exit_stress.py            # 100 jobs, one at a time
    .venv/bin/python scripts/exit_stress.py -n 20 -j 4 # 20 jobs, 4 at once

Not run by CI (minutes of wall time). The same file is the training script:
``gridtrain run`` starts it with ``--worker``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CONFIG = "STEPS = 4\nBATCH = 8\n"  # data-parallel 2, default gradient handling (overlapped)
ABORT = "terminate called"


def worker(out_dir: str) -> None:
    """One rank of a job: train a few DP steps, save a checkpoint, destroy, return."""
    import torch
    from torch import nn

    import gridtrain as gt

    torch.set_num_threads(1)
    ctx = gt.launch_from_torch(backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = ctx.config.STEPS * ctx.config.BATCH * 2  # STEPS batches per data-parallel rank
    data = torch.utils.data.TensorDataset(torch.randn(n, 32), torch.randint(0, 4, (n,)))
    loader = gt.data.get_dataloader(data, batch_size=ctx.config.BATCH, shuffle=True)
    engine, loader, _, _ = gt.initialize(model, optimizer, nn.CrossEntropyLoss(), loader)
    engine.train()
    for x, y in loader:
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    gt.save_checkpoint(os.path.join(out_dir, "ckpt.pt"), 1, engine.model, engine.optimizer)
    gt.destroy()


def gridtrain_command() -> list[str]:
    script = Path(sys.executable).parent / "gridtrain"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "gridtrain.cli"]


def one_job(index: int, timeout: float) -> tuple[int, int, str, float]:
    """(index, exit code, output, seconds) of one two-process job."""
    with tempfile.TemporaryDirectory(prefix="gt-exit-stress-") as tmp:
        config = Path(tmp) / "config.py"
        config.write_text(CONFIG)
        argv = [
            *gridtrain_command(),
            "run",
            "--nproc_per_node",
            "2",
            "--config",
            str(config),
            __file__,
            "--worker",
            tmp,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        start = time.monotonic()
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            code, output = -1, f"timed out after {timeout}s\n{err.stdout or ''}{err.stderr or ''}"
        return index, code, output, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--runs", type=int, default=100, help="jobs to run (default 100)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="jobs at once (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0

    failed, aborts = 0, 0
    start = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        for index, code, output, seconds in pool.map(
            lambda i: one_job(i, args.timeout), range(args.runs)
        ):
            abort = ABORT in output
            aborts += abort
            if code != 0:
                failed += 1
                tail = "\n".join(output.strip().splitlines()[-15:])
                print(f"run {index}: exit code {code}{' (abort)' if abort else ''}\n{tail}\n")
            print(f"run {index}: exit {code} in {seconds:.1f}s", flush=True)
    print(
        f"{failed} of {args.runs} jobs exited non-zero; {aborts} printed '{ABORT}' "
        f"({time.monotonic() - start:.0f}s)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
