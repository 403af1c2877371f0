"""Every benchmark in benchmarks/ in its CI-size CPU form (gloo): it exits 0 and prints its
table, with the rows that show the comparison ran. The GPU runs use the same code at size.

Each runs as its own process, forked from a server that imported torch once
(``helpers.forked``), as ``python benchmarks/x.py ...`` / ``gridtrain run ...`` would run it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import forked

REPO = Path(__file__).resolve().parents[1]


def _rows(out: str, *prefix: str) -> list[list[str]]:
    """Whitespace- or |-separated fields of the lines whose fields start with ``prefix``."""
    rows = []
    for line in out.splitlines():
        fields = line.replace("|", " ").split()
        if fields[: len(prefix)] == list(prefix):
            rows.append(fields)
    return rows


def _row(out: str, *prefix: str) -> list[str]:
    rows = _rows(out, *prefix)
    assert len(rows) == 1, f"want one row starting {prefix}, got {rows}\n{out}"
    return rows[0]


def _num(text: str) -> float:
    return float(text.replace(",", "").rstrip("M"))


def check_gpt(out):
    words = {"plain": 2, "engine": 1}  # the mode's words after the preset and size
    rows = {}
    for r in _rows(out, "tiny"):
        n = 3 if r[3] == "1d" else words[r[2]]
        rows[" ".join(r[2 : 2 + n])] = r[2 + n :]
    assert set(rows) == {"plain eager", "engine", "engine 1d tp=2"}, out  # mode -> row
    assert _num(rows["plain eager"][0]) > 0 and _num(rows["engine 1d tp=2"][0]) > 0  # tokens/s
    assert _num(rows["engine"][-1]) > 0  # engine / plain eager


def check_hf(out):
    rows = {
        " ".join(r[2:4] if r[2] == "plain" else r[2:3]): r for r in _rows(out, "GPT2LMHeadModel")
    }
    assert set(rows) == {"plain eager", "engine"}, out  # loop -> row
    assert _num(rows["plain eager"][4]) > 0  # tokens/s
    assert _num(rows["engine"][-1]) > 0  # engine / plain eager


def check_moe(out):
    dense = _row(out, "cpu", "dense")
    assert dense[-1] == "1.00"  # the reference column
    for model in ("grouped/auto", "capacity"):
        row = _row(out, "cpu", model)
        assert _num(row[4]) > 0 and _num(row[5]) > 0  # tokens/s, vs dense
        assert 0 <= float(row[6]) < 1  # dropped fraction


def check_moe_hf(out):
    for loop in ("plain", "engine"):
        assert _row(out, "cpu", "dense", loop)[-1] == "1.00"  # the reference column
        moe = _row(out, "cpu", "moe", loop)
        assert _num(moe[-2]) > 0 and _num(moe[-1]) > 0  # tokens/s, vs dense
        assert _num(moe[4]) < _num(moe[3])  # active < total parameters


def check_zero_memory(out):
    totals = {}
    for stage in range(4):
        row = _row(out, "2", str(stage))
        totals[stage] = float(row[5])
        assert float(row[-1]) == pytest.approx(1.0, abs=0.01)  # total / (paper + fp32 grad)
    assert totals[3] < totals[2] < totals[1] < totals[0]


def check_zero_throughput(out):
    assert float(_row(out, "plain")[2]) == 1.0
    for mode in ("zero1", "zero2"):
        assert float(_row(out, mode)[2]) > 0  # vs plain


def check_zero_largest(out):
    assert _row(out, "tiny")[2] == "trains"


def check_offload(out):
    for check in ("loss", "weight", "h2d", "d2h"):
        assert _row(out, check)[-1] == "yes", out  # parity, and bytes moved = the formula
    for check in ("loss", "h2d", "d2h"):  # bf16: near the float64 run, bf16 bytes = formula
        assert _row(out, "bf16", check)[-1] == "yes", out
    assert _row(out, "bf16", "d2h")[4] == "(0.50x", out  # half the bytes of an fp32 link


def _check_resnet(out, precisions):
    for precision in precisions:
        row = _row(out, precision)
        assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[3]) > 0  # img/s, ratio
        engine, plain = (float(v) for v in row[-1].split("/"))  # first-step losses
        assert engine == pytest.approx(plain, abs=0.01)


def check_resnet(out):
    _check_resnet(out, ("fp32", "torch_fp16", "naive_fp16", "bf16"))


def check_resnet_ddp(out):
    assert "batch 2 x 2 process(es)" in out
    _check_resnet(out, ("fp32",))


def check_pipeline(out):
    for v, name, theory in ((1, "1F1B", 0.2), (2, "interleaved", 0.111)):
        row = _row(out, "2", "4", str(v), name)
        assert float(row[4]) == pytest.approx(theory, abs=1e-3)
        assert 0 < float(row[5]) < 1  # measured idle fraction


def check_pipeline_single(out):
    assert float(_row(out, "4", "plain", "loop")[-1]) == 1.0
    assert float(_row(out, "4", "1F1B", "(p=1)")[-1]) > 0
    assert float(_row(out, "4", "interleaved", "v=2", "(p=1)")[-1]) > 0


def check_sequence(out):
    dense = _row(out, "dense-sdpa")
    online = _row(out, "seq", "2", "online")
    assert online[-1] == ">=512"  # fits the whole range within the budget
    assert float(online[-2]) < float(dense[-2])  # S=512: less per rank than one dense rank


def check_comm(out):
    row = _row(out, "2d", "4", "8x16x64")
    assert float(row[5]) == pytest.approx(1.0, abs=0.1)  # measured / paper


def check_checkpoint(out):
    for fmt in ("dense", "sharded", "async"):
        row = _row(out, "2", fmt)
        assert float(row[2]) >= 0 and float(row[-1]) > 0  # save s, MB on disk


def check_estimate(out):
    assert "Narayanan et al. 2021" in out and "Rajbhandari et al. 2020" in out
    assert float(_row(out, "1008.0B")[-1]) > 0  # ours / paper
    assert float(_row(out, "1024")[-1]) > 0  # ZeRO at N_d 1024
    assert float(_row(out, "gpt2-124m")[-1]) > 0  # estimated / measured


def check_largest(out):
    assert _row(out, "plain")[-2] == "8"  # trained batch
    assert _row(out, "engine", "chunked_loss")[-1] == "1.00"  # vs plain
    assert _row(out, "engine", "+", "recompute")[-1] == "1.00"


def check_fp8(out):
    rows = [r for r in _rows(out) if r and "-" in r[0] and r[0][0].isdigit()]
    assert len(rows) == 3, out  # steps 1-2, 3-4, 5-6
    for r in rows:
        assert abs(float(r[3])) < 0.5, r  # fp8 minus bf16 loss, a few steps in
    assert "fp8/bf16" in out


CASES = {
    "fp8_parity": (
        ["benchmarks/fp8_parity.py", "--device", "cpu", "--steps", "6", "--seq-len", "32"]
        + ["--eager"]
        + ["--window", "2"],
        check_fp8,
    ),
    "gpt_throughput": (
        ["benchmarks/gpt_throughput.py", "--device", "cpu", "--tp", "2"]
        # one round of one step per loop: the table's rows and ratios need no more
        + ["--steps", "1", "--warmup", "0", "--rounds", "1"],
        check_gpt,
    ),
    "hf_throughput": (
        ["benchmarks/hf_throughput.py", "--device", "cpu", "--steps", "2"],
        check_hf,
    ),
    "moe_throughput": (
        ["benchmarks/moe_throughput.py", "--device", "cpu", "--steps", "2", "--rounds", "1"]
        + ["--hidden", "64", "--depth", "2"],
        check_moe,
    ),
    "moe_throughput_mixtral": (
        ["benchmarks/moe_throughput.py", "--model", "mixtral", "--device", "cpu"]
        + ["--steps", "1", "--rounds", "1"],
        check_moe_hf,
    ),
    "zero_memory": (
        ["benchmarks/zero_memory.py", "--quick", "--ranks", "2"],
        check_zero_memory,
    ),
    "zero_memory_throughput": (
        ["benchmarks/zero_memory.py", "throughput", "--device", "cpu", "--vocab", "512"]
        + ["--batch-size", "1", "--seq-len", "16"]
        + ["--steps", "1", "--warmup", "0", "--rounds", "1", "--passes", "1"],  # rows, not speed
        check_zero_throughput,
    ),
    "offload_quick": (["benchmarks/offload.py", "--quick"], check_offload),
    "zero_memory_largest": (
        ["benchmarks/zero_memory.py", "largest", "--device", "cpu", "--sizes", "tiny"]
        + ["--vocab", "512"],
        check_zero_largest,
    ),
    "resnet_throughput": (
        ["benchmarks/resnet_throughput.py", "--batch", "2", "--steps", "1"] + ["--repeats", "1"],
        check_resnet,
    ),
    "resnet_throughput_ddp": (
        ["gridtrain", "run", "--nproc_per_node", "2"]
        + ["--config", "demos/resnet/configs/fp32.py", "benchmarks/resnet_throughput.py"]
        + ["--precisions", "fp32", "--batch", "2", "--steps", "1", "--repeats", "1"],
        check_resnet_ddp,
    ),
    "pipeline_bubble": (
        ["benchmarks/pipeline_bubble.py", "--cpu", "--stages", "2", "--microbatches", "4"]
        + ["--steps", "1", "--fwd_ms", "5"],
        check_pipeline,
    ),
    "pipeline_bubble_single": (
        ["benchmarks/pipeline_bubble.py", "--single", "--cpu", "--microbatches", "4"]
        + ["--rounds", "2", "--warmup", "1"],
        check_pipeline_single,
    ),
    "sequence_memory": (
        ["benchmarks/sequence_memory.py", "--sizes", "2", "--min-seq", "128"]
        + ["--max-seq", "512", "--budget-mb", "4"],
        check_sequence,
    ),
    "comm_volume": (
        ["benchmarks/comm_volume.py", "--sizes", "8x16x64", "--modes", "2d"],
        check_comm,
    ),
    "checkpoint_io": (
        ["benchmarks/checkpoint_io.py", "--quick", "--ranks", "2"],
        check_checkpoint,
    ),
    "estimate_vs_published": (
        ["benchmarks/estimate_vs_published.py"],
        check_estimate,
    ),
    "largest_batch": (
        ["benchmarks/largest_batch.py", "--device", "cpu", "--preset", "tiny"]
        + ["--seq-len", "64"],
        check_largest,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_benchmark_cpu_form(name):
    cmd, check = CASES[name]
    # the CPU forms, on GPU machines too; one thread a process, as torchrun gives each rank:
    # two threads spinning on 2 cores shared with other ranks or runs doubled the wall time
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out = forked.run(cmd, REPO, env, timeout=240)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    check(out.stdout)
