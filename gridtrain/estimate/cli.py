"""``gridtrain estimate``: memory, communication and step time of a layout, or ``--search`` for one.

    gridtrain estimate --config config.py --model llama-70b --world-size 1024 --gpu h100-80g \\
        --global-batch 512
    gridtrain estimate --config config.py --model path/to/config.json --world-size 4096 \\
        --gpu h200-141g --global-batch 2048 --search

Wired into ``gridtrain/cli/main.py`` with ``add_parser(sub)``; ``run(args)`` returns the
exit code: 0, 1 when the layout does not fit in memory (or nothing fits, with
``--search``), 2 when the layout cannot run the model at all (the message names
the group and the divisor).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from gridtrain.config import Config, ConfigError
from gridtrain.estimate.config_keys import base_of
from gridtrain.estimate.devices import DeviceError, GiB, get_device
from gridtrain.estimate.estimator import estimate
from gridtrain.estimate.measure import NO_GPU, format_measured, measure
from gridtrain.estimate.model_files import get_model
from gridtrain.estimate.models import PRESETS, ModelError
from gridtrain.estimate.report import does_not_fit, dumps, format_estimate
from gridtrain.estimate.scenario import EstimateError, Scenario
from gridtrain.estimate.search import SearchOptions, format_search, search
from gridtrain.parallel.tensor.modes import mode_names


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``estimate`` sub-command to ``gridtrain``'s sub-parsers."""
    p = subparsers.add_parser(
        "estimate",
        help="per-rank memory, communication and step time of a layout (or --search for one)",
        description="Estimate per-rank memory (parameters, gradients, optimizer states, "
        "activations), per-step communication per group and the step time / MFU of a model "
        "trained under a config's layout at --world-size ranks, without any process or GPU. "
        "--search ranks every layout that fits instead.",
    )
    p.add_argument("--config", help="gridtrain config (.py, .yaml or .yml); precision, layout")
    p.add_argument(
        "--model",
        required=True,
        help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face config.json",
    )
    p.add_argument("--world-size", "--world_size", type=int, required=True, metavar="N")
    p.add_argument(
        "--gpu", default="h100-80g", help="device preset: h100-80g, h200-141g, a100-80g, cpu"
    )
    p.add_argument("--global-batch", type=int, metavar="B", help="sequences per step (default: the "
                   "config's GLOBAL_BATCH_SIZE, else one micro-batch of 1 per data-parallel rank)")  # fmt: skip
    p.add_argument("--micro-batch", type=int, metavar="b", help="sequences per micro-batch")
    p.add_argument(
        "--seq-len", type=int, metavar="S", help="sequence length (default: the model's)"
    )
    p.add_argument(
        "--pad-vocab",
        type=int,
        metavar="K",
        help="round the vocabulary up to a multiple of K (Megatron's "
        "make-vocab-size-divisible-by), so that it splits over tensor groups",
    )
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default: config's)")
    p.add_argument(
        "--offload",
        action="store_true",
        help="ZeRO optimizer states (stage 3: everything) on the host",
    )
    p.add_argument("--recompute", choices=("none", "full"),
                   help="activation checkpointing of every block (default: the config's "
                   "activation_checkpoint, which gridtrain runs; this overrides it)")  # fmt: skip
    p.add_argument("--attention", choices=("flash", "math"),
                   help="fused SDPA kernels or unfused attention keeping the scores (default: "
                   "the config's attention.backends, fused unless math comes first)")  # fmt: skip
    _add_device_and_search_args(p)
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--measure", action="store_true",
                   help="also run one rank of the layout (with --search: the best pick) on this "
                   "machine's GPU, the other ranks a fake process group (no communication); "
                   "print its compute time and peak memory beside the estimate")  # fmt: skip
    p.set_defaults(handler=run, parser=p)
    return p


def _add_device_and_search_args(p: argparse.ArgumentParser) -> None:
    """The device overrides and the --search options of ``estimate``."""
    dev = p.add_argument_group("device overrides")
    dev.add_argument("--peak-tflops", type=float, help="dense bf16 peak TFLOP/s")
    dev.add_argument("--memory-gb", type=float, help="memory per device, GiB")
    dev.add_argument("--nvlink-gbps", type=float, help="intra-node GB/s per GPU, one direction")
    dev.add_argument("--internode-gbps", type=float, help="inter-node GB/s per GPU, one direction")
    dev.add_argument("--gpus-per-node", type=int)
    dev.add_argument("--efficiency", type=float, help="fraction of peak large GEMMs reach")
    s = p.add_argument_group("search")
    s.add_argument("--search", action="store_true", help="rank every layout that fits")
    s.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    s.add_argument("--modes", default=",".join(["none", *mode_names()]), help="tensor modes to try")
    s.add_argument("--headroom", type=float, default=0.10, metavar="F",
                   help="share of device memory a pick leaves free (default 0.10)")  # fmt: skip


def _device(args):
    gb = 1e9
    return get_device(
        args.gpu,
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
        memory=args.memory_gb * GiB if args.memory_gb else None,
        nvlink=args.nvlink_gbps * gb if args.nvlink_gbps else None,
        internode=args.internode_gbps * gb if args.internode_gbps else None,
        gpus_per_node=args.gpus_per_node,
        efficiency=args.efficiency,
    )


def _config(path: str | None) -> Config:
    if path is None:
        return Config()
    try:
        return Config.from_file(path)
    except ConfigError as err:
        raise ConfigError(f"--config {path}: {err}") from None


def run(args: argparse.Namespace) -> int:
    """Run ``gridtrain estimate``; returns the exit code (see the module docstring)."""
    try:
        if args.measure and not torch.cuda.is_available():
            raise EstimateError(NO_GPU)
        cfg = _config(args.config)
        spec = get_model(args.model, args.seq_len)
        if args.pad_vocab:
            spec = dataclasses.replace(
                spec, vocab=-(-spec.vocab // args.pad_vocab) * args.pad_vocab
            )
        device = _device(args)
        if args.search:
            return _search(args, cfg, spec, device)
        sc = Scenario.from_config(
            cfg,
            args.world_size,
            global_batch=args.global_batch,
            micro_batch=args.micro_batch,
            zero=args.zero,
            offload=args.offload or None,
            recompute=args.recompute,
            attention=args.attention,
        )
        est = estimate(spec, sc, device)
    except (EstimateError, ModelError, DeviceError, ConfigError) as err:
        print(f"gridtrain estimate: error: {err}", file=sys.stderr)
        return 2
    print(dumps(est) if args.json else format_estimate(est))
    if args.measure:
        print("\n" + format_measured(est, measure(est, cfg)))
    if not est.fits:
        print(f"\n{does_not_fit(est)}", file=sys.stderr if args.json else sys.stdout)
        return 1
    return 0


def _search(args, cfg: Config, spec, device) -> int:
    batch = args.global_batch or cfg.user_constants().get("GLOBAL_BATCH_SIZE")
    if batch is None:
        raise EstimateError("--search needs --global-batch (or GLOBAL_BATCH_SIZE in the config)")
    if not 0 <= args.headroom < 1:
        raise EstimateError(f"--headroom must be in [0, 1), got {args.headroom}")
    base = base_of(cfg, args.world_size, recompute=args.recompute, attention=args.attention)
    options = SearchOptions(
        modes=tuple(None if m == "none" else m for m in args.modes.split(",")),
        top=args.top,
        headroom=args.headroom,
    )
    result = search(spec, device, args.world_size, batch, base, options)
    print(format_search(result))
    if args.measure and result.ranked:
        print("\n" + format_measured(result.ranked[0], measure(result.ranked[0], cfg)))
    return 0 if result.ranked else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m gridtrain.estimate.cli ...``: the sub-command on its own."""
    parser = argparse.ArgumentParser(prog="gridtrain")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["estimate", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
