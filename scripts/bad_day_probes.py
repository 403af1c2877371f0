"""Issue 33's probe table: each bad-day probe run N times, as a user meets it.

    /work/bin/gslot python scripts/bad_day_probes.py                   # every probe
    /work/bin/gslot python scripts/bad_day_probes.py --only fp16,args --scale 2

Prints one markdown row per probe (probe, trials, failures, what a failure was) as each group
finishes, then the whole table. Jobs start through ``gridtrain run`` (2 ranks, gloo) or plain
``python``, with the scripts in ``scripts/bad_day_jobs.py``:

- damaged latest + ``--max-restarts 1``: attempt 0 saves epochs 1 and 2, damages epoch 2 at
  random (a flipped byte or a cut, in any of its files) and loses a rank; attempt 1 must
  resume from epoch 1 and finish (sharded under 1d2, dense);
- disk full during ``save_checkpoint`` (dense, sharded) and ``save_pretrained``, in a small
  tmpfs of its own (``unshare -m``, a size per trial): every rank's error names the path and
  says the disk is full, the previous save loads whole, no temporary is left;
- a 2-rank reader loading a checkpoint while another process overwrites it (one trial per
  load): one whole save, the same on both ranks;
- fp16 overflow runs (torch and naive; 100, 200, 1,000 overflowing steps then 3 finite ones):
  the default stops at ``max_skipped_steps`` (64) with ``NonFiniteLossError``, and with
  ``max_skipped_steps=0`` the run survives with finite weights that the finite steps move;
- dropout resume under dp2 and 1d2: a rank lost between checkpoints, ``--max-restarts 1``,
  the resume fast-forwards the loader; losses and final weights bit-identical to a run that
  never failed;
- untrusted Hugging Face directories: index entries leaving the directory, FIFOs, a
  directory, a device, a cut shard: refused, naming the entry, without blocking;
- ``kill -9`` of the launcher's group with DataLoader workers (``get_dataloader``'s and a plain
  torch one's): nothing alive 5 s later;
- the 20 argument strings of ``tests/test_launch_args.py``, each through a real launch.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import bad_day_jobs as jobs

REPO = Path(__file__).resolve().parents[1]
TP2 = "parallel = dict(tensor=dict(size=2, mode='1d'))\n"
Rows = dict[str, list]  # probe name -> one entry per trial: None (held) or what went wrong


# ---- running jobs ---------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    env.pop("GRIDTRAIN_CONFIG", None)
    return {**env, **extra}


def _write(work: Path, body: str, config: str | None) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.py").write_text(jobs.PRELUDE + body)
    if config is not None:
        (work / "config.py").write_text(config)


def run_command(nproc: int = 2, config: str | None = "", options=(), args=()) -> list[str]:
    """``gridtrain run`` of ``job.py`` in the current directory."""
    head = [
        "--nproc_per_node",
        str(nproc),
        *(["--config", "config.py"] if config is not None else []),
    ]
    return [sys.executable, "-m", "gridtrain.cli", "run", *head, *options, "job.py", *args]


def launch(work: Path, body: str, *, config: str | None = "", options=(), args=(), wrap=(),
           timeout: float = 300) -> tuple[int, str, list[dict]]:  # fmt: skip
    """Run ``body`` through ``gridtrain run`` in ``work``: (exit code, output, RESULT records)."""
    _write(work, body, config)
    command = [*wrap, *run_command(2, config, options, args)]
    try:
        proc = subprocess.run(
            command, cwd=work, env=_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        return -1, f"timed out after {timeout:g} s\n{err.stdout or ''}", []
    return proc.returncode, proc.stdout + proc.stderr, records(proc.stdout)


def python(work: Path, body: str, *args: str, timeout: float = 300, **env: str):
    """Run ``body`` with plain ``python`` in ``work``: (exit code, output, RESULT records)."""
    _write(work, body, None)
    try:
        proc = subprocess.run(
            [sys.executable, "job.py", *args], cwd=work, env=_env(**env), capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return -1, f"blocked for {timeout:g} s", []
    return proc.returncode, proc.stdout + proc.stderr, records(proc.stdout)


def records(stdout: str) -> list[dict]:
    """Every ``RESULT {json}`` in ``stdout`` (two ranks' lines may share a line)."""
    found, decoder = [], json.JSONDecoder()
    for piece in stdout.split("RESULT ")[1:]:
        try:
            found.append(decoder.raw_decode(piece)[0])
        except ValueError:
            continue
    return found


def tail(out: str, lines: int = 3) -> str:
    return " / ".join(line.strip() for line in out.strip().splitlines()[-lines:])[:300]


# ---- the probes -----------------------------------------------------------------------------
def damaged_latest(root: Path, trials: int) -> Rows:
    rows: Rows = {}
    for fmt, config in (("sharded", TP2), ("dense", "")):
        row = rows.setdefault(f"damaged latest + --max-restarts 1 ({fmt})", [])
        for trial in range(trials):
            code, out, recs = launch(
                root / f"damaged_{fmt}_{trial}", jobs.DAMAGED, config=config,
                options=["--max-restarts", "1"], args=[fmt, str(trial)],
            )  # fmt: skip
            resumed = {r["resumed"] for r in recs if r.get("attempt") == 1 and "resumed" in r}
            damage = next((r["damaged"] for r in recs if "damaged" in r), "?")
            ok = code == 0 and resumed == {f"epoch_1{'' if fmt == 'sharded' else '.pt'}"}
            row.append(None if ok else f"{damage}: exit {code}, resumed {resumed}: {tail(out)}")
    return rows


def disk_full(root: Path, trials: int) -> Rows:
    rows: Rows = {}
    for trial in range(trials):
        size, shard = 384 + 64 * (trial % 3), ("20KB", "64KB", "1GB")[trial % 3]
        work = root / f"disk_{trial}"
        disk = work / "disk"
        disk.mkdir(parents=True)
        mount = f'mount -t tmpfs -o size={size}k tmpfs {disk} && exec "$@"'
        wrap = ["unshare", "-m", "--map-root-user", "sh", "-c", mount, "sh"]
        code, out, recs = launch(work, jobs.DISK_FULL, wrap=wrap, args=[str(disk), shard])
        for save in ("save_checkpoint dense.pt", "save_checkpoint sharded", "save_pretrained"):
            got = [r for r in recs if r.get("save") == save]
            bad = [_disk_full_problem(r) for r in got]
            bad = [b for b in bad if b] or ([] if len(got) == 2 else [f"exit {code}: {tail(out)}"])
            rows.setdefault(f"disk full during {save}", []).append(
                f"{size} KiB: {bad[0]}" if bad else None
            )
    return rows


def _disk_full_problem(rec: dict) -> str | None:
    error = rec["error"] or ""
    if rec["path"] not in error or "is full" not in error:
        return f"rank {rec['rank']}: {error[:200] or 'no error'}"
    if not rec["whole"]:
        return f"rank {rec['rank']}: the previous save did not load whole"
    if rec["left"]:
        return f"rank {rec['rank']}: left {rec['left']}"
    return None


def concurrent_read(root: Path, trials: int) -> Rows:
    rows: Rows = {}
    for fmt in ("sharded", "dense"):
        work = root / f"concurrent_{fmt}"
        path = str(work / ("ckpt" if fmt == "sharded" else "ckpt.pt"))
        _write(work / "saver", jobs.SAVER, None)
        saver = subprocess.Popen(
            [sys.executable, "job.py", path, fmt], cwd=work / "saver", env=_env(),
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert saver.stdout.readline().strip() == "ready"
            code, out, recs = launch(work, jobs.READER, args=[path, str(trials)])
        finally:
            saver.kill()
            saver.wait()
        row = rows.setdefault(f"concurrent read while overwriting ({fmt})", [])
        for rec in recs:
            (epoch, values), other = rec["seen"]
            mixed = epoch is None or values != [float(epoch)] or other != [epoch, values]
            row.append(f"{rec['seen']}" if mixed else None)
        row += [f"exit {code}: {tail(out)}"] * (trials - len(recs))
        epochs = {rec["seen"][0][0] for rec in recs}
        print(f"# {fmt}: the loads saw {len(epochs)} different saves", file=sys.stderr)
    return rows


def fp16_overflow(root: Path, trials: int) -> Rows:
    rows: Rows = {}
    for mode in ("torch", "naive"):
        for bad in (100, 200, 1000):
            row = rows.setdefault(f"fp16 overflow, {mode}, {bad} bad steps", [])
            for trial in range(trials):
                for limit in (None, 0):  # the default stop (64), and never stopping
                    row.append(_overflow_trial(root, mode, bad, trial, limit))
    return rows


def _overflow_trial(root: Path, mode: str, bad: int, seed: int, limit: int | None) -> str | None:
    work = root / f"fp16_{mode}_{bad}_{seed}_{limit}"
    section = f"mode=AMP_TYPE.{mode.upper()}" + (
        "" if limit is None else f", max_skipped_steps={limit}"
    )
    (work).mkdir(parents=True)
    (work / "config.py").write_text(f"from gridtrain.amp import AMP_TYPE\nfp16 = dict({section})\n")
    code, out, recs = python(work, jobs.OVERFLOW, str(bad), str(seed),
                             GRIDTRAIN_CONFIG=str(work / "config.py"))  # fmt: skip
    if code != 0 or len(recs) != 1:
        return f"exit {code}: {tail(out)}"
    r = recs[0]
    if limit is None:
        ok = r["done"] == 63 and r["error"] and "max_skipped_steps" in r["error"] and r["finite"]
    else:
        ok = r["error"] is None and r["done"] == bad + 3 and r["finite"] and r["moved"]
    return None if ok else f"max_skipped_steps={limit}: {r}"


def dropout_resume(root: Path, trials: int) -> Rows:
    rows: Rows = {}
    for layout, config in (("dp2", ""), ("1d2", TP2)):
        row = rows.setdefault(f"dropout resume under {layout} (--max-restarts 1)", [])
        code, out, whole = launch(root / f"dropout_{layout}_whole", jobs.DROPOUT, config=config,
                                  args=["0"])  # fmt: skip
        if code != 0 or len(whole) != 2:
            row += [f"the uninterrupted run: exit {code}: {tail(out)}"] * trials
            continue
        for trial in range(trials):
            crash = (3, 5, 7, 4, 6)[trial % 5]
            code, out, recs = launch(root / f"dropout_{layout}_{trial}", jobs.DROPOUT,
                                     config=config, options=["--max-restarts", "1"],
                                     args=[str(crash)])  # fmt: skip
            row.append(_same_run(whole, [r for r in recs if r["attempt"] == 1], crash, code, out))
    return rows


def _same_run(whole: list[dict], resumed: list[dict], crash: int, code: int, out: str):
    if code != 0 or len(resumed) != 2:
        return f"lost after step {crash}: exit {code}: {tail(out)}"
    for ref, got in zip(
        sorted(whole, key=lambda r: r["rank"]), sorted(resumed, key=lambda r: r["rank"])
    ):
        if not 0 < got["first"] <= crash:  # the newest checkpoint before the loss
            return f"lost after step {crash}: resumed at step {got['first']}"
        want = {k: v for k, v in ref["losses"].items() if int(k) >= got["first"]}
        if got["losses"] != want or got["digest"] != ref["digest"]:
            return f"lost after step {crash}, rank {got['rank']}: {got['losses']} != {want}"
    return None


HF_TRAVERSAL = ("dotdot", "dotdot-deep", "dot-dotdot", "absolute", "link-out", "device")
HF_OTHER = ("fifo", "fifo-single", "directory", "truncated")


def hf_untrusted(root: Path, trials: int) -> Rows:
    export = root / "hf_export"
    code, out, _ = python(root / "hf_save", jobs.HF_LOAD, str(export), "save", str(root))
    if code != 0:
        raise RuntimeError(f"the export failed: {tail(out)}")
    rows: Rows = {}
    for variants, name in ((HF_TRAVERSAL, "traversal"), (HF_OTHER, "FIFO, directory, cut shard")):
        row = rows.setdefault(f"HF directory: {name}", [])
        for trial in range(trials):
            for variant in variants:
                work = root / f"hf_{variant}_{trial}"
                code, out, recs = python(work, jobs.HF_LOAD, str(export), variant, str(work),
                                         timeout=120)  # fmt: skip
                rec = recs[0] if recs else {}
                error = rec.get("error") or ""
                ok = code == 0 and rec and Path(rec["name"]).name in error
                row.append(None if ok else f"{variant}: {error[:200] or tail(out)}")
    return rows


def kill_9_workers(root: Path, trials: int) -> Rows:
    row = []
    for trial in range(trials):
        work = root / f"kill9_{trial}"
        _write(work, jobs.WORKERS, "")
        proc = subprocess.Popen(
            run_command(), cwd=work, env=_env(), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        pids: list[int] = []
        seen = 0
        deadline = time.monotonic() + 240
        while seen < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            for rec in records(line):
                pids += rec["pids"]
                seen += 1
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        end = time.monotonic() + 5
        while [p for p in pids if _alive(p)] and time.monotonic() < end:
            time.sleep(0.1)
        left = [p for p in pids if _alive(p)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        row.append(f"alive 5 s later: {left}" if left or seen < 2 else None)
    return {"kill -9 of the launcher's group, DataLoader workers": row}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def argument_pass_through(root: Path, trials: int) -> Rows:
    sys.path.insert(0, str(REPO / "tests"))
    from test_launch_args import ARGUMENTS  # the 20 strings the tests use

    row = []
    for i, arguments in enumerate(ARGUMENTS[: trials or None]):
        work = root / f"args_{i}"
        _write(work, "", "")
        (work / "job.py").write_text(jobs.SHOW_ARGV)
        args = shlex.split(arguments)
        proc = subprocess.run(
            run_command(1, "", args=args), cwd=work, env=_env(), capture_output=True,
            text=True, timeout=240,
        )  # fmt: skip
        got = [json.loads(x[5:]) for x in proc.stdout.splitlines() if x.startswith("ARGV ")]
        row.append(None if got == [args] else f"{arguments!r}: got {got}, exit {proc.returncode}")
    return {"launcher argument pass-through (20 strings)": row}


PROBES: dict[str, tuple[Callable[[Path, int], Rows], int]] = {
    "damaged": (damaged_latest, 3),
    "disk": (disk_full, 3),
    "concurrent": (concurrent_read, 80),
    "fp16": (fp16_overflow, 1),
    "dropout": (dropout_resume, 3),
    "hf": (hf_untrusted, 1),
    "kill9": (kill_9_workers, 5),
    "args": (argument_pass_through, 20),
}


def row_text(name: str, results: list) -> str:
    failures = [r for r in results if r is not None]
    note = failures[0] if failures else ""
    return f"| {name} | {len(results)} | {len(failures)} | {note} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated: {', '.join(PROBES)}")
    parser.add_argument("--scale", type=float, default=1.0, help="trials x this (at least 1)")
    opts = parser.parse_args()
    chosen = [p for p in opts.only.split(",") if p] or list(PROBES)
    unknown = sorted(set(chosen) - set(PROBES))
    if unknown:
        parser.error(f"unknown probe(s) {unknown}; choose from {', '.join(PROBES)}")
    table = ["| probe | trials | failures | first failure |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="bad-day-") as tmp:
        for name in chosen:
            probe, trials = PROBES[name]
            began = time.monotonic()
            rows = probe(Path(tmp) / name, max(1, round(trials * opts.scale)))
            for row, results in rows.items():
                table.append(row_text(row, results))
                print(table[-1], f"({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
    print("\n".join(table))


if __name__ == "__main__":
    main()
