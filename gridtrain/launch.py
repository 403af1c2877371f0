"""Starting and ending a process: validate the config, join the process group, build the
context, seed; ``destroy`` undoes it, first running what was registered with
``register_teardown``."""

from __future__ import annotations

import atexit
import gc
import ipaddress
import logging
import math
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gridtrain import children, failure_record
from gridtrain.config import CONFIG_ENV, MAX_SEED, MAX_TIMEOUT_S, Config, ConfigError, quote
from gridtrain.parallel.context import ParallelContext, set_context
from gridtrain.parallel.gloo_threads import wait_for_idle_workers
from gridtrain.parallel.random import seed_everything
from gridtrain.parallel.staged_backend import NAME as STAGED
from gridtrain.parallel.staged_backend import (
    ensure_registered,
    pick_backend,
    ranks_per_gpu_notice,
)

logger = logging.getLogger("gridtrain")

BACKENDS = ("nccl", "gloo", "mpi", STAGED)

ConfigLike = Config | dict | str | Path
_TEARDOWN: list[Callable[[], None]] = []


def launch(
    config: ConfigLike,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int = 1024,
    timeout_s: float | None = None,
) -> ParallelContext:
    """Join the process group, build every parallel group, seed, and return the context.

    The config is validated (including every world-size check) before any
    process group is created, so a bad layout fails here on every rank instead
    of hanging. ``backend=None`` picks nccl when CUDA is there with a GPU per rank of this
    machine, ``"staged"`` when its ranks outnumber its GPUs (they share them, collectives
    through gloo in host memory: ``gridtrain.parallel.staged_backend``), else gloo.
    ``timeout_s`` (default: the config's ``timeout_s``, 600) bounds every
    collective of every group: a rank left waiting for a stuck peer raises after it.
    """
    cfg = _with_arguments(Config.load(config), timeout_s, seed)
    cfg.check_world_size(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    backend, device = _backend_and_device(backend, rank, world_size, host, local_rank)

    timeout = timedelta(seconds=cfg.timeout_s)
    store = _rendezvous_store(host, port, rank, world_size, timeout)
    dist.init_process_group(
        backend,
        init_method=None if store is not None else f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        store=store,
    )
    if not getattr(launch, "exit_wait", False):  # a script that never calls destroy() too
        launch.exit_wait = True
        atexit.register(wait_for_idle_workers)
    seed = cfg.seed if cfg.seed is not None else seed
    seed_everything(seed)
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    torch.backends.cudnn.deterministic = cfg.cudnn_deterministic
    ctx = ParallelContext(cfg, device, seed)
    set_context(ctx)
    if rank == 0:
        logger.info("launched %r", ctx)
    return ctx


def _backend_and_device(
    backend: str | None, rank: int, world_size: int, host: str, local_rank: int | None
) -> tuple[str, torch.device]:
    """The backend (``pick_backend``) and this rank's device: its GPU under nccl and
    ``"staged"`` (shared by several ranks there), else the CPU."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which this machine lacks; use backend='gloo'")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = _local_world_size(world_size, host)
    backend = pick_backend(backend, local_world, gpus)
    device = torch.device("cpu")
    if backend in ("nccl", STAGED) and gpus:
        local_rank = rank % gpus if local_rank is None else local_rank
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
    if backend == STAGED:
        ensure_registered()
        if gpus and local_world is not None and local_world > gpus and local_rank == 0:
            logger.warning("%s", ranks_per_gpu_notice(local_world, gpus))
    return backend, device


def _local_world_size(world_size: int, host: str) -> int | None:
    """Ranks on this machine: torchrun's LOCAL_WORLD_SIZE, else all of them where they
    meet on loopback; None where unknown."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return world_size if is_loopback(host) else None


def _with_arguments(cfg: Config, timeout_s: float | None, seed: int) -> Config:
    """``cfg`` with ``launch()``'s ``timeout_s`` (the groups use it too), both arguments held
    to the config's bounds."""
    if cfg.seed is None and (type(seed) is not int or not 0 <= seed <= MAX_SEED):
        raise ConfigError(f"launch: seed must be an int in [0, 2**63 - 1], got {quote(seed)}")
    if timeout_s is None:
        return cfg
    if isinstance(timeout_s, bool) or not (
        isinstance(timeout_s, int | float)
        and math.isfinite(timeout_s)
        and 0 < timeout_s <= MAX_TIMEOUT_S
    ):
        raise ConfigError(
            f"launch: timeout_s must be a number > 0 and <= {MAX_TIMEOUT_S:g} (c10d counts "
            f"int64 nanoseconds), got {quote(timeout_s)}"
        )
    return cfg.model_copy(update={"timeout_s": float(timeout_s)})


def _rendezvous_store(
    host: str, port: int, rank: int, world_size: int, timeout: timedelta
) -> dist.Store | None:
    """The store the ranks meet in, or None for torch's own ``tcp://`` rendezvous at host:port.

    - Under torch's elastic agent serving at host:port: a client of the agent's
      store, under a prefix per restart. The agent keeps its store across
      restarts, so without it a restarted rank could read a dead rank's address
      from the previous attempt ("Gloo connectFullMesh failed ... Connection refused").
    - Every rank on this machine (a loopback ``host``): rank 0 hosts the store on
      loopback only. torch's TCPStore server listens on every interface whatever
      ``host`` says, so rank 0 binds the socket itself and hands it over
      (``master_listen_fd``). ``gridtrain run`` does the same for the agent's store
      (``gridtrain.cli.agent``).
    - One process: a store in memory.
    """
    agent = (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("MASTER_ADDR") == host
        and os.environ.get("MASTER_PORT") == str(port)
    )
    if agent:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        client = dist.TCPStore(host, port, world_size, False, timeout)
        return dist.PrefixStore(f"gridtrain/attempt_{attempt}", client)
    if world_size == 1:
        return dist.HashStore()  # nobody to meet: no port to bind (``python train.py``)
    if not is_loopback(host):
        return None
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    return dist.TCPStore(
        host, port, world_size, True, timeout, master_listen_fd=bind_loopback(host, port)
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_loopback(host: str, port: int) -> int:
    """A socket listening on ``host``:``port`` (a loopback address); returns its file descriptor,
    which the caller owns (a TCPStore given ``master_listen_fd`` takes it over)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = "127.0.0.1" if host == "localhost" else host
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise RuntimeError(f"cannot listen on {addr}:{port} for the rendezvous: {err}") from None
    return sock.detach()


def bound_port(fd: int) -> int:
    """The port of the listening socket ``fd`` (``bind_loopback`` with port 0 picks one)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()


def _env_int(*names: str) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    raise RuntimeError(f"environment variable {' or '.join(names)} is not set")


DEFAULTS_NOTICE = (
    "no config given (neither config=... nor `gridtrain run --config FILE`, which sets "
    f"{CONFIG_ENV}): running with the defaults, data parallelism over every process"
)


def _config_from_env(config: ConfigLike | None, rank: int) -> ConfigLike:
    if config is not None:
        return config
    if CONFIG_ENV in os.environ:
        return os.environ[CONFIG_ENV]
    if rank == 0:  # said once per job
        logger.warning("%s", DEFAULTS_NOTICE)
    return Config()


def _torch_env() -> tuple[int, int, str, int, int]:
    """(rank, world size, master address, port, local rank) as torchrun set them; one process
    on loopback where none of them is set (``python train.py``: its store is in memory)."""
    if not any(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_PORT")):
        return 0, 1, "127.0.0.1", 0, 0
    return (
        _env_int("RANK"),
        _env_int("WORLD_SIZE"),
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        _env_int("MASTER_PORT"),
        _env_int("LOCAL_RANK"),
    )


def launch_from_torch(
    config: ConfigLike | None = None,
    seed: int = 1024,
    backend: str | None = None,
    timeout_s: float | None = None,
) -> ParallelContext:
    """Launch from the variables torchrun / ``gridtrain run`` set (RANK, WORLD_SIZE, ...).

    With ``config=None`` the path given to ``gridtrain run --config`` is used; without one
    either, the defaults (``Config()``), said once. Started as ``python train.py`` (no RANK,
    WORLD_SIZE or MASTER_PORT) it is one process.
    ``timeout_s`` defaults to the config's. ``gridtrain.failure_record`` says what a
    failing or stuck rank prints.
    """
    failure_record.install()
    children.install()  # its DataLoader workers die with it, as it dies with the launcher
    rank, world_size, host, port, local_rank = _torch_env()
    return launch(
        _config_from_env(config, rank),
        rank=rank,
        world_size=world_size,
        host=host,
        port=port,
        backend=backend,
        local_rank=local_rank,
        seed=seed,
        timeout_s=timeout_s,
    )


def launch_from_slurm(
    config: ConfigLike, host: str, port: int, backend: str | None = None, seed: int = 1024
) -> ParallelContext:
    """Launch from SLURM's variables (SLURM_PROCID, SLURM_NPROCS, SLURM_LOCALID)."""
    local = _env_int("SLURM_LOCALID") if "SLURM_LOCALID" in os.environ else None
    rank, world = _env_int("SLURM_PROCID"), _env_int("SLURM_NPROCS", "SLURM_NTASKS")
    return launch(config, rank, world, host, port, backend, local_rank=local, seed=seed)


def launch_from_openmpi(
    config: ConfigLike, host: str, port: int, backend: str | None = None, seed: int = 1024
) -> ParallelContext:
    """Launch from Open MPI's variables (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK)."""
    local = _env_int("OMPI_COMM_WORLD_LOCAL_RANK")
    rank, world = _env_int("OMPI_COMM_WORLD_RANK"), _env_int("OMPI_COMM_WORLD_SIZE")
    return launch(config, rank, world, host, port, backend, local_rank=local, seed=seed)


# ---- the end ----------------------------------------------------------------------------------
def register_teardown(fn: Callable[[], None]) -> Callable[[], None]:
    """Have ``destroy()`` call ``fn`` before it destroys the process groups (work that still
    uses them, such as an asynchronous checkpoint save, finishes first). Registering the same
    function again does nothing; returns ``fn``."""
    if fn not in _TEARDOWN:
        _TEARDOWN.append(fn)
    return fn


def destroy() -> None:
    """Run the registered teardowns, destroy every process group and forget the current
    context; return once torch's gloo worker threads are idle (see ``gloo_threads``: a busy
    one can abort the interpreter's shutdown)."""
    for fn in list(_TEARDOWN):
        fn()
    set_context(None)
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups held only by reference cycles go now, which joins their workers
    wait_for_idle_workers()
