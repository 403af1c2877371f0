"""`gridtrain topo` at scale: the summary's counts and strides against the real group lists,
its size bounded at any world size, `--rank R` and `--full`."""

import re

import pytest

import gridtrain as gt
from gridtrain.cli.main import main
from gridtrain.parallel.topology import build_groups
from gridtrain.parallel.topology_views import stride_axes

LAYOUTS = {
    "dp.py": ("", 64),
    "pp2_1d.py": ('parallel = dict(pipeline=2, tensor=dict(size=2, mode="1d"))', 64),
    "pp2_2d.py": ('parallel = dict(pipeline=2, tensor=dict(size=4, mode="2d"))', 64),
    "2p5d.py": ('parallel = dict(tensor=dict(size=8, mode="2.5d", depth=2))', 64),
    "pp4_3d.py": ('parallel = dict(pipeline=4, tensor=dict(size=8, mode="3d"))', 1024),
    "3d27.py": ('parallel = dict(tensor=dict(size=27, mode="3d"))', 54),
    "seq.py": ('parallel = dict(pipeline=2, tensor=dict(size=2, mode="sequence"))', 32),
    "moe.py": ("parallel = dict(pipeline=2)\nmoe = dict(expert_parallel_size=4)", 64),
}
ROW = re.compile(r"^([A-Z0-9_]+)\s+(\d+)\s+(\d+)\s+(.*?)\s+(\[[\d,.]*\])$")


@pytest.fixture
def configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, (text, _) in LAYOUTS.items():
        (tmp_path / name).write_text(text + "\n")
    return tmp_path


def topo(capsys, name, world, *extra):
    assert main(["topo", "--config", name, "--world-size", str(world), *extra]) == 0
    return capsys.readouterr().out


def parse_axes(text):
    """'stride 8' -> [(8, None)]; 'stride 1 x2, stride 4 x2' -> [(1, 2), (4, 2)]; '-' -> []."""
    if text == "-":
        return []
    return [
        (int(s), int(n) if n else None) for s, n in re.findall(r"stride (-?\d+)(?: x(\d+))?", text)
    ]


def lattice(first, axes, size):
    ranks = [first]
    for stride, count in axes:
        count = count if count is not None else size  # one axis: the whole group
        ranks = [r + i * stride for i in range(count) for r in ranks]
    return ranks


@pytest.mark.parametrize("name", LAYOUTS)
def test_summary_numbers_match_the_group_lists(configs, capsys, name):
    world = LAYOUTS[name][1]
    out = topo(capsys, name, world)
    groups = build_groups(gt.Config.from_file(name), world)
    rows = {m.group(1): m for m in map(ROW.match, out.splitlines()) if m}
    assert set(rows) == {mode.name for mode in groups}, "one summary row per mode"
    for mode, parts in groups.items():
        row = rows[mode.name]
        assert int(row.group(2)) == len(parts), mode.name
        assert int(row.group(3)) == len(parts[0]), mode.name
        axes = parse_axes(row.group(4))
        for g in parts:  # every group is the printed lattice from its own first rank
            assert lattice(g[0], axes, len(g)) == list(g), (mode.name, g, row.group(4))
        example = [int(x) for x in re.findall(r"\d+", row.group(5))]
        rank0 = next(g for g in parts if 0 in g)
        shown = example if "..." not in row.group(5) else example[:-1]
        assert list(rank0[: len(shown)]) == shown and rank0[-1] == example[-1], mode.name


def test_summary_size_is_bounded(configs, capsys):
    sizes = {world: len(topo(capsys, "pp4_3d.py", world)) for world in (64, 1024, 8192)}
    full = len(topo(capsys, "pp4_3d.py", 1024, "--full"))
    assert sizes[1024] < 2500, "a few lines at 1024 ranks"
    assert sizes[8192] - sizes[64] < 100, "grows only by the digits of larger ranks"
    assert full > 20 * sizes[1024], "the full listing is what the summary replaces"


@pytest.mark.parametrize("name,rank", [("pp4_3d.py", 37), ("2p5d.py", 63), ("seq.py", 5)])
def test_rank_lists_each_group_of_that_rank(configs, capsys, name, rank):
    world = LAYOUTS[name][1]
    out = topo(capsys, name, world, "--rank", str(rank))
    groups = build_groups(gt.Config.from_file(name), world)
    seen = {}
    for line in out.splitlines():
        m = re.match(r"^([A-Z0-9_]+)\s+(\d+) of (\d+)\s+\[([\d,-]*)\]$", line)
        if m:
            ranks = []
            for part in m.group(4).split(","):
                lo, _, hi = part.partition("-")
                ranks += range(int(lo), int(hi or lo) + 1)
            assert rank in ranks and ranks.index(rank) == int(m.group(2)), line
            assert len(ranks) == int(m.group(3)), line
            seen[m.group(1)] = tuple(ranks)
    expected = {mode.name: next(g for g in parts if rank in g) for mode, parts in groups.items()}
    assert seen == expected


def test_full_is_every_group(configs, capsys):
    out = topo(capsys, "pp2_2d.py", 16, "--full")
    groups = build_groups(gt.Config.from_file("pp2_2d.py"), 16)
    listed = {}
    for line in out.splitlines()[2:]:
        listed[line.split()[0]] = [
            tuple(map(int, g.split(","))) for g in re.findall(r"\[([\d,]+)\]", line)
        ]
    assert listed == {mode.name: parts for mode, parts in groups.items()}
    assert "[0,1] [2,3] [4,5] [6,7]" in out  # PARALLEL_2D_ROW of the first stage blocks


def test_rank_out_of_range_and_views_exclusive(configs, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["topo", "--config", "dp.py", "--world-size", "4", "--rank", "4"])
    assert stop.value.code == 2 and "--rank must be in [0, 4), got 4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["topo", "--config", "dp.py", "--world-size", "4", "--rank", "1", "--full"])
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_stride_axes_merges_runs_and_refuses_irregular_groups():
    assert stride_axes((0, 1, 2, 3)) == [(1, 4)]
    assert stride_axes((0, 1, 4, 5, 8, 9, 12, 13)) == [(1, 2), (4, 4)]
    assert stride_axes((3, 1)) == [(-2, 2)]
    assert stride_axes((0, 1, 3)) is None
    assert stride_axes((0, 1, 5, 7)) is None
