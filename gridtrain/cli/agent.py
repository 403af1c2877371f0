"""``python -m gridtrain.cli.agent ARGS``: torch's elastic launcher (``torch.distributed.run ARGS``)
with these changes.

- The rendezvous store listens on loopback only when the whole job is on this machine.
  torch's TCPStore server listens on every interface whatever ``--master_addr`` says. For a
  single-node job with a loopback ``--master_addr`` (what ``gridtrain run`` passes for a local
  run) this binds the store's socket to that address first and hands it to a multi-tenant
  TCPStore; torch's static rendezvous then finds that server for the port and uses it.
- Workers are forked from a server that imported torch and gridtrain once (``cli/prefork``),
  not started as fresh interpreters; a command that cannot be forked is started through
  ``procs.die_with_parent``: the workers live in sessions of their own (torch's choice), so
  without it they would outlive an agent killed by SIGKILL.
- A failed job ends with ``failures.summarize`` (the first error once, one line per
  other rank, the rank that never arrived in a hang) instead of torch's per-rank failure
  table; the worker processes' own bookkeeping goes in a temporary report directory. A
  signal passed on by ``gridtrain run`` ends it with one line, not torch's traceback.
- Workers are stopped by ``_stop_workers``: a Ctrl-C reaches them as SIGTERM (prompt and
  quiet). A stopped (SIGSTOP) worker is resumed to take it, and one the launcher has to kill
  is noted as such (``unresponsive.close_workers``), so the report does not say "killed by
  SIGKILL".
- Port 0 (``gridtrain run`` on one machine): the store binds a free port and keeps it.
- ``OPTIONS -- SCRIPT ARGS`` (how ``gridtrain run`` calls it): only ``OPTIONS SCRIPT`` is
  parsed, ARGS go to the script untouched (torchrun would read ``--d 256`` as its own).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api
from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from gridtrain.cli import failures, prefork
from gridtrain.cli.argv import after_separator
from gridtrain.cli.procs import die_with_parent
from gridtrain.cli.unresponsive import close_workers
from gridtrain.failure_record import REPORT_DIR
from gridtrain.launch import bind_loopback, bound_port, is_loopback

_KEEP: list[object] = []  # the pre-bound store must outlive the rendezvous (a weak cache)


def bind_store_to_loopback(args) -> bool:
    """Host the agent's store on loopback if ``args`` (torchrun's, parsed) is a one-node run
    on a loopback address; returns whether it did. Port 0: a free one, written back into
    ``args`` (the workers' MASTER_PORT)."""
    local = str(args.nnodes) in ("1", "1:1") and args.rdzv_backend == "static"
    if args.standalone or not local or not is_loopback(args.master_addr):
        return False
    fd = bind_loopback(args.master_addr, args.master_port)
    if args.master_port == 0:  # gridtrain run's "any free port": the one just bound
        args.master_port = bound_port(fd)
    _KEEP.append(
        dist.TCPStore(
            args.master_addr,
            args.master_port,
            None,
            True,
            timedelta(seconds=60),
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=fd,
        )
    )
    return True


def _stop_workers(shutdown):
    """``LocalElasticAgent._shutdown``, a SIGINT passed on by ``gridtrain run`` (Ctrl-C)
    sent to the workers as SIGTERM: a worker inside a C++ call (a rendezvous, a collective)
    sees SIGINT only when the call returns (it took 31.8 s, until torch's SIGKILL), and then
    every rank prints a KeyboardInterrupt traceback; SIGTERM ends it at once, and quietly
    (its stack goes to the report directory)."""

    # only what the caller gave goes on: torch 2.11's _shutdown takes no timeout (every job's
    # end raised TypeError there, exit 1), later ones do
    def wrapped(self, death_sig: signal.Signals = signal.SIGTERM, *args, **kwargs) -> None:
        if death_sig == signal.SIGINT:
            death_sig = signal.SIGTERM
        return shutdown(self, death_sig, *args, **kwargs)

    return wrapped


class _DropDeathSignalNotice(logging.Filter):
    """torch's "Received 2 death signal, shutting down workers": the agent's own line
    (``stopped by SIGINT``) says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Received %s death signal")


def _torchrun_args(argv: list[str]):
    """torchrun's parsed arguments; from ``gridtrain run`` (``OPTIONS -- SCRIPT ARGS``) only
    ``OPTIONS SCRIPT`` is parsed and ARGS reach the script as they are (``cli/argv``)."""
    split = after_separator(argv)
    if split is None:
        return torchrun.parse_args(argv)
    head, tail = split
    args = torchrun.parse_args(head)
    args.training_script_args = tail
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _torchrun_args(argv)
    # torchrun's config before the rank server forks: it sets OMP_NUM_THREADS, which torch
    # reads once, at import (torchrun.run calls it again, finding it set)
    torchrun.config_from_args(args)
    report_dir = tempfile.mkdtemp(prefix="gridtrain-run-")
    os.environ[REPORT_DIR] = report_dir  # the workers inherit it
    # the rank server forks now: before any thread (the store below starts some) and before
    # the agent's own settings below, none of which its workers should inherit
    forked = prefork.start_server(args.nproc_per_node)
    # its per-process failure and stop messages: the summary below says it once
    for name in ("torch.distributed.elastic.multiprocessing", f"{ChildFailedError.__module__}"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # errors' logger has its own level
    api.get_subprocess_handler = prefork.handler_factory(
        api.get_subprocess_handler, lambda cmd: die_with_parent(cmd, os.getpid()), forked
    )
    LocalElasticAgent._shutdown = _stop_workers(LocalElasticAgent._shutdown)
    PContext.close = close_workers(PContext.close, Path(report_dir))
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        _DropDeathSignalNotice()
    )
    try:
        bind_store_to_loopback(args)
        torchrun.run(args)
    except ChildFailedError as err:
        try:
            text = failures.summarize(err.failures, Path(report_dir))
        except Exception:  # noqa: BLE001 - never lose the failure: torch's own table then
            text = err.format_msg()
        if text:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        raise SystemExit(1) from None
    except SignalException as err:  # gridtrain run passed on a signal: torch stopped the workers
        sys.stderr.write(
            f"stopped by {signal.Signals(err.sigval).name}; every worker was stopped\n"
        )
        raise SystemExit(128 + err.sigval) from None
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
