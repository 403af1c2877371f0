"""Reading a config file into a dict: a ``.py`` file's module globals, or YAML through a
strict safe loader. ``Config.from_file`` validates what comes back.

Every failure, whatever the config's own code raises included, is a ``ConfigError`` that
names the file (and the line, where there is one).
"""

from __future__ import annotations

import runpy
import traceback
import types
from pathlib import Path
from typing import Any

import yaml

from gridtrain.config.errors import ConfigError, quote

MAX_ALIAS_VALUES = 10_000  # values that aliases may repeat, all together: configs need few


def read_config_file(path: Path) -> dict[str, Any]:
    """The keys a ``.py``, ``.yaml`` or ``.yml`` config file sets, unvalidated."""
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    if path.suffix == ".py":
        return {
            k: v
            for k, v in _run_config(path).items()
            if not k.startswith("_")
            and not isinstance(v, types.ModuleType | types.FunctionType | type)
        }
    if path.suffix in (".yaml", ".yml"):
        data = _load_yaml(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file '{path}' must hold a mapping, got {type(data).__name__}"
            )
        return data
    raise ConfigError(f"config file '{path}' must end in .py, .yaml or .yml")


def _run_config(path: Path) -> dict[str, Any]:
    """A ``.py`` config's globals; whatever it raises (``sys.exit`` too) becomes a ConfigError."""
    try:
        return runpy.run_path(str(path))
    except (Exception, SystemExit) as err:  # noqa: BLE001 - a config is user code
        lines = [
            f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == str(path)
        ]
        where = f" at line {lines[-1]}" if lines else ""
        raise ConfigError(
            f"config file '{path}' raised {quote(err)}{where} while loading; a config must only "
            "assign its keys"
        ) from None


class _YamlError(Exception):
    """A refusal of ``StrictYamlLoader``'s own, reported without YAML's parser context."""


class StrictYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses duplicate keys (the first would be dropped silently)
    and aliases that repeat more than ``MAX_ALIAS_VALUES`` values (a few hundred bytes of
    nested aliases expand to billions, and every walk over them, an error's quote too, takes
    as long)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}
        self._repeated = 0

    def _size(self, node: yaml.Node) -> int:
        if id(node) not in self._sizes:  # a node may appear many times; count it once here
            children = node.value if isinstance(node, yaml.SequenceNode) else []
            if isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            self._sizes[id(node)] = 1 + sum(self._size(child) for child in children)
        return self._sizes[id(node)]

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:
                self._repeated += self._size(node)
                if self._repeated > MAX_ALIAS_VALUES:
                    raise _YamlError(
                        f"the alias *{quote(event.anchor)[1:-1]} at line "
                        f"{event.start_mark.line + 1} makes aliases repeat more than "
                        f"{MAX_ALIAS_VALUES} values; write the values out"
                    )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # '<<' merges are meant to be overridden
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.setdefault(key, line)
                except TypeError:
                    continue  # unhashable: the constructor itself refuses it
                if first != line:
                    raise _YamlError(
                        f"duplicate key {quote(key)} at line {line} (first at line {first}); "
                        "YAML would keep only the last"
                    )
        return super().construct_mapping(node, deep)


def _load_yaml(path: Path) -> Any:
    """``path``'s YAML through ``StrictYamlLoader``; every failure a ``ConfigError``."""
    try:
        return yaml.load(path.read_text(), Loader=StrictYamlLoader)  # noqa: S506 - safe loader
    except _YamlError as err:
        raise ConfigError(f"config file '{path}': {err}") from None
    except (yaml.YAMLError, RecursionError) as err:
        text = str(err)
        text = text if len(text) <= 400 else text[:400] + "..."
        raise ConfigError(f"config file '{path}' is not valid YAML: {text}") from None
