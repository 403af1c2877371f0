"""Everything after the script belongs to the script: `gridtrain run` and torch's agent under it
read none of it, whatever it looks like (an abbreviation of one of their options, their options
themselves, ``--``). Twenty argument strings: each through ``gridtrain run --dry-run``, then all
of them at once through one real launch, where the script prints what it received."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest
from test_launch_run import gridtrain_command

from gridtrain.cli.main import main

ARGUMENTS = [
    "--n 5",  # was: ambiguous option: --n could match --nproc_per_node, --nnodes, --node_rank
    "--ma",
    "--s",
    "--h",
    "--d 256",  # torch's agent took it
    "-h",
    "--help",
    "--config other.py",
    "--nproc_per_node 3",
    "--max-restarts 1 --dry-run",
    "-- --lr 0.1",
    "-m pkg.mod",
    "--standalone --no-python",
    "--nnodes=2 --node_rank 1",
    "--rdzv-backend c10d --rdzv-id x",
    "--master_port 1 --master_addr 10.0.0.1",
    "--log-dir /tmp/x --tee 3",
    "-r 3 --local-ranks-filter 0",
    "--version",
    "train.py --epochs 2 'two words' ''",
]
SHOW = "import json, sys\nprint('ARGV ' + json.dumps(sys.argv[1:]), flush=True)\n"


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.py").write_text("")
    (tmp_path / "show.py").write_text(SHOW)
    return tmp_path


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_the_dry_run_passes_the_scripts_arguments_as_given(job, capsys, arguments):
    args = shlex.split(arguments)
    assert main(["run", "--dry-run", "--config", "config.py", "show.py", *args]) == 0
    command = shlex.split(capsys.readouterr().out)
    assert command[-len(args) - 2 :] == ["--", "show.py", *args], command


def test_one_launch_hands_all_twenty_to_the_script(job):
    args = [a for arguments in ARGUMENTS for a in shlex.split(arguments)]
    argv = ["run", "--nproc_per_node", "1", "--config", "config.py", "show.py", *args]
    proc = subprocess.run(
        [*gridtrain_command(), *argv], cwd=job, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ARGV ")]
    assert len(lines) == 1, proc.stdout
    assert json.loads(lines[0][len("ARGV ") :]) == args
