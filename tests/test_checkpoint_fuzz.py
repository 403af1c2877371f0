"""Fuzzing the checkpoint loaders (issue 28, "checkpoint loading admits data only").

1. Every global the ``.metadata`` reader admits, combined with every operation a pickle can
   apply to it (push it, call it, NEWOBJ it, BUILD an instance or the class itself, pass
   another admitted global to it) and with ``getattr`` on it: each load ends in DCP's
   ``Metadata`` or a ``CheckpointError``, and none has a side effect: no file appears, no
   admitted class, enum member or module changes.
2. Real checkpoints (dense and sharded, written by ``gt.save_checkpoint``) with a byte flipped
   or cut short anywhere: each load fails with a ``CheckpointError`` naming the checkpoint.
   The loads run in a pooled worker process, so a crash would fail the test too. ``.metadata``
   flips whose CRC-32 an attacker forged reach the decoder itself: no crash, no foreign error.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import random
import shutil
from pathlib import Path

import torch
from helpers.checkpoint_forge import forge_marker
from helpers.harness import run_distributed
from torch.distributed.checkpoint.metadata import Metadata

import gridtrain as gt
from gridtrain.engine.checkpoint import dcp_metadata as md

TIMEOUT = 300
STOP, REDUCE, NEWOBJ, BUILD = pickle.STOP, pickle.REDUCE, pickle.NEWOBJ, pickle.BUILD


# ---- 1. every admitted global x every operation ---------------------------------------------
def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _value(value) -> bytes:
    """Pickle opcodes that push ``value`` (protocol 0: no header, STOP dropped)."""
    return pickle.dumps(value, protocol=0)[:-1]


def _tuple_of(*parts: bytes) -> bytes:
    return pickle.MARK + b"".join(parts) + pickle.TUPLE


def _real(key: tuple[str, str]):
    try:
        return getattr(importlib.import_module(key[0]), key[1])
    except (ImportError, AttributeError):
        return None  # pathlib._local exists from Python 3.13


def _snapshot() -> dict:
    """Everything a pickle could have changed: each admitted object's attributes (an enum's
    members' too), and the modules that define them."""
    out = {}
    for key in md.ALLOWED:
        obj = _real(key)
        if obj is None:
            continue
        if isinstance(obj, type):
            out[key] = dict(vars(obj))
            for member in getattr(obj, "__members__", {}).values():
                out[(*key, member.name)] = dict(vars(member))
        else:
            out[key] = (repr(obj), obj)
        out[(key[0],)] = dict(vars(importlib.import_module(key[0])))
    return out


def _cases(sandbox: Path) -> list[tuple[str, bytes]]:
    keys = sorted(md.ALLOWED)
    created = str(sandbox / "created.pth")
    args = [
        _tuple_of(),
        _tuple_of(_value(created)),
        _tuple_of(_value(created), _value("import os")),
        _tuple_of(_value(0)),
        _tuple_of(_value(("torch.strided",))),
    ]
    states = [
        _value({"x": 1, "__class__": 1}),
        _tuple_of(_value(None), _value({"__init__": 1, "__reduce__": 1, "name": "x"})),
    ]
    cases = []
    for i, key in enumerate(keys):
        g = _global(*key)
        other = _global(*keys[(i + 1) % len(keys)])
        cases.append((f"{key} pushed", g))
        for a in [*args, _tuple_of(other), _tuple_of(other, _value(created))]:
            cases.append((f"{key} called", g + a + REDUCE))
            cases.append((f"{key} NEWOBJ", g + a + NEWOBJ))
        for s in states:
            cases.append((f"{key} instance BUILD", g + _tuple_of() + NEWOBJ + s + BUILD))
            cases.append((f"{key} called, BUILD", g + args[1] + REDUCE + s + BUILD))
            cases.append((f"{key} class BUILD", g + s + BUILD))
        for attr in ("write_text", "__setattr__", "__init__", "mkdir", "__class__"):
            probe = _global("builtins", "getattr") + _tuple_of(g, _value(attr)) + REDUCE
            cases.append((f"getattr({key}, {attr!r})", probe))
            instance = g + args[1] + REDUCE  # e.g. PosixPath(created)
            call = _tuple_of(instance, _value("import os"))
            cases.append((f"getattr({key}, {attr!r})(...)", probe + call + REDUCE))
    return [(name, body + STOP) for name, body in cases]


def test_every_admitted_global_with_every_operation_has_no_side_effect(tmp_path, monkeypatch):
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    monkeypatch.chdir(sandbox)
    before = _snapshot()
    cases = _cases(sandbox)
    assert len(cases) > 300, len(cases)
    outcomes: dict[str, int] = {}
    for name, data in cases:
        try:
            result = md.load_metadata(io.BytesIO(data), "'fuzz'")
        except gt.CheckpointError as err:
            assert "'fuzz'" in str(err), (name, err)
            outcomes[type(err).__name__] = outcomes.get(type(err).__name__, 0) + 1
        else:
            assert type(result) is Metadata, (name, result)
            outcomes["Metadata"] = outcomes.get("Metadata", 0) + 1
        assert os.listdir(sandbox) == [], f"{name}: created {os.listdir(sandbox)}"
    after = _snapshot()
    changed = [k for k in before if before[k] != after[k]]
    assert changed == [], f"state changed: {changed}"
    assert outcomes.get("UnsafeCheckpointError", 0) >= 2 * 5 * len(md.ALLOWED), outcomes
    print(f"{len(cases)} crafted pickles: {outcomes}")


def test_the_plain_unpickler_would_have_run_them(tmp_path, monkeypatch):
    """The cases are live: plain pickle runs the getattr(PosixPath, 'write_text') one."""
    monkeypatch.chdir(tmp_path)
    cases = dict(_cases(tmp_path))
    data = cases["getattr(('pathlib', 'PosixPath'), 'write_text')(...)"]
    pickle.loads(data)
    assert (tmp_path / "created.pth").read_text() == "import os"


# ---- 2. damaged real checkpoints --------------------------------------------------------------
def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _save_both(ctx, directory):
    model, opt = _model_and_opt()
    gt.save_checkpoint(f"{directory}/dense.pt", 3, model, opt, extra={"step": 7})
    gt.save_checkpoint(f"{directory}/sharded", 3, model, opt, sharded=True, extra={"step": 7})


def _damage(path: Path, rng: random.Random, truncate: bool) -> str:
    data = bytearray(path.read_bytes())
    if truncate:
        cut = rng.randrange(len(data))
        path.write_bytes(bytes(data[:cut]))
        return f"{path.name} cut to {cut} of {len(data)} bytes"
    at = rng.randrange(len(data))
    data[at] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))
    return f"{path.name} byte {at} of {len(data)} flipped"


def _load(path: Path) -> tuple[str, str]:
    model, opt = _model_and_opt()
    try:
        epoch = gt.load_checkpoint(path, model, opt, extra={})
    except Exception as err:  # noqa: BLE001 - the test sorts them
        kind = "gridtrain" if isinstance(err, gt.CheckpointError) else "foreign"
        return kind, f"{type(err).__name__}: {err}"
    return "loaded", f"epoch {epoch}"


def _fuzz(ctx, directory, cases, seed):
    """Damage a copy of a pristine checkpoint, load it, note how it ended; many times."""
    directory, rng = Path(directory), random.Random(seed)
    out = []
    for fmt, truncate, forged in cases:
        work = directory / "work"
        shutil.rmtree(work, ignore_errors=True)
        pristine = directory / ("dense.pt" if fmt == "dense" else "sharded")
        target = work / pristine.name
        work.mkdir()
        if fmt == "dense":
            shutil.copy(pristine, target)
            victim = target
        else:
            shutil.copytree(pristine, target)
            names = [".metadata"] if forged else sorted(os.listdir(target))
            victim = target / rng.choice(names)
        what = _damage(victim, rng, truncate)
        if forged:
            forge_marker(target)
        kind, message = _load(target)
        out.append((fmt, forged, what, kind, message, str(target) in message))
    return out, _load(directory / "dense.pt"), _load(directory / "sharded")


def _case_list():
    plain = [("dense", t, False) for t in [False] * 90 + [True] * 30]
    plain += [("sharded", t, False) for t in [False] * 120 + [True] * 40]
    return plain, [("sharded", False, True)] * 60


def test_every_damaged_byte_of_a_real_checkpoint_fails_with_a_gridtrain_error(tmp_path):
    run_distributed(_save_both, 2, str(tmp_path), timeout=TIMEOUT)
    plain, forged = _case_list()
    results, dense_ok, sharded_ok = run_distributed(
        _fuzz, 1, str(tmp_path), plain + forged, 1234, timeout=TIMEOUT
    )[0]
    assert dense_ok == sharded_ok == ("loaded", "epoch 3"), "the pristine copies were left alone"
    bad = [r for r in results if not r[1] and (r[3] != "gridtrain" or not r[5])]
    assert bad == [], f"{len(bad)} of {len(plain)} damaged loads did not fail cleanly: {bad[:5]}"
    kinds = {r[4].split(":")[0] for r in results if not r[1]}
    assert kinds <= {"CorruptCheckpointError", "UnsafeCheckpointError"}, kinds
    # forged CRCs: the decoder sees the damage; any end but a foreign error or a crash is fine
    # (a changed digit in a path or an id loads the same tensors)
    foreign = [r for r in results if r[1] and r[3] == "foreign"]
    assert foreign == [], foreign[:5]
    ends = {k: sum(r[3] == k for r in results if r[1]) for k in ("gridtrain", "loaded")}
    print(f"{len(plain)} damaged loads refused; forged .metadata: {ends}")
