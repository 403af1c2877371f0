"""The docs match the files: every path in README.md, demos/*/README.md and `gridtrain --help`
exists, and every command runs in a short form.

What counts as a path or a command, and which files a document defines itself, is in
``helpers/doc_refs.py``. The short forms: `gridtrain run` loads the config and checks its
layout against the command's world size, and the script's flags against the script's own
`--help`; `gridtrain topo`/`estimate` run (in this process) and print what the docs show
after a `$ ` prompt; `python SCRIPT` answers `--help` and knows the flags given; `make T`
names a Makefile target; a repository script exists and is executable; a synopsis (with
placeholders) names only options that exist.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import forked
from helpers.doc_refs import REPO, Command, Doc, resolve, scan_help, scan_markdown

from gridtrain.cli.main import build_parser, main
from gridtrain.config import Config


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def _docs() -> list[Doc]:
    docs = [Doc("README.md", (REPO / "README.md").read_text(), REPO)]
    for path in sorted(REPO.glob("demos/*/README.md")):
        docs.append(Doc(str(path.relative_to(REPO)), path.read_text(), path.parent))
    docs = [scan_markdown(d) for d in docs]
    for sub in ([], ["run"], ["topo"], ["estimate"]):
        text = _cli([*sub, "--help"])[1]
        docs.append(scan_help(Doc(" ".join(["gridtrain", *sub, "--help"]), text, REPO, False)))
    return docs


DOCS = {d.name: d for d in _docs()}
PATHS = [(d, p) for d in DOCS.values() for p in d.paths]
COMMANDS = [(d, c) for d in DOCS.values() for c in d.commands]
DEMO_SCRIPTS = sorted(
    str(p.relative_to(REPO))
    for name in ("train.py", "finetune.py", "eval.py")
    for p in REPO.glob(f"demos/*/{name}")
)
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def _id(item) -> str:
    doc, ref = item
    what = ref.token if hasattr(ref, "token") else " ".join(ref.argv)
    return f"{doc.name}:{ref.line}: {what}"[:120]


@pytest.fixture(scope="module")
def defined(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every file a document defines, written out (the README's train.py, 1d.py, ...)."""
    out = {}
    for doc in DOCS.values():
        folder = tmp_path_factory.mktemp(re.sub(r"\W", "_", doc.name))
        for name, text in doc.defined.items():
            (folder / name).write_text(text)
            out[doc.name, name] = folder / name
    return out


def _help(script: str) -> forked.Result:
    env = {k: v for k, v in os.environ.items() if k not in ("GRIDTRAIN_CONFIG", "RANK")}
    return forked.run([str(REPO / script), "--help"], REPO.parent, env, timeout=180)


@pytest.fixture(scope="module")
def script_help() -> dict[str, forked.Result]:
    """`python SCRIPT --help` of every repository script the docs run, and every demo's entry
    script: each a process of its own (forked from a server that imported torch once,
    ``helpers.forked``), two at a time."""
    scripts = set(DEMO_SCRIPTS)
    for _, cmd in COMMANDS:
        for i, word in enumerate(cmd.argv[1:]):
            script = (cmd.cwd / word).resolve()
            if word.endswith(".py") and cmd.argv[i] != "--config" and script.is_file():
                scripts.add(str(script.relative_to(REPO)))
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(sorted(scripts), pool.map(_help, sorted(scripts)), strict=True))


def _parse(cmd: Command):
    """The `gridtrain` command line parsed by gridtrain's own parser; None for a synopsis or
    a mention (`gridtrain topo`, `gridtrain run --config`: the parser finds arguments missing)."""
    if cmd.synopsis:
        return None
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            return build_parser().parse_args(cmd.argv[1:])
        except SystemExit:
            message = err.getvalue()
    assert re.search(r"required|expected one argument", message), message
    return None


def _path(token: str, doc: Doc, cwd: Path, defined) -> Path:
    found = resolve(token, doc, None, cwd)
    if found:
        return found[0]
    assert (doc.name, token) in defined, f"'{token}' exists neither as a file nor in {doc.name}"
    return defined[doc.name, token]


def _check_flags(words: list[str], help_text: str, what: str) -> None:
    for word in words:
        flag = word.split("=")[0]
        if OPTION.fullmatch(flag):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), (
                f"{what} has no option {flag}"
            )


@pytest.mark.parametrize("item", PATHS, ids=map(_id, PATHS))
def test_every_path_exists(item):
    doc, ref = item
    bare = "/" not in ref.token
    assert resolve(ref.token, doc, ref.context) or (bare and ref.token in doc.defined), (
        f"{doc.name} line {ref.line} names '{ref.token}', which is neither a file of the "
        f"repository nor defined in {doc.name}"
    )


@pytest.mark.parametrize("item", COMMANDS, ids=map(_id, COMMANDS))
def test_every_command_runs(item, defined, script_help):
    doc, cmd = item
    program = cmd.argv[0]
    if program == "gridtrain":
        _check_gridtrain(doc, cmd, defined, script_help)
    elif program == "python":
        script = str((cmd.cwd / cmd.argv[1]).resolve().relative_to(REPO))
        _check_script(script, cmd.argv[2:], script_help)
    elif program == "make":
        makefile = (REPO / "Makefile").read_text()
        for word in cmd.argv[1:]:
            if re.fullmatch(r"[A-Za-z_]\w*=.*", word):  # make's own VAR=value
                variable = word.split("=")[0]
                assert re.search(rf"^{variable}\s*[?:]?=", makefile, re.M), f"no variable {word}"
            else:
                assert re.search(rf"^{re.escape(word)}:", makefile, re.M), f"no target {word}"
    else:
        script = cmd.cwd / program
        assert script.is_file() and os.access(script, os.X_OK), f"{program} is not executable"


def _check_script(script: str, words: list[str], script_help) -> None:
    run = script_help[script]
    assert run.returncode == 0 and "usage:" in run.stdout, f"{script} --help:\n{run.stderr}"
    _check_flags(words, run.stdout, script)


def _check_gridtrain(doc: Doc, cmd: Command, defined, script_help) -> None:
    sub, parsed = cmd.argv[1], _parse(cmd)
    if parsed is None or (sub == "run" and parsed.config is None):
        _check_synopsis(doc, cmd, script_help)
    elif sub == "run":
        _check_run(doc, cmd, parsed, defined, script_help)
    else:  # topo, estimate: run them here, with the config the docs name
        argv = list(cmd.argv[1:])
        argv[argv.index("--config") + 1] = str(_path(parsed.config, doc, cmd.cwd, defined))
        code, out, err = _cli(argv)
        assert code == 0, err
        printed = {" ".join(line.split()) for line in out.splitlines()}
        for line in cmd.shown:
            shown = " ".join(line.split())
            assert shown in ("...", "…") or shown in printed, f"{doc.name} shows, unprinted: {line}"


def _check_synopsis(doc: Doc, cmd: Command, script_help) -> None:
    """A synopsis or a mention: its options exist, its placeholders match files, and the
    options after a script are the script's."""
    sub, words = cmd.argv[1], cmd.argv[2:]
    scripts = [i for i, w in enumerate(words) if w.endswith(".py") and words[i - 1] != "--config"]
    cut = scripts[0] if scripts and sub == "run" else len(words)
    _check_flags(words[:cut], DOCS[f"gridtrain {sub} --help"].text, f"gridtrain {sub}")
    for word in words:
        if re.search(r"<\w+>", word) and "/" in word:
            assert resolve(word, doc, None, cmd.cwd), f"no file matches {word}"
    script = (cmd.cwd / words[cut]).resolve() if cut < len(words) else None
    if script is not None and script.is_file():
        _check_script(str(script.relative_to(REPO)), words[cut + 1 :], script_help)


def _check_run(doc: Doc, cmd: Command, parsed, defined, script_help) -> None:
    """The config loads and fits the command's world size; the script takes its options."""
    config = Config.from_file(_path(parsed.config, doc, cmd.cwd, defined))
    if parsed.nnodes or parsed.host or not parsed.hostfile:  # a host file's length is unknown
        nodes = parsed.nnodes or (len(parsed.host.split(",")) if parsed.host else 1)
        config.check_run(parsed.nproc_per_node * nodes)
    script = _path(parsed.script, doc, cmd.cwd, defined).resolve()
    if script.is_relative_to(REPO):
        _check_script(str(script.relative_to(REPO)), parsed.script_args, script_help)
    else:
        assert not parsed.script_args, f"{parsed.script} (defined in {doc.name}) takes none"


def test_every_doc_is_read():
    """The extraction finds what each document holds, so the checks above check something."""
    markdown = [d for d in DOCS.values() if d.markdown]
    for doc in markdown:
        assert doc.commands and doc.paths, f"no command or no path found in {doc.name}"
    assert DOCS["gridtrain --help"].commands, "the examples of gridtrain --help are found"
    assert {"train.py", "1d.py", "config.py"} <= set(DOCS["README.md"].defined)
    assert any(c.shown for c in DOCS["README.md"].commands), "the shown outputs are found"


@pytest.mark.parametrize("script", DEMO_SCRIPTS)
def test_demo_scripts_answer_help_without_a_config(script, script_help):
    run = script_help[script]
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage:") and "Traceback" not in run.stderr
