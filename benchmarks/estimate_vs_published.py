"""``gridtrain estimate`` beside published runs: Megatron-LM at up to 3072 A100s, the ZeRO paper's
memory figures, and our own GPT-2 step times on one H200.

    python benchmarks/estimate_vs_published.py              # print the three tables
    python benchmarks/estimate_vs_published.py --append     # and append them to RESULTS.md
    python benchmarks/estimate_vs_published.py --search-speed   # how long --search takes
    python benchmarks/estimate_vs_published.py --measure --out DIR   # GPU: measured vs estimated

No process, no GPU: every number on our side comes from ``gridtrain.estimate``; except with
``--measure`` (one GPU, < 4 minutes on an H200): each row runs one rank of its layout for real
(``gridtrain.estimate.measure``: the estimate's own model through ``gt.initialize``, the other
ranks a fake process group) and writes the measured step and memory beside the estimate to
``DIR/estimate_measured.md`` and ``.json``: GPT-2 124M and 350M at batch 16 x 1024 in bf16,
eager (``compile = False``) and with the device's speed defaults (compile, cuDNN attention,
fused AdamW), and one rank of four multi-rank layouts of GPT-2 350M (memory by category).

**Narayanan et al. 2021**, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC'21, arXiv:2104.04473), Table 1: GPT models with vocabulary
51,200 and sequence 2048 on Selene (DGX A100 80 GB, NVLink 3, 8 x 200 Gb/s HDR per node),
mixed precision with fp32 master weights (our ``naive``), activation recomputation, the
interleaved schedule; 2021's attention kept its scores (our ``attention="math"``) and
GPT dropout is 0.1. Megatron-LM then all-reduced the data-parallel gradients after the
backward pass (its DDP's ``allreduce_gradients()`` in ``train_step``; overlapping came with
``overlap_grad_reduce`` in 2023): our ``overlap_dp=False``, as a ``gradient_handler`` runs. Stages are cut with ``partition="parameters"``, as the paper's are:
"uniform" counts the embedding and the head as layers, so at 128 blocks over 64 stages
one stage would get 3 blocks and pace the pipeline at 2/3 of the speed. Their per-GPU throughput is model FLOPs by their Eq. 3,
``F = 96 B s l h^2 (1 + s/6h + V/16lh)`` per iteration (recompute included), over time and
GPUs; ours is the same F over our estimated step time. The table does not give the
micro-batch or the number of chunks: we take, for the paper's (t, p, d), the micro-batch
(1-8) and chunks (1, 2, 4) our estimate finds fastest, and say which. (Table values also
in the paper's text and in NVIDIA/Megatron-LM's README; layouts cross-checked with the
BigScience notes, e.g. 145.6B = 80 layers x 12288.)

**Rajbhandari et al. 2020**, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20, arXiv:1910.02054), Figure 1 and Table 1: per-device model-state memory of
mixed-precision Adam (K = 12) for a 7.5B model over N_d data-parallel ranks:
``(2 + 2 + K) Psi``, ``Pos`` ``4 Psi + K Psi / N_d``, ``Pos+g`` ``2 Psi + (2 + K) Psi / N_d``,
``Pos+g+p`` ``(2 + 2 + K) Psi / N_d`` (GB = 1e9 bytes). Ours: Megatron's 7.5B GPT
(36 x 4096, 32 heads) under naive fp16, ``zero = dict(stage=s)``; weights, gradients, fp32
masters and moments as ``parallel/zero`` holds them (stage 2 keeps the reduce-scattered
gradient rows in fp32, where the paper keeps fp16).

**One H200**: GPT-2 small/medium, batch 16 x 1024, bf16, from ``gpt_throughput.py``
(this folder's RESULTS.md, "GPT-2 throughput").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.estimate import (  # noqa: E402
    Scenario,
    SearchOptions,
    estimate,
    get_device,
    get_model,
    search,
)
from gridtrain.estimate.models import megatron_gpt  # noqa: E402
from gridtrain.estimate.scenario import EstimateError  # noqa: E402

# (params B, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU): Table 1 of the paper
MEGATRON = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# ZeRO paper, 7.5B, K = 12, GB per device: Figure 1 (N_d = 64) and Table 1 (N_d = 4, 16, 1024)
ZERO = {  # N_d: (baseline, Pos, Pos+g, Pos+g+p)
    4: (120, 52.5, 41.3, 30),
    16: (120, 35.6, 21.6, 7.5),
    64: (120, 31.4, 16.6, 1.88),
    1024: (120, 30.1, 15.1, 0.12),
}
# gpt_throughput.py on one H200 (RESULTS.md): preset -> engine tokens/s, MFU
H200 = {"gpt2-124m": (350_819, 0.303), "gpt2-350m": (149_801, 0.367)}


def megatron_flops(b: int, s: int, layers: int, h: int, vocab: int) -> float:
    """Eq. 3 of Narayanan et al.: FLOPs of one iteration with activation recomputation."""
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def megatron_rows() -> list[tuple]:
    device = get_device("a100-80g")
    rows = []
    for params, heads, hidden, layers, t, p, n, batch, theirs in MEGATRON:
        spec = dataclasses.replace(megatron_gpt(layers, hidden, heads), dropout=0.1)
        d = n // (t * p)
        best = None
        for b in (1, 2, 4, 8):
            if (batch // d) % b:
                continue
            m = batch // (d * b)
            for v in (1, 2, 4) if p > 1 else (1,):
                if v > 1 and (m % p or layers + 2 < p * v):
                    continue
                sc = Scenario(
                    world=n, pipeline=p, tensor=t, mode="1d" if t > 1 else None, chunks=v,
                    micro_batch=b, pipeline_micro=m if p > 1 else 1,
                    accumulation=1 if p > 1 else m, amp="naive", recompute="full",
                    attention="math", partition="parameters", overlap_dp=False,
                )  # fmt: skip
                try:
                    est = estimate(spec, sc, device)
                except EstimateError:
                    continue
                if est.fits and (best is None or est.step_s < best.step_s):
                    best = est
        if best is None:
            rows.append((params, t, p, d, batch, None, None, None, theirs, None, None))
            continue
        sc = best.scenario
        ours = megatron_flops(batch, 2048, layers, hidden, 51200) / best.step_s / n / 1e12
        rows.append((params, t, p, d, batch, sc.micro_batch, sc.chunks, best.memory / 2**30,
                     theirs, ours, best.step_s))  # fmt: skip
    return rows


def zero_rows() -> list[tuple]:
    spec = megatron_gpt(36, 4096, 32)
    device = get_device("a100-80g")
    rows = []
    for nd, paper in ZERO.items():
        ours = []
        for stage in (0, 1, 2, 3):
            sc = Scenario(world=nd, amp="naive", zero=stage)
            st = estimate(spec, sc, device).stages[0].states
            ours.append(st.resident / 1e9)
        rows.append((nd, paper, ours))
    return rows, spec.num_params()


def h200_rows() -> list[tuple]:
    device = get_device("h200-141g")
    rows = []
    for name, (tokens, mfu) in H200.items():
        spec = dataclasses.replace(get_model(name), dropout=0.0)  # the demo GPT has none
        est = estimate(spec, Scenario(world=1, micro_batch=16, amp="bf16"), device)
        measured_step = 16 * 1024 / tokens
        rows.append((name, measured_step, est.step_s, tokens, est.tokens_per_s, mfu, est.mfu))
    return rows


def tables() -> str:
    out = ["### Narayanan et al. 2021, Table 1 (Megatron-LM, A100 80 GB, fp16 + fp32 masters, "
           "full recompute)", "",
           "| params | t | p | d | batch | micro-batch (ours) | chunks (ours) | GiB/GPU (ours) | "
           "TFLOP/s per GPU (paper) | TFLOP/s per GPU (ours) | ours / paper |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for params, t, p, d, batch, b, v, gib, theirs, ours, _ in megatron_rows():
        if ours is None:
            out.append(f"| {params}B | {t} | {p} | {d} | {batch} | - | - | does not fit | "
                       f"{theirs} | - | - |")  # fmt: skip
            continue
        out.append(f"| {params}B | {t} | {p} | {d} | {batch} | {b} | {v} | {gib:.1f} | {theirs} | "
                   f"{ours:.0f} | {ours / theirs:.2f} |")  # fmt: skip
    zrows, psi = zero_rows()
    out += ["", f"### Rajbhandari et al. 2020 (ZeRO), Figure 1 / Table 1: 7.5B model-state GB "
            f"per device (ours: Megatron's 7.5B GPT, {psi / 1e9:.2f}B parameters, naive fp16)", "",
            "| N_d | baseline paper / ours | Pos paper / ours | Pos+g paper / ours | "
            "Pos+g+p paper / ours | ratios (ours / paper) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for nd, paper, ours in zrows:
        cells = " | ".join(f"{a:g} / {b:.2f}" for a, b in zip(paper, ours))
        ratios = " ".join(f"{b / a:.2f}" for a, b in zip(paper, ours))
        out.append(f"| {nd} | {cells} | {ratios} |")
    out += ["", "### One H200, GPT-2 (measured: `gpt_throughput.py`, batch 16 x 1024, bf16)", "",
            "| preset | measured step | estimated step | measured tokens/s | estimated tokens/s | "
            "measured MFU | estimated MFU | estimated / measured time |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, m_step, e_step, m_tok, e_tok, m_mfu, e_mfu in h200_rows():
        out.append(f"| {name} | {m_step * 1e3:.1f} ms | {e_step * 1e3:.1f} ms | {m_tok:,} | "
                   f"{e_tok:,.0f} | {m_mfu:.1%} | {e_mfu:.1%} | {e_step / m_step:.2f} |")  # fmt: skip
    return "\n".join(out)


SECTION = """
## `gridtrain estimate` beside published runs (`estimate_vs_published.py`)

No process and no GPU: every number on our side is `gridtrain.estimate`'s (the engine's own
tensor plan on a process-free layout context, the per-mode activation inventory and
collectives, an alpha-beta model of NVLink and the network). Sources, and how each of our
numbers is made, in the script's docstring.

{tables}
"""


SEARCHES = [("gpt3-13b", 512, 1024), ("gpt3-175b", 1024, 1024), ("gpt3-175b", 4096, 2048)]


def search_speed() -> str:
    """Wall and CPU seconds of ``--search`` (bf16, full recompute, H100) at growing world
    sizes, and how many layouts it weighed, estimated and pruned: speed is measured here,
    never asserted in a test (tests count the estimated layouts instead)."""
    out = ["| model | GPUs | global batch | layouts | estimated | pruned | fit | wall s | CPU s |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, world, batch in SEARCHES:
        spec, device = get_model(name), get_device("h100-80g")
        base = Scenario(world=world, amp="bf16", recompute="full")
        r = search(spec, device, world, batch, base, SearchOptions())
        out.append(f"| {name} | {world} | {batch} | {r.considered} | {r.estimated} | {r.pruned} "
                   f"| {len(r.ranked)} | {r.seconds:.2f} | {r.cpu_seconds:.2f} |")  # fmt: skip
    return "\n".join(out)


# (name, preset, world, config): the rows of --measure
MEASURED = [
    ("gpt2-124m eager", "gpt2-124m", 1, {"compile": False}),
    ("gpt2-124m default", "gpt2-124m", 1, {}),
    ("gpt2-350m eager", "gpt2-350m", 1, {"compile": False}),
    ("gpt2-350m default", "gpt2-350m", 1, {}),
    ("gpt2-350m dp8 zero3 acc2", "gpt2-350m", 8,
     {"compile": False, "zero": {"stage": 3}, "gradient_accumulation": 2}),
    ("gpt2-350m dp8 zero2 acc2", "gpt2-350m", 8,
     {"compile": False, "zero": {"stage": 2}, "gradient_accumulation": 2}),
    ("gpt2-350m 1d4 x dp2", "gpt2-350m", 8,
     {"compile": False, "parallel": {"tensor": {"size": 4, "mode": "1d"}}}),
    ("gpt2-350m pp2 m8 zero1", "gpt2-350m", 8,
     {"compile": False, "parallel": {"pipeline": 2}, "num_microbatches": 8, "zero": {"stage": 1}}),
]  # fmt: skip


def measured_rows(out_dir: Path) -> str:
    """Run every ``MEASURED`` row's rank on this GPU; the table, also written to ``out_dir``."""
    from gridtrain.config import Config
    from gridtrain.estimate.measure import compute_s, measure

    device = get_device("h200-141g")
    head = ["| layout | est. compute ms | measured ms | ratio | est. GiB | measured GiB (alloc) | "
            "ratio | params / grads / optim / acts GiB, est. / measured |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    rows, records, text = list(head), [], ""
    for name, preset, world, extra in MEASURED:
        cfg = Config.from_dict({"fp16": {"mode": "bf16"}, **extra})
        spec = dataclasses.replace(get_model(preset), dropout=0.0)
        sc = Scenario.from_config(cfg, world, micro_batch=16 if world == 1 else 4)
        est = estimate(spec, sc, device)
        try:
            m = measure(est, cfg, steps=10, warmup=3)
        except Exception as err:  # noqa: BLE001 - one failing row must not lose the others
            rows.append(f"| {name} | failed: {type(err).__name__}: {err} |")
            print(rows[-1], flush=True)
            continue
        st, cats = est.worst.states.device, m.categories
        want = (st["parameters"], st["gradients"], st["optimizer_state"],
                est.worst.activations.in_flight)  # fmt: skip
        got = (cats.get("parameters", 0), cats.get("gradients", 0),
               cats.get("optimizer_state", 0), cats.get("activations", 0))  # fmt: skip
        gib = 2**30
        by = " ".join(f"{a / gib:.2f}/{b / gib:.2f}" for a, b in zip(want, got))
        e_ms, e_mem = compute_s(est) * 1e3, est.memory - est.reserved
        rows.append(f"| {name} | {e_ms:.1f} | {m.step_s * 1e3:.1f} | {m.step_s * 1e3 / e_ms:.2f} | "
                    f"{e_mem / gib:.2f} | {m.peak_allocated / gib:.2f} | "
                    f"{m.peak_allocated / e_mem:.2f} | {by} |")  # fmt: skip
        records.append({"name": name, "world": world, "config": extra, "estimated_s": e_ms / 1e3,
                        "measured_s": m.step_s, "estimated_bytes": e_mem,
                        "peak_allocated": m.peak_allocated, "peak_reserved": m.peak_reserved,
                        "skipped": m.skipped, "estimated": dict(st, activations=want[3]),
                        "measured": cats})  # fmt: skip
        print(rows[-1], flush=True)
        text = _write(out_dir, rows, records)  # after every row: a later failure loses nothing
    return text


def _write(out_dir: Path, rows: list[str], records: list[dict]) -> str:
    import json

    import torch

    text = f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n" + "\n".join(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "estimate_measured.md").write_text(text + "\n")
    (out_dir / "estimate_measured.json").write_text(json.dumps(records, indent=1))
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--append", action="store_true", help="append the tables to RESULTS.md")
    parser.add_argument("--search-speed", action="store_true", help="time --search instead")
    parser.add_argument("--measure", action="store_true", help="GPU: measured vs estimated")
    parser.add_argument("--out", default=".", help="--measure: where its tables go")
    args = parser.parse_args(argv)
    if args.measure:
        print(measured_rows(Path(args.out)))
        return
    if args.search_speed:
        print(search_speed())
        return
    text = tables()
    print(text)
    if args.append:
        path = Path(__file__).with_name("RESULTS.md")
        with path.open("a") as f:
            f.write(SECTION.format(tables=text))
        print(f"\nappended to {path}")


if __name__ == "__main__":
    main()
