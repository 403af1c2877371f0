"""Where a launcher's own options end: everything after the script belongs to the script.

argparse reads every token that starts with ``-`` as an option of its own, abbreviations
included, even after a positional that takes the rest (``nargs=REMAINDER``): ``gridtrain run
--config c.py train.py --n 5`` stopped with "ambiguous option: --n could match
--nproc_per_node, --nnodes", and torchrun took the script's ``--d 256`` for one of its own.
So a command line is cut at the script first and only the part before it is parsed;
the rest reaches the script exactly as typed (a ``--`` included).
"""

from __future__ import annotations

SEPARATOR = "--"  # what `gridtrain run` puts before the script in the launcher's command


def split_at_script(argv: list[str], flags: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(``argv`` up to and including the script, the script's arguments).

    The script is the first token that is neither an option nor an option's value. ``flags``
    are the parser's options that take no value (``--dry-run``, ``--help``, and what
    abbreviates them); every other option written without ``=`` takes the next token. After
    a ``--`` the next token is the script."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == SEPARATOR:
            return argv[: i + 2], argv[i + 2 :]
        if not token.startswith("-") or token == "-":
            return argv[: i + 1], argv[i + 1 :]
        i += 1 if "=" in token or _is_flag(token, flags) else 2
    return list(argv), []


def _is_flag(token: str, flags: tuple[str, ...]) -> bool:
    if token in flags:
        return True
    return token.startswith("--") and len(token) > 2 and any(f.startswith(token) for f in flags)


def after_separator(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """For the launcher's own command (``OPTIONS -- SCRIPT ARGS``): (``OPTIONS SCRIPT``,
    ``ARGS``), or None where there is no ``--`` (torchrun's syntax as typed by hand)."""
    if SEPARATOR not in argv:
        return None
    i = argv.index(SEPARATOR)
    if i + 1 >= len(argv):
        return None
    return [*argv[:i], argv[i + 1]], argv[i + 2 :]


__all__ = ["SEPARATOR", "after_separator", "split_at_script"]
