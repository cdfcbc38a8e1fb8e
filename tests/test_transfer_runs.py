"""The transfer planner's run intersection (shardspec/core/transfer.py): two holdings meet
per HF dimension by intersecting their HF runs, at a cost in runs, not elements.

Property tests against brute force: the runs an axis compresses to hold exactly its
pairs; the intersection of two axes' runs is the set intersection of their HF indices,
each with its two local positions; and ``_meet`` returns exactly the runs that the
element-by-element planner (a dict of positions, then :func:`runs_of` over the pairs in
the receiver's order; kept here as the reference) returned, so plan files stay byte for
byte the same. Runs of 10**12 elements show that nothing enumerates elements.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from shardspec.core.transfer import (
    Axis,
    Holding,
    Run,
    _meet,
    hf_runs,
    intersect_runs,
    merge_runs,
    runs_of,
)


def _by_elements(src: Holding, dst: Holding) -> tuple[tuple[Run, ...], ...] | None:
    """The planner's ``_meet`` before runs: every element looked up in a dict."""
    out = []
    for sa, da in zip(src.axes, dst.axes, strict=True):
        where = dict(sa.pairs())
        pairs = [(where[h], p) for h, p in sorted(da.pairs(), key=lambda x: x[1]) if h in where]
        if not pairs:
            return None
        out.append(runs_of(pairs))
    return tuple(out)


def _expand(runs: Sequence[Run]) -> list[tuple[int, int]]:
    return [(a + i * s, b + i * t) for a, b, n, s, t in runs for i in range(n)]


def _rope(n: int, head: int) -> list[int]:
    """Rotate-half rows of ``n`` rows in heads of ``head`` (even): interleaved order."""
    out = []
    for h in range(n // head):
        half = head // 2
        for i in range(half):
            out += [h * head + i, h * head + half + i]
    return out + list(range(n // head * head, n))


@st.composite
def axis_pairs(draw: st.DrawFn, universe: int = 48) -> tuple[list[int], list[int]]:
    """An axis as holdings make them: distinct HF indices in some order (increasing,
    strided, RoPE-interleaved or shuffled) at increasing local positions (with gaps:
    a fused dimension's other component, an offset)."""
    kind = draw(st.sampled_from(["range", "strided", "rope", "subset", "shuffled"]))
    if kind == "range":
        a = draw(st.integers(0, universe - 1))
        hf = list(range(a, draw(st.integers(a + 1, universe))))
    elif kind == "strided":
        hf = list(range(draw(st.integers(0, 5)), universe, draw(st.integers(2, 5))))
    elif kind == "rope":
        lo = draw(st.integers(0, 3)) * 8
        hf = [lo + i for i in _rope(draw(st.integers(1, 3)) * 8, draw(st.sampled_from([2, 4, 8])))]
    else:
        hf = sorted(draw(st.sets(st.integers(0, universe - 1), min_size=1, max_size=universe)))
        if kind == "shuffled":
            hf = draw(st.permutations(hf))
    gaps = draw(st.lists(st.integers(1, 3), min_size=len(hf), max_size=len(hf)))
    start = draw(st.integers(0, 4))
    pos = [start + sum(gaps[:i]) for i in range(len(hf))]
    return hf, pos


def axes(universe: int = 48) -> st.SearchStrategy[Axis]:
    return axis_pairs(universe).map(lambda hp: Axis.from_pairs(0, *hp))


def _holding(rank: int, axs: Sequence[Axis]) -> Holding:
    return Holding(rank, "p", (), tuple(axs))


@settings(max_examples=300, deadline=None)
@given(axis_pairs())
def test_hf_runs_hold_exactly_the_axis_pairs(hp: tuple[list[int], list[int]]) -> None:
    hf, pos = hp
    runs = hf_runs(hf, pos)
    pairs = _expand(runs)
    assert pairs == sorted(zip(hf, pos, strict=True))  # in increasing HF order
    assert all(r[2] >= 1 and r[3] >= 1 for r in runs)
    a = Axis.from_pairs(0, hf, pos)
    assert a.bounds == (min(hf), max(hf))
    assert a.pairs() == pairs and a.count == len(hf)


@settings(max_examples=400, deadline=None)
@given(axes(), axes())
def test_intersection_is_the_set_intersection(s: Axis, d: Axis) -> None:
    got = _expand(intersect_runs(s.runs, d.runs))
    where_s, where_d = dict(s.pairs()), dict(d.pairs())
    want = sorted((where_s[h], where_d[h]) for h in set(where_s) & set(where_d))
    assert sorted(got) == want
    assert len(got) == len(want)  # each element once


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(axes(), axes()), min_size=1, max_size=2))
def test_meet_equals_the_element_by_element_planner(dims: list[tuple[Axis, Axis]]) -> None:
    src = _holding(0, [s for s, _ in dims])
    dst = _holding(1, [d for _, d in dims])
    assert _meet(src, dst) == _by_elements(src, dst)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 30),
            st.integers(0, 30),
            st.integers(1, 6),
            st.integers(-3, 3).filter(bool),
            st.integers(1, 3),
        ),
        max_size=6,
    )
)
def test_merge_runs_is_runs_of_the_pairs(runs: list[Run]) -> None:
    assert merge_runs(runs) == runs_of(_expand(runs))


def test_cost_is_in_runs_not_elements() -> None:
    """10**12 elements per axis: any element-by-element step would never finish."""
    big = 10**12
    src = ((0, 0, big, 1, 1),)
    dst = ((5, 7, big, 1, 2), (big + 10, 0, big, 1, 1))
    assert intersect_runs(src, dst) == [(5, 7, big - 5, 1, 2)]
    assert merge_runs([(0, 0, big, 1, 1), (big, big, big, 1, 1)]) == ((0, 0, 2 * big, 1, 1),)
    # A strided pair of runs: the Chinese remainder theorem, not a scan.
    # h = 1 + 3i and h = 4 + 5j: h = 4 + 15k, at sender position 1 + 5k, receiver 3k.
    got = intersect_runs(((1, 0, big, 3, 1),), ((4, 0, big, 5, 1),))
    assert got == [(1, 0, (3 * big - 6) // 15 + 1, 5, 3)]
