"""The coordinator's global-plan check of the generated SavePlanner
(``shardspec.runtime.checkpoint.validate_global_plan``): linear for grids, and rejecting
exactly the plans DCP's own ``_validate_global_plan`` rejects."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import (
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from bench import bench_checkpoint as bc
from shardspec.runtime.checkpoint import ShardspecSavePlanner, validate_global_plan

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _item(key: str, shape: tuple[int, ...], box: Box) -> WriteItem:
    offsets, sizes = (torch.Size(x) for x in box)
    return WriteItem(
        index=MetadataIndex(key, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(shape),
        ),
    )


def _metadata(shape: tuple[int, ...], boxes: list[Box]) -> Metadata:
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
    props = TensorProperties(dtype=torch.float32)
    return Metadata({"w": TensorStorageMetadata(props, torch.Size(shape), chunks)})


def _dcp_errors(plans: list[SavePlan], md: Metadata) -> list[str]:
    got = _validate_global_plan(plans, md)
    return ([] if got else ["rejected"]) if isinstance(got, bool) else list(got)


def _grid(rows: int, cols: int, shape: tuple[int, int]) -> list[Box]:
    """An FSDP (rows) x TP (cols) grid of chunks, uneven where the sizes do not divide."""

    def cuts(n: int, k: int) -> list[tuple[int, int]]:
        step = -(-n // k)
        return [(o, min(step, n - o)) for o in range(0, n, step)]

    return [((r, c), (nr, nc)) for r, nr in cuts(shape[0], rows) for c, nc in cuts(shape[1], cols)]


TWO_RANKS = [SavePlan([]), SavePlan([])]  # more than one plan: the volume must match


def test_accepts_a_grid_and_rejects_broken_ones() -> None:
    shape = (64, 28)
    good = _grid(16, 2, shape)
    assert validate_global_plan(TWO_RANKS, _metadata(shape, good)) == []
    assert _dcp_errors(TWO_RANKS, _metadata(shape, good)) == []
    broken = {
        "duplicate chunk (overlap)": [*good, good[3]],
        "missing chunk (not covering)": good[:-1],
        "chunk out of bounds": [*good[:-1], ((60, 14), (8, 14))],
        "shifted chunk (overlap, not a grid)": [*good[:-1], ((59, 14), (5, 14))],
        "larger chunk over two (overlap, not a grid)": [
            b for b in good if b[0][0] >= 8 or b[0][1] != 0
        ]
        + [((0, 0), (8, 14)), ((0, 0), (8, 10))],
    }
    for what, boxes in broken.items():
        md = _metadata(shape, boxes)
        ours, dcp = validate_global_plan(TWO_RANKS, md), _dcp_errors(TWO_RANKS, md)
        assert ours, what
        assert dcp, what


def test_planner_rejects_a_broken_global_plan() -> None:
    """The override runs in the coordinator's create_global_plan and raises like DCP's."""
    shape = (8, 4)
    boxes = _grid(4, 2, shape)
    spec = bc.bench_spec({})
    sim = bc._Sim(spec, 8, 2, None)
    planner = ShardspecSavePlanner(spec, sim.mesh(0), enable_plan_caching=False)
    planner.set_up_planner({}, None, True)
    good = [SavePlan([_item("w", shape, b)], planner_data={}) for b in boxes]
    plans, md = planner.create_global_plan(good)
    assert len(plans) == len(boxes) and len(md.state_dict_metadata["w"].chunks) == len(boxes)
    # Rank 7 writes a chunk over rank 0's and rank 1's, and not its own.
    over = SavePlan([_item("w", shape, ((0, 1), (2, 2)))], planner_data={})
    with pytest.raises(ValueError, match=r"overlapping chunks"):
        planner.create_global_plan([*good[:-1], over])
    # Rank 7 writes nothing: its chunk is missing.
    with pytest.raises(ValueError, match=r"invalid fill"):
        planner.create_global_plan([*good[:-1], SavePlan([], planner_data={})])


@pytest.mark.parametrize("world", [8, 64])
def test_same_verdict_as_dcp_on_real_plans(world: int) -> None:
    """The generated planner's and DCP default's global plans for the llama spec."""
    spec = bc.bench_spec({})
    for exclude in (bc.EXCLUDED, None):
        sim = bc._Sim(spec, world, 2, exclude)
        gen = sim.gen_local_plans()
        plans, md = create_default_global_save_plan(gen)
        assert validate_global_plan(plans, md) == _dcp_errors(plans, md) == []
    default = [sim.default_local_plan(r, fast=True) for r in range(world)]
    plans, md = create_default_global_save_plan(default)
    # DCP refuses the fused w13 its own default planner plans (its chunks "overlap").
    ours, dcp = validate_global_plan(plans, md), _dcp_errors(plans, md)
    assert bool(ours) == bool(dcp)


@st.composite
def _boxes(draw: st.DrawFn) -> tuple[tuple[int, int], list[Box]]:
    shape = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    if draw(st.booleans()):  # start from a grid, then break it (or not)
        boxes = _grid(draw(st.integers(1, shape[0])), draw(st.integers(1, shape[1])), shape)
        boxes = [b for b in boxes if draw(st.booleans()) or len(boxes) == 1] or boxes
    else:
        boxes = []
    extra = st.tuples(
        st.tuples(st.integers(0, shape[0]), st.integers(0, shape[1])),
        st.tuples(st.integers(0, shape[0]), st.integers(0, shape[1])),
    )
    boxes += draw(st.lists(extra, max_size=4))
    return shape, boxes or [((0, 0), shape)]


@settings(max_examples=400, deadline=None)
@given(_boxes())
def test_same_verdict_as_dcp_on_random_chunks(case: tuple[tuple[int, int], list[Box]]) -> None:
    shape, boxes = case
    md = _metadata(shape, boxes)
    assert bool(validate_global_plan(TWO_RANKS, md)) == bool(_dcp_errors(TWO_RANKS, md))
