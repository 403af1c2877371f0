"""`gridtrain run` / `gridtrain topo`: argument and layout errors, exact ssh commands, a real run."""

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.harness import free_port

from gridtrain.cli.hosts import RunSpec, build_host_commands, parse_hostfile, torchrun_command
from gridtrain.cli.main import build_parser, main
from gridtrain.cli.procs import exit_code as exit_code_of
from gridtrain.cli.procs import run_hosts
from gridtrain.cli.run import run_spec
from gridtrain.launch import CONFIG_ENV

CONFIG_2D = 'parallel = dict(tensor=dict(size=4, mode="2d"))\n'
TORCHRUN = ["-m", "gridtrain.cli.agent"]  # torch.distributed.run, store bound to loopback
SSH = ["ssh", "-tt"]  # -tt: the remote launcher is hung up when the local ssh ends


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A config, a script and a hostfile in tmp_path, which becomes the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.py").write_text(CONFIG_2D)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hosts.txt").write_text(
        "# our nodes\nnode1 slots=8\n\n  node2   # the second\nnode3 slots=8\n"
    )
    return tmp_path


@pytest.fixture
def no_process(monkeypatch):
    """Fail the test if anything tries to start a process."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def exit_code(argv):
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def run_args(*extra):
    return ["run", *extra]


# ---- errors: exit 2 with the message, before any process -------------------------------------
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--config", "config.py", "missing.py"], "script 'missing.py' does not exist"),
        (["--config", "nope.py", "train.py"], "--config 'nope.py' does not exist"),
        (["train.py", "--config", "config.py"], "put --config before the script"),
        (
            ["--host", "a", "--hostfile", "hosts.txt", "--config", "config.py", "train.py"],
            "give --host or --hostfile, not both",
        ),
        (
            [
                "--host",
                "a,b",
                "--include",
                "a",
                "--exclude",
                "b",
                "--config",
                "config.py",
                "train.py",
            ],
            "give --include or --exclude, not both",
        ),
        (
            ["--host", "a,b", "--exclude", "a,b", "--config", "config.py", "train.py"],
            "no hosts left after --include/--exclude",
        ),
        (
            ["--hostfile", "hosts.txt", "--include", "node9", "--config", "config.py", "train.py"],
            "--include: host 'node9' is not in the host list (node1, node2, node3)",
        ),
        (["--include", "a", "--config", "config.py", "train.py"], "--include/--exclude filter"),
        (
            ["--nproc_per_node", "0", "--config", "config.py", "train.py"],
            "--nproc_per_node must be >= 1, got 0",
        ),
        (
            ["--host", "a,b", "--nnodes", "3", "--config", "config.py", "train.py"],
            "--nnodes 3 but only 2 hosts",
        ),
        (
            ["--nnodes", "2", "--nproc_per_node", "4", "--config", "config.py", "train.py"],
            "give --master_addr",
        ),
        (
            ["--host", "a,b,a", "--config", "config.py", "train.py"],
            "host 'a' is listed more than once",
        ),
        (["--hostfile", "none.txt", "--config", "config.py", "train.py"], "--hostfile 'none.txt'"),
        (
            ["--host", "a", "--node_rank", "1", "--config", "config.py", "train.py"],
            "--node_rank is set per host",
        ),
    ],
)
def test_argument_errors_exit_2_before_any_process(files, no_process, capsys, argv, message):
    assert exit_code(run_args(*argv)) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "config,argv,message",
    [
        (
            'parallel = dict(pipeline=2, tensor=dict(size=4, mode="1d"))\n',
            ["--nproc_per_node", "6"],
            "world size 6 is not divisible by pipeline 2 x tensor 4",
        ),
        (
            'parallel = dict(tensor=dict(size=4, mode="2d"))\n',
            ["--host", "a,b", "--nproc_per_node", "3"],  # world = 3 per node x 2 hosts
            "world size 6 is not divisible by pipeline 1 x tensor 4",
        ),
        (
            'parallel = dict(tensor=dict(size=6, mode="2d"))\n',
            ["--nproc_per_node", "6"],
            "2d needs a square tensor size, got 6",
        ),
        ("paralel = dict(pipeline=2)\n", [], "did you mean 'parallel'"),
        (
            "parallel = undefined_name\n",
            [],
            "bad.py' raised NameError(\"name 'undefined_name' is not defined\") at line 1",
        ),
    ],
)
def test_layout_errors_exit_2_with_the_config_message(
    files, no_process, capsys, config, argv, message
):
    (files / "bad.py").write_text(config)
    assert exit_code(run_args(*argv, "--config", "bad.py", "train.py")) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_bad_hostfile_line_names_the_file_and_line():
    with pytest.raises(ValueError, match=r"hosts.txt, line 2: expected 'HOST \[slots=N\]'"):
        parse_hostfile("a\nb cores=4\n", "hosts.txt")


# ---- the exact commands ---------------------------------------------------------------------
def spec_for(argv):
    parser = build_parser()
    return run_spec(parser.parse_args(["run", *argv]))


def remote(host, node_rank, nnodes, master="node1", nproc=4, port=29500, exports=""):
    return (
        f"cd '/work dir' && export {exports}GRIDTRAIN_CONFIG=/cfg/config.py && exec /py "
        f"-m gridtrain.cli.agent --nproc_per_node {nproc} --nnodes {nnodes} "
        f"--node_rank {node_rank} --master_addr {master} --master_port {port} -- train.py --lr 0.1"
    )


def host_commands(argv, env=None):
    spec = spec_for([*argv, "--config", "config.py", "train.py", "--lr", "0.1"])
    spec.config = "/cfg/config.py"  # tmp_path differs per run; the command must not
    return build_host_commands(spec, env=env or {}, cwd="/work dir", python="/py")


def test_host_list_gives_one_ssh_command_per_node(files):
    cmds = host_commands(
        ["--host", "node1, node2", "--nproc_per_node", "4", "--ssh-port", "2222"],
        env={"NCCL_DEBUG": "INFO", "HOME": "/home/me", "OMP_NUM_THREADS": "1"},
    )
    exports = "NCCL_DEBUG=INFO OMP_NUM_THREADS=1 "  # HOME is not forwarded
    assert cmds == [
        ("node1", [*SSH, "-p", "2222", "--", "node1", remote("node1", 0, 2, exports=exports)]),
        ("node2", [*SSH, "-p", "2222", "--", "node2", remote("node2", 1, 2, exports=exports)]),
    ]


def test_hostfile_skips_comments_and_ignores_slots(files):
    cmds = host_commands(["--hostfile", "hosts.txt", "--nproc_per_node", "4"])
    assert cmds == [
        (h, [*SSH, "--", h, remote(h, i, 3)]) for i, h in enumerate(["node1", "node2", "node3"])
    ]


def test_include_keeps_hostfile_order_and_exclude_drops(files):
    argv = ["--hostfile", "hosts.txt", "--nproc_per_node", "2"]
    cmds = host_commands([*argv, "--include", "node3,node2"])
    assert cmds == [
        ("node2", [*SSH, "--", "node2", remote("node2", 0, 2, master="node2", nproc=2)]),
        ("node3", [*SSH, "--", "node3", remote("node3", 1, 2, master="node2", nproc=2)]),
    ]
    cmds = host_commands([*argv, "--exclude", "node1", "--master_addr", "10.0.0.1"])
    assert [c[1][-1] for c in cmds] == [
        remote("node2", 0, 2, master="10.0.0.1", nproc=2),
        remote("node3", 1, 2, master="10.0.0.1", nproc=2),
    ]


def test_nnodes_takes_the_first_hosts(files):
    argv = ["--hostfile", "hosts.txt", "--nnodes", "2", "--nproc_per_node", "2"]
    cmds = host_commands([*argv, "--master_port", "1234"])
    assert [h for h, _ in cmds] == ["node1", "node2"]
    assert cmds[1][1][-1] == remote("node2", 1, 2, nproc=2, port=1234)


def test_local_run_passes_an_absolute_config_and_the_child_exit_code(files, monkeypatch):
    seen = {}

    class FakeLauncher:
        pid = -1

        def __init__(self, argv, env, start_new_session):
            seen.update(argv=argv, env=env, session=start_new_session)

        def wait(self, timeout=None):
            return 7

        poll = wait

    monkeypatch.setattr(subprocess, "Popen", FakeLauncher)
    argv = ["--nproc_per_node", "4", "--master_port", "1234", "--config", "config.py"]
    assert main(run_args(*argv, "train.py", "--epochs", "2")) == 7
    want = [
        sys.executable,
        *TORCHRUN,
        *"--nproc_per_node 4 --nnodes 1 --node_rank 0 --master_addr 127.0.0.1".split(),
        *"--master_port 1234 -- train.py --epochs 2".split(),
    ]
    assert seen["argv"][-len(want) :] == want, "run as given (after procs.die_with_parent)"
    assert seen["env"][CONFIG_ENV] == str(files / "config.py")
    assert seen["session"], "the launcher runs in its own session (signals are forwarded)"


def test_dry_run_prints_the_local_command(files, no_process, capsys):
    assert (
        main(run_args("--nproc_per_node", "4", "--dry-run", "--config", "config.py", "train.py"))
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(
        f"{CONFIG_ENV}={files / 'config.py'} {sys.executable} -m gridtrain.cli.agent"
    )
    assert "--nproc_per_node 4 --nnodes 1 --node_rank 0 --master_addr 127.0.0.1" in out
    # port 0: the launcher binds a free one and keeps it (no window for another process)
    assert "--master_port 0 --" in out


def test_signal_exit_codes_follow_the_shell():
    assert exit_code_of(-9) == 137 and exit_code_of(3) == 3


# ---- the ssh runner, with a fake ssh -------------------------------------------------------
FAKE_SSH = """#!/bin/sh
# fake ssh: [OPTIONS] -- HOST COMMAND
while [ "$1" != "--" ]; do shift; done
shift
echo "hello from $1"
touch "$FAKE_SSH_DIR/$1.said"
# bad fails only once the others have spoken (under load a host may start late)
case "$1" in
  bad) i=0; while [ $i -lt 300 ] && ! { [ -e "$FAKE_SSH_DIR/good.said" ] && \
         [ -e "$FAKE_SSH_DIR/slow.said" ]; }; do sleep 0.1; i=$((i + 1)); done; exit 5;;
  slow) exec sleep 60;;
esac
"""


def test_run_hosts_prefixes_output_and_stops_the_rest_when_a_host_fails(files, monkeypatch, capsys):
    ssh = files / "bin" / "ssh"
    ssh.parent.mkdir()
    ssh.write_text(FAKE_SSH)
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{ssh.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_DIR", str(files))
    spec = RunSpec(config="/c.py", script="train.py", hosts=["good", "slow", "bad"], nnodes=3)

    start = time.monotonic()
    assert run_hosts(build_host_commands(spec)) == 5
    assert time.monotonic() - start < 40, "the slow host (sleep 60) was not stopped"
    captured = capsys.readouterr()
    for host in ("good", "slow", "bad"):
        assert f"[{host}] hello from {host}\n" in captured.out
    assert "host bad exited with code 5" in captured.err

    spec.hosts = ["good", "also-good"]
    assert run_hosts(build_host_commands(spec)) == 0


# ---- topo -----------------------------------------------------------------------------------
def test_topo_full_prints_the_2d_groups(files, no_process, capsys):
    assert main(["topo", "--config", "config.py", "--world-size", "8", "--full"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("world 8 = data 2 x pipeline 1 x tensor 4 (tensor mode 2d")
    rows = next(line for line in lines if line.startswith("PARALLEL_2D_ROW"))
    cols = next(line for line in lines if line.startswith("PARALLEL_2D_COL"))
    assert rows.endswith("[0,1] [2,3] [4,5] [6,7]")
    assert cols.endswith("[0,2] [1,3] [4,6] [5,7]")


def test_topo_layout_error_exits_2(files, capsys):
    assert exit_code(["topo", "--config", "config.py", "--world-size", "6"]) == 2
    assert "world size 6 is not divisible by pipeline 1 x tensor 4" in capsys.readouterr().err


def test_topo_1024_ranks_under_a_second(files, capsys):
    (files / "big.py").write_text(
        'parallel = dict(pipeline=4, tensor=dict(size=8, mode="2.5d", depth=2))\n'
    )
    start = time.perf_counter()
    assert main(["topo", "--config", "big.py", "--world-size", "1024"]) == 0
    assert time.perf_counter() - start < 1.0
    assert "world 1024 = data 32 x pipeline 4 x tensor 8" in capsys.readouterr().out


def test_help_is_informative(capsys):
    assert exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    assert "run" in out and "topo" in out and "examples:" in out
    assert exit_code(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--nproc_per_node",
        "--hostfile",
        "--include",
        "--master_port",
        "GRIDTRAIN_CONFIG",
    ):
        assert flag in out


# ---- a real run through torch.distributed.run ---------------------------------------------
GROUPS_SCRIPT = """
import sys
import gridtrain as gt

ctx = gt.launch_from_torch()
for mode in gt.ParallelMode:
    if ctx.is_initialized(mode):
        # one write per line so ranks sharing the pipe do not interleave mid-line
        sys.stdout.write(f"rank {ctx.global_rank} {mode.name} {list(ctx.ranks(mode))}\\n")
        sys.stdout.flush()
sys.stdout.write(f"rank {ctx.global_rank} args {sys.argv[1:]}\\n")
gt.destroy()
"""


def _gridtrain_command():
    script = Path(sys.executable).parent / "gridtrain"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "gridtrain.cli"]


def test_end_to_end_2d_run_builds_the_row_and_col_groups(tmp_path):
    (tmp_path / "config.py").write_text(CONFIG_2D)
    (tmp_path / "script.py").write_text(GROUPS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(CONFIG_ENV, None)
    argv = ["run", "--nproc_per_node", "4", "--master_port", str(free_port())]
    proc = subprocess.run(
        [*_gridtrain_command(), *argv, "--config", "config.py", "script.py", "--x", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = set(proc.stdout.splitlines())
    rows = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    cols = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rank in range(4):
        assert f"rank {rank} PARALLEL_2D_ROW {rows[rank]}" in lines, proc.stdout
        assert f"rank {rank} PARALLEL_2D_COL {cols[rank]}" in lines, proc.stdout
        assert f"rank {rank} TENSOR [0, 1, 2, 3]" in lines
        assert f"rank {rank} args ['--x', '1']" in lines


def test_without_config_the_workers_get_none(files, no_process, capsys, monkeypatch):
    """No --config: no GRIDTRAIN_CONFIG reaches the workers, not even one of the shell's."""
    monkeypatch.setenv(CONFIG_ENV, "/stale/config.py")
    assert main(run_args("--nproc_per_node", "4", "--dry-run", "train.py")) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{sys.executable} -m gridtrain.cli.agent --nproc_per_node 4"), out
    spec = spec_for(["--host", "node1,node2", "train.py"])
    for _, ssh in build_host_commands(spec, env={}, cwd="/w", python="/py"):
        assert ssh[-1].startswith(f"cd /w && unset {CONFIG_ENV} && exec /py"), ssh[-1]


# ---- elastic options ------------------------------------------------------------------------
def test_elastic_options_reach_every_launcher(files):
    argv = ["--max-restarts", "2", "--monitor-interval", "0.5", "--rdzv-backend", "c10d"]
    argv += ["--nproc_per_node", "4", "--master_port", "1234"]
    spec = spec_for([*argv, "--config", "config.py", "train.py"])
    command = torchrun_command(spec, "/py", 0)
    elastic = "--max-restarts 2 --monitor-interval 0.5 --rdzv-backend c10d"
    assert f"--master_port 1234 {elastic} --rdzv-endpoint 127.0.0.1:1234 -- train.py" in " ".join(
        command
    ), "the c10d endpoint defaults to master_addr:master_port"
    argv = ["--host", "node1,node2", "--nproc_per_node", "2", "--max_restarts", "1"]
    cmds = host_commands([*argv, "--rdzv-id", "job7"])
    for _, ssh in cmds:
        assert "--master_port 29500 --max-restarts 1 --rdzv-id job7 -- train.py" in ssh[-1]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
        (["--monitor-interval", "0"], "--monitor-interval must be > 0, got 0.0"),
    ],
)
def test_elastic_option_errors_exit_2(files, no_process, capsys, argv, message):
    assert exit_code(run_args(*argv, "--config", "config.py", "train.py")) == 2
    assert message in capsys.readouterr().err
