"""What `gridtrain run` starts, as plain data: host lists and the exact commands per host.

Nothing here starts a process, so tests can check every command a node would
run. ``gridtrain.cli.run`` parses the arguments into a ``RunSpec`` and runs the
commands built here.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from gridtrain.cli.argv import SEPARATOR
from gridtrain.cli.usage import UsageError
from gridtrain.config import CONFIG_ENV

DEFAULT_MASTER_PORT = 29500  # torchrun's default
# Forwarded to every ssh session besides GRIDTRAIN_CONFIG: the knobs people set in
# the launching shell and expect the workers to see (a login shell would drop them).
FORWARDED_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "OMP_", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")
# What a shell accepts after `export`; anything else could carry shell syntax.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# RFC 1123 host names: dot-separated labels of letters, digits and '-', neither starting nor
# ending with '-', at most 63 characters each and 253 in all (so ssh never reads one as an
# option, and no shell character can appear)
LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_NAME = re.compile(rf"{LABEL}(?:\.{LABEL})*")
# the zone of a link-local IPv6 address ("fe80::1%eth0"): an interface name or number
SCOPE_ID = re.compile(r"[A-Za-z0-9_.-]+")
USER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass
class RunSpec:
    """A validated `gridtrain run` command line.

    ``hosts`` is empty for a run on this machine only (then ``nnodes`` and
    ``node_rank`` are passed to torchrun as given); otherwise one ssh session
    is started per host and host ``i`` is node ``i``.
    """

    config: str | None  # absolute path, exported as GRIDTRAIN_CONFIG; None: the defaults
    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    hosts: list[str] = field(default_factory=list)
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    ssh_port: int | None = None
    elastic: list[str] = field(default_factory=list)  # torchrun options: --max-restarts N, ...

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def parse_hostfile(text: str, source: str = "hostfile") -> list[str]:
    """Hosts from hostfile text: one per line, ``#`` comments, an optional ``slots=N`` ignored.

    The number of processes per host comes from ``--nproc_per_node`` (the same on
    every node), so ``slots`` is accepted for compatibility with MPI/DeepSpeed
    hostfiles but not used.
    """
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        host, extra = words[0], words[1:]
        for word in extra:
            key, _, value = word.partition("=")
            if key != "slots" or not value.isdigit():
                raise UsageError(
                    f"--hostfile {source}, line {lineno}: expected 'HOST [slots=N]', got {raw.strip()!r}"
                )
        hosts.append(host)
    return hosts


def _is_address(name: str) -> bool:
    """An IPv4 address, or an IPv6 address with an optional ``%scope`` of ``SCOPE_ID``
    (``ipaddress`` itself accepts any characters in a scope id)."""
    address, percent, scope = name.partition("%")
    try:
        if not percent:
            ipaddress.ip_address(address)
            return True
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return SCOPE_ID.fullmatch(scope) is not None


def check_host(host: str, what: str = "host") -> str:
    """``host`` if it is an RFC 1123 host name, an IP address or ``user@`` either; else a
    ``UsageError`` naming it.

    Host names reach ssh's command line and the remote shell, so anything with
    spaces, shell syntax or a leading ``-`` (``-oProxyCommand=...``) is refused.
    """
    user, at, name = host.rpartition("@")
    ok = bool(name) and (not at or USER_NAME.fullmatch(user) is not None)
    named = HOST_NAME.fullmatch(name) is not None and len(name) <= 253
    if not ok or not (named or _is_address(name)):
        raise UsageError(
            f"{what} {host[:200]!r} is not a host name (expected [user@]name or an IP address: "
            "an RFC 1123 name of letters, digits, '-' and '.', an IPv4 address, or an IPv6 "
            "address with an optional %scope of letters, digits, '_', '.', '-')"
        )
    return host


def split_hosts(value: str) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``."""
    return [h.strip() for h in value.split(",") if h.strip()]


def select_hosts(
    hosts: list[str],
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    nnodes: int | None = None,
) -> list[str]:
    """Filter ``hosts`` (order kept) by ``--include`` / ``--exclude``, then keep the first ``nnodes``."""
    for host in hosts:
        check_host(host)
    dup = sorted({h for h in hosts if hosts.count(h) > 1})
    if dup:
        raise UsageError(f"host {dup[0]!r} is listed more than once")
    for flag, names in (("--include", include), ("--exclude", exclude)):
        unknown = [h for h in names or [] if h not in hosts]
        if unknown:
            raise UsageError(
                f"{flag}: host {unknown[0]!r} is not in the host list ({', '.join(hosts)})"
            )
    if include:
        hosts = [h for h in hosts if h in include]
    if exclude:
        hosts = [h for h in hosts if h not in exclude]
    if not hosts:
        raise UsageError("no hosts left after --include/--exclude")
    if nnodes is not None:
        if nnodes > len(hosts):
            raise UsageError(f"--nnodes {nnodes} but only {len(hosts)} hosts: {', '.join(hosts)}")
        hosts = hosts[:nnodes]
    return hosts


def torchrun_command(spec: RunSpec, python: str, node_rank: int) -> list[str]:
    """The launcher command for node ``node_rank``: ``python -m gridtrain.cli.agent`` takes
    torchrun's arguments and is torchrun, with the store on loopback for a local run."""
    return [
        python,
        "-m",
        "gridtrain.cli.agent",
        "--nproc_per_node",
        str(spec.nproc_per_node),
        "--nnodes",
        str(spec.nnodes),
        "--node_rank",
        str(node_rank),
        "--master_addr",
        spec.master_addr,
        "--master_port",
        str(spec.master_port),
        *spec.elastic,
        SEPARATOR,  # everything after the script is the script's (cli/argv)
        spec.script,
        *spec.script_args,
    ]


def forwarded_env(spec: RunSpec, env: Mapping[str, str]) -> dict[str, str]:
    """Variables each ssh session exports: GRIDTRAIN_CONFIG and the forwarded prefixes.

    A forwarded variable whose name a shell would not accept (``NCCL_X$(cmd)``)
    is a ``UsageError``: it would run as code in the remote shell.
    """
    out = {k: v for k, v in sorted(env.items()) if k.startswith(FORWARDED_ENV_PREFIXES)}
    for name in out:
        if ENV_NAME.fullmatch(name) is None:
            raise UsageError(
                f"environment variable {name!r} would be forwarded to every host but is not a "
                "valid name ([A-Za-z_][A-Za-z0-9_]*); unset it or rename it"
            )
    if spec.config is not None:
        out[CONFIG_ENV] = spec.config
    return out


def build_host_commands(
    spec: RunSpec,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    python: str | None = None,
) -> list[tuple[str, list[str]]]:
    """``(host, ssh argv)`` per host: cd to ``cwd``, export the config, run torchrun as node i.

    ``env``, ``cwd`` and ``python`` default to this process's environment,
    working directory and interpreter; the remote hosts are expected to see the
    same paths (a shared file system), as with ``colossalai run``.
    """
    env = os.environ if env is None else env
    cwd = os.getcwd() if cwd is None else cwd
    python = python or sys.executable
    exports = " ".join(
        f"{shlex.quote(k)}={shlex.quote(v)}" for k, v in forwarded_env(spec, env).items()
    )
    # no config: the remote shell's own GRIDTRAIN_CONFIG must not choose one either
    setup = f"export {exports}" if spec.config is not None else f"unset {CONFIG_ENV}"
    if spec.config is None and exports:
        setup += f" && export {exports}"
    # -tt: the remote launcher gets a terminal, so when this ssh ends (gridtrain run stopped,
    # killed or interrupted) the remote side is hung up and the launcher stops its workers.
    ssh = ["ssh", "-tt"] + (["-p", str(spec.ssh_port)] if spec.ssh_port is not None else [])
    commands = []
    for node_rank, host in enumerate(spec.hosts):
        check_host(host)
        remote = (
            f"cd {shlex.quote(cwd)} && {setup} && "
            f"exec {shlex.join(torchrun_command(spec, python, node_rank))}"
        )
        commands.append((host, [*ssh, "--", host, remote]))
    return commands
