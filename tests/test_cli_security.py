"""The multi-host launcher never lets a host name or an environment variable become shell code."""

import subprocess

import pytest

from gridtrain.cli.hosts import RunSpec, build_host_commands, check_host
from gridtrain.cli.main import main
from gridtrain.cli.usage import UsageError

INJECTED = "NCCL_X$(touch PWN)"


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.py").write_text("")
    (tmp_path / "train.py").write_text("")
    return tmp_path


def exit_code(argv):
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def spec(hosts=("node1", "node2")):
    return RunSpec(config="/cfg/config.py", script="train.py", hosts=list(hosts), nnodes=2)


def test_env_name_with_shell_syntax_is_refused_naming_it():
    with pytest.raises(UsageError, match=r"environment variable 'NCCL_X\$\(touch PWN\)'"):
        build_host_commands(spec(), env={INJECTED: "1"}, cwd="/w", python="/py")


def test_gridtrain_run_refuses_it_before_any_process(files, monkeypatch, capsys):
    monkeypatch.setenv(INJECTED, "1")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    argv = ["run", "--host", "node1,node2", "--config", "config.py", "train.py"]
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert INJECTED in err and "not a valid name" in err, err
    assert not (files / "PWN").exists()


def test_remote_command_through_a_real_shell_runs_nothing_injected(tmp_path):
    """Hostile values (and a cwd with quotes) reach the launcher verbatim; no file appears."""
    env = {
        "NCCL_A": "$(touch PWN)",
        "NCCL_B": "`touch PWN`",
        "NCCL_C": "'; touch PWN; '",
        "TORCH_D": 'a b "c" \\ $HOME',
    }
    cwd = tmp_path / "it's a dir"
    cwd.mkdir()
    [(_, argv), _] = build_host_commands(
        spec(), env=env, cwd=str(cwd), python=str(tmp_path / "show_env.sh")
    )
    (tmp_path / "show_env.sh").write_text(
        '#!/bin/sh\nfor v in NCCL_A NCCL_B NCCL_C TORCH_D; do eval "printf \'%s\\n\' \\"\\$$v\\""; done\n'
    )
    (tmp_path / "show_env.sh").chmod(0o755)
    remote = argv[-1]
    out = subprocess.run(["sh", "-c", remote], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [env["NCCL_A"], env["NCCL_B"], env["NCCL_C"], env["TORCH_D"]]
    assert not (cwd / "PWN").exists() and not (tmp_path / "PWN").exists()


def test_ssh_reads_no_option_after_double_dash():
    [(host, argv), _] = build_host_commands(spec(), env={}, cwd="/w", python="/py")
    assert argv[:2] == ["ssh", "-tt"] and argv[argv.index("--") + 1] == host == "node1"
    assert argv.index("--") == len(argv) - 3, "only the host and the remote command follow --"


BAD_HOSTS = [
    "node 2",
    "-oProxyCommand=touch PWN",
    "a;b",
    "$(touch PWN)",
    "node1\n",
    "@node",
    "a@",
    "fe80::1%$(touch PWN) x",  # issue 28 item 7: ipaddress accepts any IPv6 scope id
    "fe80::1%eth0;id",
    "fe80::1%",
    "node-",  # RFC 1123: no label ends (or starts) with '-'
    "a..b",
    "a" * 64 + ".example.com",  # a label has at most 63 characters
    "node_2",  # RFC 1123 names have no '_'
    "999.1.1.1.",
]


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_bad_host_names_are_refused_naming_the_value(host):
    with pytest.raises(UsageError, match="is not a host name") as err:
        check_host(host)
    assert repr(host) in str(err.value)
    with pytest.raises(UsageError, match="is not a host name"):
        build_host_commands(spec(["node1", host]), env={}, cwd="/w", python="/py")


@pytest.mark.parametrize(
    "argv,value",
    [
        (["--host", "node1,node 2"], "node 2"),
        (["--host", "node1,-oProxyCommand=touch PWN"], "-oProxyCommand=touch PWN"),
        (["--hostfile", "hosts.txt"], "-oProxyCommand=touch"),
        (["--host", "node1", "--master_addr", "$(touch PWN)"], "$(touch PWN)"),
        (["--host", "node1,fe80::1%$(touch PWN) x"], "fe80::1%$(touch PWN) x"),
        (["--master_addr", "fe80::1%$(touch PWN)"], "fe80::1%$(touch PWN)"),
    ],
)
def test_gridtrain_run_refuses_bad_hosts_with_exit_2(files, capsys, monkeypatch, argv, value):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    (files / "hosts.txt").write_text("node1\n-oProxyCommand=touch\n")
    assert exit_code(["run", *argv, "--config", "config.py", "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"{value!r} is not a host name" in err, err
    assert not (files / "PWN").exists()


@pytest.mark.parametrize(
    "host",
    [
        "node1",
        "gpu-07.cluster.example.com",
        "me_2@node-2",
        "10.0.0.1",
        "fe80::1",
        "fe80::1%eth0",
        "fe80::1%enp0s31f6.100",
        "::ffff:10.0.0.1",
        "a.b-c",
        "1node",
    ],
)
def test_real_host_names_are_accepted(host):
    assert check_host(host) == host


def test_no_forwarded_name_is_quoted_away():
    """Valid names stay plain `NAME=value` words (the remote shell must export them)."""
    env = {"NCCL_DEBUG": "INFO", "HOME": "/root", "OMP_NUM_THREADS": "1"}
    [(_, argv), _] = build_host_commands(spec(), env=env, cwd="/w", python="/py")
    assert "export NCCL_DEBUG=INFO OMP_NUM_THREADS=1 GRIDTRAIN_CONFIG=/cfg/config.py " in argv[-1]
    assert "HOME" not in argv[-1]
