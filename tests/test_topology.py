"""The rank grid as plain lists: the DESIGN.md formula, partitions, and per-mode shapes."""

import itertools
import time

import pytest

import gridtrain as gt
from gridtrain.parallel.layout import Layout
from gridtrain.parallel.topology import build_groups
from gridtrain.parallel.topology_views import format_topology

PM = gt.ParallelMode

CASES = [
    (1, {}),
    (8, dict(parallel=dict(pipeline=2, tensor=dict(size=2, mode="1d")))),
    (16, dict(parallel=dict(pipeline=2, tensor=dict(size=4, mode="2d")))),
    (16, dict(parallel=dict(tensor=dict(size=8, mode="2.5d", depth=2)))),
    (16, dict(parallel=dict(tensor=dict(size=8, mode="3d")))),
    (16, dict(parallel=dict(pipeline=2, tensor=dict(size=2, mode="sequence")))),
    (16, dict(parallel=dict(pipeline=2), moe=dict(expert_parallel_size=4))),
]


def _coords(rank, P, T):
    return rank // (P * T), (rank // T) % P, rank % T


@pytest.mark.parametrize("world,config", CASES)
def test_every_mode_partitions_the_world(world, config):
    groups = build_groups(gt.Config.from_dict(config), world)
    for mode, parts in groups.items():
        flat = sorted(itertools.chain.from_iterable(parts))
        assert flat == list(range(world)), f"{mode.name} does not partition the world"
        assert len({len(g) for g in parts}) == 1, f"{mode.name} groups differ in size"


@pytest.mark.parametrize("world,config", CASES)
def test_groups_follow_the_grid_formula(world, config):
    cfg = gt.Config.from_dict(config)
    P, T = cfg.pipeline_size, cfg.tensor_size
    groups = build_groups(cfg, world)
    # axis groups: exactly one grid coordinate varies
    varying = {PM.DATA: 0, PM.PIPELINE: 1, PM.TENSOR: 2}
    for mode, axis in varying.items():
        for g in groups[mode]:
            cs = [_coords(r, P, T) for r in g]
            for a in range(3):
                assert len({c[a] for c in cs}) == (len(g) if a == axis else 1)
            assert [c[axis] for c in cs] == list(range(len(g))), "local rank = coordinate"
    for g in groups[PM.MODEL]:
        assert len({_coords(r, P, T)[0] for r in g}) == 1 and len(g) == P * T
    # tensor groups are runs of adjacent ranks (one NVLink island)
    for g in groups[PM.TENSOR]:
        assert list(g) == list(range(g[0], g[0] + T))


def test_sequence_dp_spans_a_whole_pipeline_stage():
    cfg = gt.Config.from_dict(dict(parallel=dict(pipeline=2, tensor=dict(size=2, mode="sequence"))))
    groups = build_groups(cfg, 8)  # data 2 x pipeline 2 x sequence 2
    assert sorted(groups[PM.SEQUENCE_DP]) == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert groups[PM.SEQUENCE] == groups[PM.TENSOR]


def test_2d_and_2p5d_axes():
    cfg = gt.Config.from_dict(dict(parallel=dict(tensor=dict(size=4, mode="2d"))))
    g = build_groups(cfg, 4)
    assert g[PM.PARALLEL_2D_ROW] == [(0, 1), (2, 3)] and g[PM.PARALLEL_2D_COL] == [(0, 2), (1, 3)]
    cfg = gt.Config.from_dict(dict(parallel=dict(tensor=dict(size=8, mode="2.5d", depth=2))))
    g = build_groups(cfg, 8)
    assert g[PM.PARALLEL_2P5D_ROW] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert g[PM.PARALLEL_2P5D_COL] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert g[PM.PARALLEL_2P5D_DEP] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert g[PM.PARALLEL_2P5D_XZ] == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_3d_axes_are_lines_and_planes_of_the_cube():
    cfg = gt.Config.from_dict(dict(parallel=dict(tensor=dict(size=8, mode="3d"))))
    g = build_groups(cfg, 8)  # t = k*4 + j*2 + i
    assert g[PM.PARALLEL_3D_INPUT][0] == (0, 1)
    assert g[PM.PARALLEL_3D_WEIGHT][0] == (0, 2)
    assert g[PM.PARALLEL_3D_OUTPUT][0] == (0, 4)
    assert g[PM.PARALLEL_3D_INPUT_X_WEIGHT][0] == (0, 1, 2, 3)
    assert g[PM.PARALLEL_3D_OUTPUT_X_WEIGHT][0] == (0, 2, 4, 6)
    assert g[PM.PARALLEL_3D_INPUT_X_OUTPUT][0] == (0, 1, 4, 5)


@pytest.mark.parametrize("size", [8, 27])
def test_3d_combined_groups_are_unions_of_their_named_axes(size):
    """INPUT_X_WEIGHT = the rank's INPUT and WEIGHT lines and everything they span (a plane);
    likewise OUTPUT_X_WEIGHT and INPUT_X_OUTPUT. The legacy engine's semantics."""
    cfg = gt.Config.from_dict(dict(parallel=dict(tensor=dict(size=size, mode="3d"))))
    g = build_groups(cfg, size)
    d = round(size ** (1 / 3))

    def group_of(mode, rank):
        (found,) = [grp for grp in g[mode] if rank in grp]
        return set(found)

    combined = {
        PM.PARALLEL_3D_INPUT_X_WEIGHT: (PM.PARALLEL_3D_INPUT, PM.PARALLEL_3D_WEIGHT),
        PM.PARALLEL_3D_OUTPUT_X_WEIGHT: (PM.PARALLEL_3D_OUTPUT, PM.PARALLEL_3D_WEIGHT),
        PM.PARALLEL_3D_INPUT_X_OUTPUT: (PM.PARALLEL_3D_INPUT, PM.PARALLEL_3D_OUTPUT),
    }
    for rank in range(size):
        for pair, (a, b) in combined.items():
            plane = group_of(pair, rank)
            line_a, line_b = group_of(a, rank), group_of(b, rank)
            assert line_a <= plane and line_b <= plane, (pair, rank)
            # the plane is exactly what the two lines span: every a-line through a b-point
            spanned = set().union(*(group_of(a, r) for r in line_b))
            assert plane == spanned and len(plane) == d * d, (pair, rank, plane, spanned)


def test_expert_groups_cut_the_data_axis():
    cfg = gt.Config.from_dict(dict(moe=dict(expert_parallel_size=2)))
    g = build_groups(cfg, 4)
    assert g[PM.EXPERT] == [(0, 1), (2, 3)] and g[PM.EXPERT_DATA] == [(0, 2), (1, 3)]


def test_expert_replicas_span_the_sequence_ranks_under_sequence_parallelism():
    # the sequence ranks of one data rank hold other tokens of its rows for the same experts
    cfg = gt.Config.from_dict(
        dict(moe=dict(expert_parallel_size=2), parallel=dict(tensor=dict(size=2, mode="sequence")))
    )
    g = build_groups(cfg, 8)  # data 4 x sequence 2
    assert g[PM.EXPERT] == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert g[PM.EXPERT_DATA] == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_topology_of_1024_ranks_is_fast():
    cfg = gt.Config.from_dict(dict(parallel=dict(pipeline=4, tensor=dict(size=8, mode="3d"))))
    start = time.perf_counter()
    text = format_topology(Layout(cfg, 1024))
    assert time.perf_counter() - start < 1.0, "issue 2: under a second for 1024 ranks"
    assert "world 1024 = data 32 x pipeline 4 x tensor 8" in text
