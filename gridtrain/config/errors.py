"""The config's error type and the words of its messages: quoted values and "did you mean".

Every message names the key, quotes the refused value (cut short: a value can be a huge
YAML alias or a generated list) and, for a misspelt name, suggests the closest allowed one.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

QUOTE_CHARS = 200  # the most characters of a refused value an error quotes
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 160
_QUOTE.maxlist = _QUOTE.maxtuple = _QUOTE.maxdict = _QUOTE.maxset = 8
_QUOTE.maxlevel = 3


class ConfigError(ValueError):
    """A config that cannot run; the message names the key, the value and what is allowed."""


def quote(value: Any) -> str:
    """``repr(value)`` cut to about ``QUOTE_CHARS`` characters (without ever building it whole)."""
    text = _QUOTE.repr(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."


def closest(word: Any, allowed: Iterable[str]) -> str | None:
    """The allowed name closest to ``word``, if one is close enough to be a misspelling.

    Only the first ``QUOTE_CHARS`` characters are compared, so a huge value stays fast.
    """
    close = difflib.get_close_matches(str(word)[:QUOTE_CHARS], list(allowed), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: Any, allowed: Iterable[str]) -> str:
    """`` — did you mean 'x'?`` for the closest allowed name, or nothing."""
    close = closest(word, allowed)
    return f" — did you mean '{close}'?" if close else ""


def unknown(what: str, name: Any, allowed: Iterable[str]) -> str:
    """``what`` followed by the refused name, the closest allowed one and all of them, e.g.
    ``unknown key 'paralel' — did you mean 'parallel'? (allowed: ...)``."""
    allowed = list(allowed)
    return f"{what} {quote(name)}{did_you_mean(name, allowed)} (allowed: {', '.join(allowed)})"


def unknown_key(key: Any, allowed: list[str]) -> str:
    """The message for a key no section knows: the key, the closest one, and all of them."""
    return unknown("unknown key", key, sorted(allowed))


def explain(err: ValidationError) -> str:
    """pydantic's errors as one line per key: where, what is wrong, and the value refused."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        where = f"key '{loc}': " if loc else ""
        got = ""
        if e["type"] not in ("value_error", "missing"):
            got = f" (got {quote(e['input'])}{_type_hint(e['input'])})"
        lines.append(f"{where}{msg}{got}")
    return "invalid config: " + "; ".join(lines)


def _type_hint(value: Any) -> str:
    """Why a value of the right look was refused: a bool is not a number, nor is "1e-3"."""
    if isinstance(value, bool):
        return ", a bool"
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return ", a string; write numbers unquoted (YAML reads 1e-3 as a string: write 1.0e-3)"
    return ""
