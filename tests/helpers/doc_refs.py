"""What the docs name: file paths, commands and the files a document defines itself.

A *document* is a markdown file (README.md, demos/*/README.md) or a plain-text help
(``gridtrain --help`` and each sub-command's). The rules, so that nothing is whitelisted:

* **Defined files.** A code block whose first line is ``# NAME`` or ``# config: NAME``
  (NAME a ``.py``/``.yaml`` file) defines NAME in that document, with the block's lines up
  to the first ``$ `` prompt as its text (the README's ``train.py``, ``1d.py``, ...).
* **Paths.** In markdown: every token of an inline code span that ends in a shipped
  extension (``SHIPPED``), or that starts with a top-level folder of the repository, or
  with a folder of the document's own directory. In a help text only the latter two (no
  code markup there to tell a file from a word). A path resolves against the repository
  root, the document's directory, or the folder of the last path named earlier in the same
  paragraph or table ("``benchmarks/``: ``gpt_throughput.py``, ..."); a bare name may also
  be one the document defines. ``a{1,2}.py`` expands as in bash; ``<name>`` and ``*`` are
  placeholders that must match at least one file. Not paths: the user's own places
  (absolute, ``./``, ``~``, ``$VAR``), a span that starts with an option (``--data FILE``:
  option values are the user's), and names with other extensions (outputs: ``.pt``,
  ``.json``, ``.safetensors``).
* **Commands.** ``gridtrain run|topo|estimate ...`` anywhere in a code block or span
  (comments included: ``# train.py (gridtrain run ...)``), and lines or spans that start
  with ``python``/``make``/a repository script (after ``VAR=value`` prefixes). A block's
  ``cd DIR`` applies to the lines after it; ``\\`` and synopsis lines that start with ``[``
  or ``-`` continue a command. A command holding ``[``, ``|``, ``...``, ``<x>`` or an
  upper-case placeholder is a *synopsis*. Lines after a ``$ `` command, up to the next
  ``$`` or the block's end, are the output it shows.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIPPED = (".py", ".md", ".sh", ".txt", ".toml", ".yaml", ".yml")
GT_COMMAND = re.compile(r"gridtrain\s+(?:run|topo|estimate)\b[^)`#\n]*")
DEFINES = re.compile(r"#\s*(?:config:\s*)?([\w.-]+\.(?:py|ya?ml))\b")
PLACEHOLDER = re.compile(r"\[|\||\.\.\.|…|<\w+>|(?<![\w-])[A-Z][A-Z0-9_]*(?![\w=])")


@dataclass
class Command:
    doc: str
    line: int
    argv: list[str]
    cwd: Path
    synopsis: bool
    shown: list[str] = field(default_factory=list)  # output lines shown after a `$ ` prompt


@dataclass
class PathRef:
    doc: str
    line: int
    token: str
    context: Path | None  # the last path named earlier in the paragraph


@dataclass
class Doc:
    name: str
    text: str
    base: Path  # the document's directory
    markdown: bool = True
    defined: dict[str, str] = field(default_factory=dict)
    commands: list[Command] = field(default_factory=list)
    paths: list[PathRef] = field(default_factory=list)


def expand_braces(token: str) -> list[str]:
    m = re.search(r"\{([^{}]*,[^{}]*)\}", token)
    if not m:
        return [token]
    return [
        out
        for alt in m.group(1).split(",")
        for out in expand_braces(token[: m.start()] + alt + token[m.end() :])
    ]


def is_synopsis(argv: list[str]) -> bool:
    return bool(PLACEHOLDER.search(" ".join(argv[1:])))


def _split(text: str) -> list[str] | None:
    try:
        return shlex.split(text)
    except ValueError:
        return None


def _is_path_token(token: str, doc: Doc) -> bool:
    if token.startswith(("/", "./", "~", "$", "-")) or "://" in token:
        return False
    head = token.split("/")[0]
    folder = "/" in token and ((REPO / head).is_dir() or (doc.base / head).is_dir())
    if not doc.markdown:
        return folder
    named_file = token.endswith(SHIPPED) and re.search(r"[\w>}*]\.\w+$", token)
    return bool(folder or named_file or re.fullmatch(r"[\w.-]+/", token))


def _path_tokens(text: str, doc: Doc) -> list[str]:
    text = re.sub(r"\"[^\"]*\"|'[^']*'", " ", text)  # strings in code: the user's arguments
    out = []
    for token in re.findall(r"[\w$~./<>{},*+-]+", text):
        token = token.rstrip(".,")
        parts = [token] if "{" in token else [t for t in token.split(",") if t]
        out += [t for t in parts if _is_path_token(t, doc)]
    return out


def _command_start(words: list[str]) -> int | None:
    """Index of the program in ``words`` (after VAR=value prefixes), if it is one we check."""
    i = 0
    while i < len(words) and re.match(r"^[A-Z_][A-Z0-9_]*=", words[i]):
        i += 1
    if i == len(words):
        return None
    word, rest = words[i], words[i + 1 :]
    if word == "python":  # a script of ours; `python -m ...` runs someone else's
        return i if rest and rest[0].endswith(".py") else None
    if word in ("gridtrain", "make"):
        return i if rest else None
    return i if "/" in word and word.endswith(".sh") and (REPO / word).is_file() else None


def _add_command(doc: Doc, text: str, line: int, cwd: Path) -> bool:
    words = _split(text.strip())
    start = _command_start(words) if words else None
    if start is None:
        return False
    argv = words[start:]
    doc.commands.append(Command(doc.name, line, argv, cwd, is_synopsis(argv)))
    return True


def _scan_block(doc: Doc, lines: list[str], first_line: int, shell: bool) -> None:
    header = DEFINES.match(lines[0].strip()) if lines else None
    if header and not lines[0].strip().startswith("#!"):
        body = list(itertools.takewhile(lambda s: not s.startswith("$ "), lines[1:]))
        doc.defined[header.group(1)] = "\n".join(body).rstrip() + "\n"
    cwd, i, prompt = REPO, 0, None  # commands name paths from the repository root
    while i < len(lines):
        raw, n = lines[i], first_line + i
        if prompt is not None and not raw.startswith("$ "):
            prompt.shown += [raw] if raw.strip() else []
            i += 1
            continue
        comment_only = raw.lstrip().startswith("#")
        code, _, comment = ("", "", raw) if comment_only else raw.partition(" #")
        for m in GT_COMMAND.finditer(comment):  # commands quoted in comments
            _add_command(doc, m.group(0), n, cwd)
        i += 1
        if not shell or not code.strip():
            continue
        text = code.strip()
        is_prompt = text.startswith("$ ")
        text = text.removeprefix("$ ")
        while i < len(lines) and (
            text.endswith("\\") or re.match(r"^\s+[\[-]", lines[i]) and not is_prompt
        ):
            text = text.rstrip("\\") + " " + lines[i].partition(" #")[0].strip()
            i += 1
        words = _split(text)
        if words and words[0] == "cd" and len(words) == 2:
            cwd = (cwd / words[1]).resolve()
            continue
        if _add_command(doc, text, n, cwd) and is_prompt:
            prompt = doc.commands[-1]
        elif is_prompt:
            prompt = None


def _scan_paragraph(doc: Doc, text: str, first_line: int) -> None:
    context = None
    for m in re.finditer(r"`([^`]+)`", text):
        span, line = m.group(1).replace("\n", " "), first_line + text[: m.start()].count("\n")
        if span.lstrip().startswith("-"):
            continue  # an option and its value: the user's
        words = _split(span)
        if words and _command_start(words) is not None:
            _add_command(doc, span, line, REPO)
            continue
        for token in _path_tokens(span, doc):
            doc.paths.append(PathRef(doc.name, line, token, context))
            found = resolve(token, doc, context)
            if found:
                context = found[0]


def scan_markdown(doc: Doc) -> Doc:
    lines = doc.text.split("\n")
    i, para, para_start = 0, [], 0

    def flush():
        if para:
            _scan_paragraph(doc, "\n".join(para), para_start)
        para.clear()

    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            flush()
            lang, j = line[3:].strip(), i + 1
            while not lines[j].startswith("```"):
                j += 1
            _scan_block(doc, lines[i + 1 : j], i + 2, shell=lang in ("", "bash", "sh", "console"))
            i = j + 1
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()) and not para:
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            _scan_block(doc, [s[4:] for s in lines[i:j]], i + 1, shell=True)
            i = j
        else:
            if not line.strip():
                flush()
            else:
                para_start = para_start if para else i + 1
                para.append(line)
            i += 1
    flush()
    return doc


def scan_help(doc: Doc) -> Doc:
    lines, i = doc.text.split("\n"), 0
    while i < len(lines):
        line, n = lines[i].strip(), i + 1
        i += 1
        if line.startswith("gridtrain "):
            while line.endswith("\\") and i < len(lines):
                line, i = line[:-1] + " " + lines[i].strip(), i + 1
            _add_command(doc, line, n, REPO)
        elif not line.startswith("usage"):
            doc.paths += [PathRef(doc.name, n, t, None) for t in _path_tokens(line, doc)]
    return doc


def resolve(token: str, doc: Doc, context: Path | None, cwd: Path | None = None) -> list[Path]:
    """The files ``token`` names (several for braces or placeholders), or [] if none exists."""
    near = [context, context.parent] if context is not None else []  # inside it, or beside it
    roots = [r for r in (cwd, doc.base, REPO, *near) if r is not None and r.is_dir()]
    found = []
    for name in expand_braces(token):
        pattern = re.sub(r"<\w+>", "*", name)
        hits = []
        for root in roots:
            if "*" in pattern:
                hits = sorted(root.glob(pattern))
            elif (root / pattern).exists():
                hits = [root / pattern]
            if hits:
                break
        if not hits:
            return []
        found += hits
    return found
