"""The transfer planner's axes as they were built before runs (the reference of
tests/test_transfer_axes.py and the baseline of ``bench.bench_transfer --plan-only``):
every axis listed element by element -- one HF index and one local position per element
of each held range, through :func:`shardspec.core.hfmap.source_indices` -- then
compressed with :func:`shardspec.core.transfer.hf_runs`. ``_axes`` here is the code
shardspec/core/transfer.py had at commit 41cb55c but for that last step (it kept the
lists in the axis) and for taking the positions as pieces."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from unittest import mock

from shardspec.core.hfmap import Source, source_indices
from shardspec.core.layout import Ranges
from shardspec.core.transfer import Axis, Piece


def _axes(
    source: Source,
    held: Sequence[Ranges],
    first: int,
    pieces: Callable[[int, int, int], list[Piece]],
) -> tuple[Axis, ...]:
    """The HF axes of a rank's unit index sets ``held`` (model dims ``first``..), through
    the source's transforms and split: one :func:`source_indices` call per run of the dim
    with the most runs (every map is separable, so run ``i`` of each dim is mapped once)."""

    def pos(d: int, a: int, b: int) -> list[int]:
        return [p + i for _, p, n in pieces(d, a, b) for i in range(n)]

    n = max(len(r) for r in held) if held else 0
    hf: list[list[int]] = [[] for _ in held]
    local: list[list[int]] = [[] for _ in held]
    dim_of: tuple[int, ...] = tuple(range(len(held)))
    for i in range(n):
        box = [r[min(i, len(r) - 1)] for r in held]
        per_dim, dim_of = source_indices(
            source.transforms, [a for a, _ in box], [b - a for a, b in box], source.split
        )
        for k, idx in enumerate(per_dim):
            d = dim_of[k]
            if i < len(held[d]):
                hf[k].extend(idx)  # a pad's real indices: the run's leading positions
                local[k].extend(pos(d + first, *held[d][i])[: len(idx)])
    return tuple(Axis.from_pairs(dim_of[k] + first, hf[k], local[k]) for k in range(len(held)))


@contextlib.contextmanager
def elementwise() -> Iterator[None]:
    """``shardspec.core.transfer.holdings`` (the planner's, the interop descriptions')
    with these axes."""
    with mock.patch("shardspec.core.transfer._axes", _axes):
        yield
