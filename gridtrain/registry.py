"""A name -> entry table that code outside gridtrain may extend: the tensor modes, the plan
styles and the Hugging Face families each keep one. A leaf: it imports nothing, so the
torch-free config and geometry can hold one."""

from __future__ import annotations

from typing import Any


class Registry(dict):
    """``name -> entry``, with the rules every registry here shares: registering a name again
    with another entry is an error unless replaced on purpose, and a built-in entry stays."""

    def __init__(self, what: str, override_hint: str = ""):
        super().__init__()
        self.what, self.override_hint = what, override_hint
        self.built_in: set = set()

    def add(self, name: Any, entry: Any, replace: bool = False, built_in: bool = False) -> Any:
        """Register ``entry`` under ``name``; returns it."""
        known = self.get(name)
        if known is not None and known != entry and not replace:
            raise ValueError(
                f"{self.what} {name!r} is already registered as {known!r}{self.override_hint}"
            )
        self[name] = entry
        if built_in:
            self.built_in.add(name)
        return entry

    def remove(self, name: Any, keep_built_in: bool = True) -> None:
        """Forget ``name`` (a test's or a plugin's entry); a built-in one only where
        ``keep_built_in`` is off."""
        if keep_built_in and name in self.built_in:
            raise ValueError(f"{self.what} {name!r} is built in")
        self.pop(name, None)
