"""DCP's ``.metadata`` read as data: nothing the file names is called, no attribute is looked up.

DCP writes ``.metadata`` with plain ``pickle`` (protocol 4). torch's ``weights_only`` unpickler
cannot read it (it lacks the STACK_GLOBAL, MEMOIZE and FRAME opcodes), and handing DCP's own
classes to any unpickler lets a file's BUILD set attributes on shared objects (an enum member,
a class). So a file is read in two steps, by hand:

1. decode: ``find_class`` answers each allowed name with a record type private to this load;
   calling it, NEWOBJ and BUILD only store their arguments in a record. Any other name is
   refused, ``getattr`` included, so no method of anything is ever reached.
2. rebuild: each record becomes the real object by value, field by field, each field's type
   checked (``torch.Size`` from ints, an enum member from its value, a path from strings), so
   DCP receives exactly its metadata classes holding exactly the types it expects.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from gridtrain.engine.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
# the dataclasses DCP pickles as NEWOBJ + BUILD(state dict)
DATACLASSES: dict[tuple[str, str], type] = {
    (_MD, "Metadata"): dcp_md.Metadata,
    (_MD, "TensorStorageMetadata"): dcp_md.TensorStorageMetadata,
    (_MD, "BytesStorageMetadata"): dcp_md.BytesStorageMetadata,
    (_MD, "ChunkStorageMetadata"): dcp_md.ChunkStorageMetadata,
    (_MD, "MetadataIndex"): dcp_md.MetadataIndex,
    (_MD, "StorageMeta"): dcp_md.StorageMeta,
    (_FS, "_StorageInfo"): dcp_fs._StorageInfo,
}
_PATHS = {
    ("pathlib", "PosixPath"): PurePosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib._local", "PosixPath"): PurePosixPath,  # Python >= 3.13
    ("pathlib", "WindowsPath"): PureWindowsPath,
    ("pathlib", "PureWindowsPath"): PureWindowsPath,
    ("pathlib._local", "WindowsPath"): PureWindowsPath,
}
_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
_LAYOUTS = {"torch.strided": torch.strided}  # DCP stores dense tensors only
PROPERTIES, MEM_FORMAT = (_MD, "TensorProperties"), (_MD, "_MEM_FORMAT_ENCODING")
SIZE, LAYOUT = ("torch", "Size"), ("torch.serialization", "_get_layout")
ALLOWED = {*DATACLASSES, *_PATHS, PROPERTIES, MEM_FORMAT, SIZE, LAYOUT}
ALLOWED |= {("torch", name) for name in _DTYPES}
MemFormat = dcp_md._MEM_FORMAT_ENCODING
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # DCP's own: __<rank>_<n>.distcp


class _Record:
    """One use of an allowed name: the arguments it was called with, the state BUILD gave it."""

    key: tuple[str, str] = ("", "")

    def __new__(cls, *args: Any) -> _Record:
        record = object.__new__(cls)
        record.args, record.state = args, None
        return record

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Refused(pickle.UnpicklingError):
    pass


class _Decoder(pickle.Unpickler):
    def __init__(self, file) -> None:
        super().__init__(file)
        self.types: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        key = (module, name)
        if key not in ALLOWED:
            raise _Refused(f"it names {module}.{name}, which is not DCP metadata")
        if key not in self.types:  # fresh per load: nothing the file does outlives it
            self.types[key] = type(f"Record[{name}]", (_Record,), {"key": key})
        return self.types[key]

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it holds a persistent id, which DCP metadata never does")


# ---- rebuilding by value ----------------------------------------------------------------------
def _int(v: Any) -> bool:
    return type(v) is int and 0 <= v < 2**63


def _opt(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _is(*types: type) -> Callable[[Any], bool]:
    return lambda v: type(v) in types


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: type(v) in (list, tuple) and all(check(x) for x in v)


def _dict_of(key: Callable[[Any], bool], value: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: type(v) is dict and all(key(k) and value(x) for k, x in v.items())


_str, _size = _is(str), _is(torch.Size)
SCHEMA: dict[type, dict[str, Callable[[Any], bool]]] = {
    dcp_md.Metadata: {
        "state_dict_metadata": _dict_of(
            _str, _is(dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata)
        ),
        "planner_data": _opt(_dict_of(_str, _list_of(lambda x: type(x) in (str, int)))),
        "storage_data": _dict_of(_is(dcp_md.MetadataIndex), _is(dcp_fs._StorageInfo)),
        "storage_meta": _opt(_is(dcp_md.StorageMeta)),
        "version": _opt(_str),
    },
    dcp_md.TensorStorageMetadata: {
        "properties": _is(dcp_md.TensorProperties),
        "size": _size,
        "chunks": _list_of(_is(dcp_md.ChunkStorageMetadata)),
    },
    dcp_md.BytesStorageMetadata: {},
    dcp_md.ChunkStorageMetadata: {"offsets": _size, "sizes": _size},
    dcp_md.MetadataIndex: {"fqn": _str, "offset": _opt(_size), "index": _opt(_int)},
    dcp_md.StorageMeta: {
        "checkpoint_id": _opt(_is(str, PurePosixPath, PureWindowsPath)),
        "save_id": _opt(_str),
        "load_id": _opt(_str),
        "modules": _list_of(_str),
    },
    dcp_fs._StorageInfo: {
        "relative_path": lambda v: type(v) is str and _FILE_NAME.fullmatch(v) and ".." not in v,
        "offset": _int,
        "length": _int,
        "transform_descriptors": lambda v: v is None or v == [] or v == (),  # gridtrain: none
    },
}


def _dataclass(cls: type, record: _Record, build: Callable[[Any], Any]) -> Any:
    state = {} if record.state is None else record.state
    if record.args or type(state) is not dict:
        raise ValueError(f"{cls.__name__} is not built from a field dict")
    schema = SCHEMA[cls]
    fields = {}
    for name, value in state.items():
        if name not in schema:
            raise ValueError(f"{cls.__name__} has no field {str(name)[:80]!r}")
        fields[name] = build(value)
        if not schema[name](fields[name]):
            raise ValueError(f"{cls.__name__}.{name} holds a {type(fields[name]).__name__}")
    return cls(**fields)


def _properties(record: _Record, build: Callable[[Any], Any]) -> dcp_md.TensorProperties:
    state = tuple(build(x) for x in record.state) if type(record.state) is tuple else ()
    checks = (_is(torch.dtype), _is(torch.layout), _is(bool), _is(MemFormat), _is(bool))
    if record.args or len(state) != 5 or not all(c(v) for c, v in zip(checks, state)):
        raise ValueError("TensorProperties is not (dtype, layout, bool, memory format, bool)")
    props = dcp_md.TensorProperties.__new__(dcp_md.TensorProperties)
    props.__setstate__(state)  # DCP's own decoding of its memory-format enum
    return props


def _call(record: _Record, build: Callable[[Any], Any]) -> Any:
    """A record that the file called (REDUCE), rebuilt from its plain arguments."""
    args = tuple(build(a) for a in record.args)
    if record.state is not None:
        raise ValueError(f"{record.key[1]} takes no state")
    if record.key == SIZE and len(args) == 1 and _list_of(_int)(args[0]):
        return torch.Size(args[0])
    if record.key == LAYOUT and len(args) == 1 and args[0] in _LAYOUTS:
        return _LAYOUTS[args[0]]
    if record.key == MEM_FORMAT and len(args) == 1 and type(args[0]) is int:
        return MemFormat(args[0])  # the member by value (ValueError if none)
    if record.key in _PATHS and args and all(type(a) is str for a in args):
        return _PATHS[record.key](*args)  # a pure path: no method of it touches the disk
    raise ValueError(f"{record.key[1]} called with {len(args)} unexpected argument(s)")


class _Builder:
    """Turns the decoded tree into real objects, each record once (a shared one stays shared)."""

    def __init__(self) -> None:
        self.done: dict[int, Any] = {}
        self.busy: set[int] = set()

    def __call__(self, value: Any) -> Any:
        if value is None or type(value) in (bool, int, float, str, bytes):
            return value
        key = id(value)
        if key in self.done:
            return self.done[key]
        if key in self.busy:
            raise ValueError("it refers to itself")
        self.busy.add(key)
        self.done[key] = out = self._build(value)
        self.busy.discard(key)
        return out

    def _build(self, value: Any) -> Any:
        if type(value) is list:
            return [self(x) for x in value]
        if type(value) is tuple:
            return tuple(self(x) for x in value)
        if type(value) is dict:
            return {self(k): self(v) for k, v in value.items()}
        if isinstance(value, type) and issubclass(value, _Record) and value.key[0] == "torch":
            if value.key[1] in _DTYPES:  # a dtype named as a value
                return _DTYPES[value.key[1]]
        if isinstance(value, _Record):
            if value.key in DATACLASSES:
                return _dataclass(DATACLASSES[value.key], value, self)
            if value.key == PROPERTIES:
                return _properties(value, self)
            return _call(value, self)
        raise ValueError(f"it holds a {type(value).__name__} where DCP metadata has none")


def load_metadata(file, what: str) -> dcp_md.Metadata:
    """Read DCP's ``Metadata`` from the binary ``file``; anything else is refused by name."""
    try:
        decoded = _Decoder(file).load()
    except _Refused as err:
        raise UnsafeCheckpointError(
            f"refusing to load {what}: {err}; nothing it names was run"
        ) from None
    except Exception as err:  # noqa: BLE001 - any failure to decode is a damaged file
        raise CorruptCheckpointError(
            f"{what}: its .metadata cannot be decoded ({type(err).__name__}: {err})"
        ) from None
    try:
        metadata = _Builder()(decoded)
    except (ValueError, TypeError, RecursionError) as err:
        raise CorruptCheckpointError(f"{what}: its .metadata is not DCP metadata: {err}") from None
    if type(metadata) is not dcp_md.Metadata:
        raise CorruptCheckpointError(f"{what}: its .metadata does not hold DCP's Metadata")
    return metadata


__all__ = ["ALLOWED", "SCHEMA", "load_metadata"]
