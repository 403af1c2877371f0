"""``gridtrain run``: a training script on many processes, through torch's elastic launcher.

Everything that can be checked (files, host lists, the config's layout for the world size
it is about to start) is checked before any process starts. Then torch's own elastic
launcher (``python -m gridtrain.cli.agent``: ``torch.distributed.run`` with its store on
loopback for a local run) runs on this machine, or once per host over ssh; ``procs``
supervises them (signals forwarded, nothing left running). The config path reaches the
script through ``GRIDTRAIN_CONFIG``, so ``gt.launch_from_torch()`` needs no argument.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from pathlib import Path

from gridtrain.cli.hosts import (
    DEFAULT_MASTER_PORT,
    RunSpec,
    build_host_commands,
    check_host,
    parse_hostfile,
    select_hosts,
    split_hosts,
    torchrun_command,
)
from gridtrain.cli.procs import run_hosts, run_local
from gridtrain.cli.usage import UsageError, load_config
from gridtrain.config import CONFIG_ENV, Config, ConfigError

DESCRIPTION = """\
Start train.py on nproc_per_node processes per node through torch's elastic
launcher (python -m torch.distributed.run, via gridtrain.cli.agent). Without
--host/--hostfile it runs on this machine, its rendezvous store listening on
127.0.0.1 only; with them it opens one ssh session per host (ssh -tt), cds into
the current directory there and runs the same launcher as node i of len(hosts).
SIGTERM, SIGINT or SIGHUP sent to gridtrain run reach every worker; nothing it
started outlives it. --max-restarts N restarts every worker after a failure.

The config is loaded and checked against the world size (nproc_per_node x
nnodes) before anything starts; its absolute path is exported as
GRIDTRAIN_CONFIG, so the script calls gridtrain.launch_from_torch() with no
argument. Everything after the script name is passed to the script.
"""

FLAGS = ("--dry-run", "--help", "-h")  # run's options that take no value (cli/argv)

HOSTFILE_HELP = """\
hostfile: one host per line, '#' starts a comment, an optional 'slots=N' after
the host is accepted and ignored (every node runs --nproc_per_node processes).
"""


# ---- arguments ------------------------------------------------------------------------------
def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``run`` sub-command to ``gridtrain``'s sub-parsers."""
    run = subparsers.add_parser(
        "run",
        help="launch a training script on one or several nodes",
        description=DESCRIPTION,
        epilog=HOSTFILE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # not required=True: run_spec says so itself, with a hint when it came after the script
    run.add_argument(
        "--config", help="gridtrain config (.py, .yaml or .yml); without it: the defaults"
    )
    run.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="processes per node, usually one per GPU (default: 1)",
    )
    _add_node_arguments(run.add_argument_group("nodes (default: this machine only)"))
    _add_rendezvous_arguments(run.add_argument_group("rendezvous"))
    _add_elastic_arguments(
        run.add_argument_group("restarts (torch's elastic agent, passed through)")
    )
    run.add_argument(
        "--dry-run", action="store_true", help="print the command(s) instead of running them"
    )
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(handler=cmd_run, parser=run)
    return run


def _add_node_arguments(nodes) -> None:
    nodes.add_argument(
        "--nnodes",
        type=int,
        metavar="N",
        help="with --host/--hostfile: use the first N hosts; without: this machine is "
        "node --node_rank of N and the other nodes run the same command",
    )
    nodes.add_argument(
        "--node_rank",
        "--node-rank",
        type=int,
        metavar="I",
        help="without --host/--hostfile: this machine's node rank (default: 0)",
    )
    nodes.add_argument("--host", metavar="A,B", help="comma-separated hosts to run on over ssh")
    nodes.add_argument("--hostfile", metavar="FILE", help="file listing the hosts (see below)")
    nodes.add_argument("--include", metavar="A,B", help="use only these hosts of the list")
    nodes.add_argument("--exclude", metavar="A,B", help="use every host of the list but these")
    nodes.add_argument(
        "--ssh-port", "--ssh_port", type=int, metavar="P", help="ssh port (default: ssh's own)"
    )


def _add_rendezvous_arguments(rdzv) -> None:
    rdzv.add_argument(
        "--master_addr",
        "--master-addr",
        metavar="A",
        help="address of node 0 (default: the first host, or 127.0.0.1 on one machine)",
    )
    rdzv.add_argument(
        "--master_port",
        "--master-port",
        type=int,
        metavar="P",
        help=f"port on node 0 (default: {DEFAULT_MASTER_PORT}; a free port on one machine)",
    )


def _add_elastic_arguments(elastic) -> None:
    elastic.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        metavar="N",
        help="restart every worker up to N times after one fails (default: 0)",
    )
    elastic.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        type=float,
        metavar="S",
        help="seconds between the agent's checks of its workers (torchrun's default)",
    )
    elastic.add_argument(
        "--rdzv-backend", "--rdzv_backend", metavar="B", help="rendezvous backend (default: static)"
    )
    elastic.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        metavar="HOST:PORT",
        help="rendezvous endpoint (default with --rdzv-backend: master_addr:master_port)",
    )
    elastic.add_argument("--rdzv-id", "--rdzv_id", metavar="ID", help="rendezvous job id")
    elastic.add_argument("--rdzv-conf", "--rdzv_conf", metavar="K=V,...", help="rendezvous options")


# ---- checks ---------------------------------------------------------------------------------
def run_spec(args: argparse.Namespace) -> RunSpec:
    """Check a parsed ``gridtrain run`` command line and the config's layout; build the spec.

    Raises ``UsageError`` (naming the argument) or ``ConfigError`` (the config's
    own message); starts nothing.
    """
    _check_arguments(args)
    spec = RunSpec(
        config=os.path.abspath(args.config) if args.config is not None else None,
        script=args.script,
        script_args=list(args.script_args),
        nproc_per_node=args.nproc_per_node,
        ssh_port=args.ssh_port,
    )
    if args.host is not None or args.hostfile is not None:
        _over_ssh(args, spec)
    else:
        _on_this_machine(args, spec)
    spec.elastic = _elastic_args(args, spec)
    _check_layout(spec)
    return spec


def _check_arguments(args: argparse.Namespace) -> None:
    """The checks that need no host list: required and exclusive arguments, bounds, files."""
    if args.config is None and any(a.split("=")[0] == "--config" for a in args.script_args):
        raise UsageError(  # it would run with the defaults, and the script get the --config
            "--config after the script name goes to the script, and gridtrain run was given "
            "none; put --config before the script"
        )
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc_per_node must be >= 1, got {args.nproc_per_node}")
    if args.nnodes is not None and args.nnodes < 1:
        raise UsageError(f"--nnodes must be >= 1, got {args.nnodes}")
    if args.host is not None and args.hostfile is not None:
        raise UsageError("give --host or --hostfile, not both")
    if args.include is not None and args.exclude is not None:
        raise UsageError("give --include or --exclude, not both")
    multi = args.host is not None or args.hostfile is not None
    if not multi and (args.include is not None or args.exclude is not None):
        raise UsageError("--include/--exclude filter the hosts of --host or --hostfile")
    if args.master_addr is not None:
        check_host(args.master_addr, "--master_addr")
    for flag, port in (("--master_port", args.master_port), ("--ssh-port", args.ssh_port)):
        if port is not None and not 0 < port < 65536:
            raise UsageError(f"{flag} must be in 1..65535, got {port}")
    if not Path(args.script).is_file():
        raise UsageError(f"script '{args.script}' does not exist")
    if args.config is not None and not Path(args.config).is_file():
        raise UsageError(f"--config '{args.config}' does not exist")


def _over_ssh(args: argparse.Namespace, spec: RunSpec) -> None:
    """Fill ``spec`` for one ssh session per host of --host/--hostfile."""
    if args.node_rank is not None:
        raise UsageError("--node_rank is set per host when --host/--hostfile is given")
    if args.hostfile is not None:
        if not Path(args.hostfile).is_file():
            raise UsageError(f"--hostfile '{args.hostfile}' does not exist")
        hosts = parse_hostfile(Path(args.hostfile).read_text(), args.hostfile)
        if not hosts:
            raise UsageError(f"--hostfile '{args.hostfile}' lists no hosts")
    else:
        hosts = split_hosts(args.host)
        if not hosts:
            raise UsageError("--host lists no hosts")
    spec.hosts = select_hosts(
        hosts,
        split_hosts(args.include) if args.include is not None else None,
        split_hosts(args.exclude) if args.exclude is not None else None,
        args.nnodes,
    )
    spec.nnodes = len(spec.hosts)
    spec.master_addr = args.master_addr or spec.hosts[0]
    spec.master_port = args.master_port or DEFAULT_MASTER_PORT


def _on_this_machine(args: argparse.Namespace, spec: RunSpec) -> None:
    """Fill ``spec`` for this machine as node --node_rank of --nnodes."""
    if args.ssh_port is not None:
        raise UsageError("--ssh-port needs --host or --hostfile")
    spec.nnodes = args.nnodes or 1
    spec.node_rank = args.node_rank or 0
    if not 0 <= spec.node_rank < spec.nnodes:
        raise UsageError(f"--node_rank must be in [0, {spec.nnodes}), got {spec.node_rank}")
    if spec.nnodes > 1 and args.master_addr is None:
        raise UsageError(
            f"--nnodes {spec.nnodes} without --host/--hostfile starts only this node; "
            "give --master_addr, the address of node 0 that every node can reach"
        )
    spec.master_addr = args.master_addr or "127.0.0.1"
    if args.master_port is not None:
        spec.master_port = args.master_port
    elif spec.nnodes == 1 and args.rdzv_backend in (None, "static"):
        # 0: the agent binds a free port itself and keeps it (cli/agent), so no other process
        # can take it between a choice here and the bind there
        spec.master_port = 0
    elif spec.nnodes == 1:
        spec.master_port = _free_port()  # an endpoint torch's rendezvous binds by itself


def _elastic_args(args: argparse.Namespace, spec: RunSpec) -> list[str]:
    """torchrun's elastic options as given (checked), for every node's launcher."""
    out: list[str] = []
    if args.max_restarts is not None:
        if args.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        out += ["--max-restarts", str(args.max_restarts)]
    if args.monitor_interval is not None:
        if not args.monitor_interval > 0:
            raise UsageError(f"--monitor-interval must be > 0, got {args.monitor_interval}")
        out += ["--monitor-interval", str(args.monitor_interval)]
    endpoint = args.rdzv_endpoint
    if args.rdzv_backend is not None:
        out += ["--rdzv-backend", args.rdzv_backend]
        if endpoint is None and args.rdzv_backend != "static":
            endpoint = f"{spec.master_addr}:{spec.master_port}"
    for flag, value in (
        ("--rdzv-endpoint", endpoint),
        ("--rdzv-id", args.rdzv_id),
        ("--rdzv-conf", args.rdzv_conf),
    ):
        if value is not None:
            out += [flag, value]
    return out


def _check_layout(spec: RunSpec) -> None:
    """Load the config and fail now, with its message, if the world size cannot run it."""
    cfg = load_config(spec.config) if spec.config is not None else Config()
    try:
        cfg.check_run(spec.world_size)
    except ConfigError as err:
        raise ConfigError(
            f"{err} (--nproc_per_node {spec.nproc_per_node} x --nnodes {spec.nnodes})"
        ) from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- running --------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    """Run ``gridtrain run`` (or print its commands with --dry-run); returns the exit code."""
    spec = run_spec(args)
    if spec.hosts:
        commands = build_host_commands(spec)
        if args.dry_run:
            for _, argv in commands:
                print(shlex.join(argv))
            return 0
        return run_hosts(commands)
    argv = torchrun_command(spec, sys.executable, spec.node_rank)
    if args.dry_run:
        config = f"{CONFIG_ENV}={shlex.quote(spec.config)} " if spec.config is not None else ""
        print(f"{config}{shlex.join(argv)}")
        return 0
    return run_local(argv, spec.config)
