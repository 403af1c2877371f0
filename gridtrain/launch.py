"""Starting a process: validate the config, join the process group, build the context, seed."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gridtrain.config import Config, ConfigError
from gridtrain.parallel.context import ParallelContext, set_context
from gridtrain.parallel.random import seed_everything

logger = logging.getLogger("gridtrain")

CONFIG_ENV = "GRIDTRAIN_CONFIG"  # set by `gridtrain run --config`
BACKENDS = ("nccl", "gloo", "mpi")

ConfigLike = Config | dict | str | Path


def launch(
    config: ConfigLike,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int = 1024,
    timeout_s: float = 1800.0,
) -> ParallelContext:
    """Join the process group, build every parallel group, seed, and return the context.

    The config is validated (including every world-size check) before any
    process group is created, so a bad layout fails here on every rank instead
    of hanging. ``backend=None`` picks nccl when CUDA is there, else gloo.
    """
    cfg = Config.load(config)
    cfg.check_world_size(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which this machine lacks; use backend='gloo'")

    if backend == "nccl":
        local_rank = rank % torch.cuda.device_count() if local_rank is None else local_rank
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    seed = cfg.seed if cfg.seed is not None else seed
    seed_everything(seed)
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    torch.backends.cudnn.deterministic = cfg.cudnn_deterministic
    ctx = ParallelContext(cfg, device, seed)
    set_context(ctx)
    if rank == 0:
        logger.info("launched %r", ctx)
    return ctx


def _env_int(*names: str) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    raise RuntimeError(f"environment variable {' or '.join(names)} is not set")


def _config_from_env(config: ConfigLike | None) -> ConfigLike:
    if config is not None:
        return config
    if CONFIG_ENV not in os.environ:
        raise ConfigError(
            f"no config given: pass config=... or start through `gridtrain run --config FILE` "
            f"(which sets {CONFIG_ENV})"
        )
    return os.environ[CONFIG_ENV]


def launch_from_torch(
    config: ConfigLike | None = None, seed: int = 1024, backend: str | None = None
) -> ParallelContext:
    """Launch from the variables torchrun / ``gridtrain run`` set (RANK, WORLD_SIZE, ...).

    With ``config=None`` the path given to ``gridtrain run --config`` is used.
    """
    return launch(
        _config_from_env(config),
        rank=_env_int("RANK"),
        world_size=_env_int("WORLD_SIZE"),
        host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        port=_env_int("MASTER_PORT"),
        backend=backend,
        local_rank=_env_int("LOCAL_RANK"),
        seed=seed,
    )


def launch_from_slurm(
    config: ConfigLike, host: str, port: int, backend: str | None = None, seed: int = 1024
) -> ParallelContext:
    """Launch from SLURM's variables (SLURM_PROCID, SLURM_NPROCS, SLURM_LOCALID)."""
    return launch(
        config,
        rank=_env_int("SLURM_PROCID"),
        world_size=_env_int("SLURM_NPROCS", "SLURM_NTASKS"),
        host=host,
        port=port,
        backend=backend,
        local_rank=_env_int("SLURM_LOCALID") if "SLURM_LOCALID" in os.environ else None,
        seed=seed,
    )


def launch_from_openmpi(
    config: ConfigLike, host: str, port: int, backend: str | None = None, seed: int = 1024
) -> ParallelContext:
    """Launch from Open MPI's variables (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK)."""
    return launch(
        config,
        rank=_env_int("OMPI_COMM_WORLD_RANK"),
        world_size=_env_int("OMPI_COMM_WORLD_SIZE"),
        host=host,
        port=port,
        backend=backend,
        local_rank=_env_int("OMPI_COMM_WORLD_LOCAL_RANK"),
        seed=seed,
    )
