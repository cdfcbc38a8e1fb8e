"""The coordinator's check of a global save plan, in linear time for grid-shaped chunks.

DCP's ``_validate_global_plan`` sweeps the chunks of each tensor along its largest
dimension, which is quadratic for FSDP x TP layouts (every FSDP chunk of one TP column
overlaps every other on the sweep dimension): 30 to 40 s at 4096 ranks. shardspec's
canonical chunks always form a grid, where one hash pass finds every overlap.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan


def _grid_overlaps(
    chunks: list[ChunkStorageMetadata],
) -> tuple[list[tuple[Any, Any]], list[dict[int, int]]] | None:
    """Overlapping chunk pairs, found in linear time where the chunks form a grid: in every
    dimension, the distinct intervals the chunks span are pairwise disjoint. Then two chunks
    overlap exactly when they span the same interval in every dimension, that is, when they
    are the same box. Also returns those intervals (``offset -> size`` per dimension).
    Returns None where the chunks are not such a grid (or one is empty): the caller then
    runs DCP's general check."""
    ndim = len(chunks[0].offsets)
    spans: list[dict[int, int]] = [{} for _ in range(ndim)]
    boxes: dict[tuple, Any] = {}
    overlaps = []
    for c in chunks:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        if len(offsets) != ndim or len(sizes) != ndim or min(sizes, default=1) <= 0:
            return None
        first = boxes.setdefault((offsets, sizes), c)
        if first is not c:
            overlaps.append((c, first))
            continue
        for d in range(ndim):
            if spans[d].setdefault(offsets[d], sizes[d]) != sizes[d]:
                return None  # two different intervals start at the same offset
    for per_dim in spans:
        starts = sorted(per_dim.items())
        for (o, n), (o2, _) in itertools.pairwise(starts):
            if o + n > o2:
                return None
    return overlaps, spans


def _dcp_validate(global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
    """DCP's own global-plan check, as a list of errors (older DCPs return a bool)."""
    from torch.distributed.checkpoint import default_planner

    check = getattr(default_planner, "_validate_global_plan", None)
    if check is None:  # not in any DCP this supports; nothing to add
        return []
    got = check(global_plan, metadata)
    if isinstance(got, bool):
        return [] if got else [f"{sorted(metadata.state_dict_metadata)}: DCP's check failed"]
    return list(got)


def validate_global_plan(global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
    """The checks of DCP's ``_validate_global_plan`` (chunks inside the tensor, no two
    overlapping, their volumes summing to the tensor's), in time linear in the number of
    chunks wherever a tensor's chunks form a grid, as shardspec's canonical chunks do. DCP's
    own sweep is quadratic for FSDP x TP grids (every FSDP chunk of a TP column overlaps
    every other on its sweep dimension). Tensors whose chunks are not a grid go through
    DCP's own check, so a plan is rejected exactly when DCP would reject it."""
    errors: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        if not isinstance(value, TensorStorageMetadata) or len(value.size) == 0:
            continue
        chunks = value.chunks
        grid = _grid_overlaps(chunks) if chunks else None
        size = tuple(value.size)
        if grid is None or len(size) != len(grid[1]):
            errors += _dcp_validate(global_plan, Metadata({key: value}))
            continue
        overlaps, spans = grid
        # A chunk is inside the tensor when its interval in every dimension is.
        outside = [
            (d, o)
            for d, per_dim in enumerate(spans)
            for o, n in per_dim.items()
            if o < 0 or o + n > size[d]
        ]
        for d, o in outside:
            bad = next(c for c in chunks if c.offsets[d] == o)
            errors.append(f"key:{key} has out of bounds chunk: tensor-size:{size} chunk: {bad}")
        volume = sum(math.prod(c.sizes) for c in chunks)
        errors += [f"key:{key} has overlapping chunks: {a} {b}" for a, b in overlaps]
        if len(global_plan) > 1 and volume != math.prod(size):
            errors.append(
                f"key:{key} invalid fill tensor-volume: {math.prod(size)} chunks-volume: {volume}"
            )
    return errors
