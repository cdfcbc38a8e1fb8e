"""The transfer planner's axes are built run by run (shardspec/core/transfer.py
``holdings``): every HF dimension of every rank's holding comes from its held ranges as
runs, through the source's transforms, without listing elements. Against the element-wise
construction it replaced (tests/transfer_elementwise.py: one HF index and one position per
element, through ``source_indices``), on hypothesis-generated pairs of specs -- the
layouts of tests/test_transfer_plan.py's property test (mesh sizes, FSDP, shards over tp,
fused components, RoPE, transposes, split and grouped lines), stacked experts, and padded
dimensions under RoPE and transposes -- the holdings of both sides are equal and the
plan JSON is the same, byte for byte. Then the cost: an axis of 10**12 elements is built
in a handful of runs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardspec.core.hfmap import Source, Split, Transform, padded_size, source_indices
from shardspec.core.layout import Dim, Mesh, ParamLayout
from shardspec.core.transfer import Axis, _hf_of_range, canonical_runs, hf_runs, holdings
from shardspec.inputs.hfmanifest import dump_hf_manifest
from shardspec.inputs.manifest import dump_manifest
from shardspec.transfer import plan_json
from shardspec.transfer.plan import Plan
from tests.test_transfer_plan import STACKED, _pairs, _plan, _write, pair_plan
from tests.transfer_elementwise import elementwise

CHECKS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _same(plan: Plan, reference: Plan) -> None:
    """Both sides' holdings equal, and the plans' JSON the same bytes."""
    assert plan.status == reference.status
    assert [str(d) for d in plan.diagnostics] == [str(d) for d in reference.diagnostics]
    for side, ref in ((plan.trainer, reference.trainer), (plan.engine, reference.engine)):
        assert (side is None) == (ref is None)
        if side is not None and ref is not None:
            assert side.tensors.keys() == ref.tensors.keys()
            for key, t in side.tensors.items():
                assert t.held == ref.tensors[key].held, key
    if plan.status == 0:
        a, b = plan_json(plan), plan_json(reference)
        assert json.dumps(a, indent=1) == json.dumps(b, indent=1)


def _both(make: Any) -> tuple[Plan, Plan]:
    plan = make()
    with elementwise():
        reference = make()
    return plan, reference


class _Once:
    """A ``tmp_path_factory`` that gives the same folder for the same name again (the two
    planners read the same files)."""

    def __init__(self, factory: Any) -> None:
        self.factory, self.made = factory, dict[str, Path]()

    def mktemp(self, name: str) -> Path:
        if name not in self.made:
            self.made[name] = self.factory.mktemp(name)
        return self.made[name]


@CHECKS
@given(pair=_pairs())
def test_property_pairs_plan_as_element_wise(pair: Any, tmp_path_factory: Any) -> None:
    """tests/test_transfer_plan.py's random pairs (fused, RoPE, transposed, split,
    grouped; tp 1-4, FSDP or not, rows or cols over tp)."""
    once = _Once(tmp_path_factory)
    _same(*_both(lambda: pair_plan(pair, once)))


@st.composite
def _stacked_side(draw: st.DrawFn) -> dict[str, Any]:
    b = draw(st.sampled_from([1, 2, 4]))
    shard = draw(
        st.sampled_from(
            [
                "",
                "shard x over b",
                "shard rows over b",
                "shard cols over b",
                "shard x over a\n    shard rows over b",
                "shard cols over a\n    shard x over b",
            ]
        )
    )
    return {
        "b": b,
        "world": b * draw(st.sampled_from([1, 2])),
        "shard": shard,
        "tail": draw(st.sampled_from(["", " transpose"])),
    }


@CHECKS
@given(sides=st.tuples(_stacked_side(), _stacked_side()), rows=st.integers(1, 6))
def test_property_stacked_experts_plan_as_element_wise(
    sides: tuple[dict[str, Any], dict[str, Any]], rows: int, tmp_path_factory: Any
) -> None:
    """Experts stacked in one parameter (one HF tensor per expert), over expert and tensor
    parallel axes, stored as HF has them or transposed."""
    paths = []
    for n, fields in enumerate(sides):
        folder = tmp_path_factory.mktemp(f"x{n}")
        shape = [4, 6, rows] if not fields["tail"] else [4, rows, 6]
        entries = [{"fqn": "e.weight", "kind": "param", "shape": shape, "dtype": "float32"}]
        (folder / "m.json").write_text(dump_manifest(entries, "tests:model"), encoding="utf-8")
        (folder / "spec.shard").write_text(STACKED.format(**fields).lstrip(), encoding="utf-8")
        paths.append(str(folder / "spec.shard"))
    plan, reference = _both(lambda: _plan(paths[0], paths[1], {}, {}))
    _same(plan, reference)


@st.composite
def _padded(draw: st.DrawFn) -> dict[str, Any]:
    """An HF weight [rows, cols] (RoPE heads of 2 or 4 rows), held by a plain trainer and
    by an engine that may apply RoPE and a transpose and pads one dimension to a
    multiple, each side with its own tp, FSDP and dimension over tp."""
    head = draw(st.sampled_from([2, 4]))
    rows, cols = head * draw(st.integers(1, 3)), draw(st.integers(1, 7))
    rope = f" rope {head}" if draw(st.booleans()) else ""
    t = draw(st.booleans())
    pad_dim, multiple = draw(st.integers(0, 1)), draw(st.sampled_from([4, 8, 16]))
    shape = [cols, rows] if t else [rows, cols]
    shape[pad_dim] = padded_size(shape[pad_dim], multiple)
    line = f"w.proj -> w.weight{rope}{' transpose' if t else ''} pad {pad_dim} to {multiple}"

    def mesh() -> dict[str, Any]:
        tp = draw(st.sampled_from([1, 2, 4]))
        return {
            "tp": tp,
            "world": tp * draw(st.sampled_from([1, 2])),
            "fsdp": "fsdp dp" if draw(st.booleans()) else "",
            "shard": f"shard {draw(st.sampled_from(['rows', 'cols']))} over tp",
        }

    return {"hf": [rows, cols], "shape": shape, "line": line, "a": mesh(), "b": mesh()}


@CHECKS
@given(case=_padded())
def test_property_padded_plan_as_element_wise(case: dict[str, Any], tmp_path_factory: Any) -> None:
    """A padded engine dimension (after RoPE and a transpose): its padding has no HF
    source, the real indices lie at the leading positions."""
    train = _write(
        tmp_path_factory.mktemp("t"),
        {"w.weight": case["hf"], "n.weight": [3]},
        lines="    w.proj -> w.weight\n    n.proj -> n.weight",
        **case["a"],
    )
    folder = tmp_path_factory.mktemp("e")
    engine = _write(
        folder,
        {"w.weight": case["shape"], "n.weight": [3]},
        lines=f"    {case['line']}\n    n.proj -> n.weight",
        **case["b"],
    )
    text = Path(engine).read_text(encoding="utf-8").replace("hf {", 'hf "hf.json" {')
    Path(engine).write_text(text, encoding="utf-8")
    tensors = {
        "w.proj": {"shape": case["hf"], "dtype": "F32", "file": "model.safetensors"},
        "n.proj": {"shape": [3], "dtype": "F32", "file": "model.safetensors"},
    }
    hf = {"format": "shardspec-hf-manifest/1", "config": {}, "tensors": tensors}
    (folder / "hf.json").write_text(dump_hf_manifest(hf), encoding="utf-8")
    plan, reference = _both(lambda: _plan(train, engine, {}, {}))
    assert plan.engine is not None and plan.engine.tensors["w.proj"].held
    _same(plan, reference)


# ------------------------------------------------------------------------------ cost


def test_axes_cost_is_in_runs_not_elements() -> None:
    """A 2**40 x 2**40 weight over tp 4 with FSDP over dp 2, through a RoPE of heads of
    2**30 rows, a transpose and a grouped split: any element-wise step would never end."""
    big = 1 << 40
    layout = ParamLayout((Dim("rows", big, ("tp",)), Dim("cols", big, ("dp",))))
    mesh = Mesh(("dp", "tp"), (2, 4))
    split = Split(dim=1, start=1 << 20, size=big, total=2 * big, groups=1 << 10)
    source = Source(
        0,
        ("w",),
        (2 * big, big),
        False,
        (Transform("rope", head_dim=1 << 30), Transform("transpose")),
        split,
    )
    held = holdings("w", layout, mesh, None, source)["w"]
    assert len(held) == 8
    for h in held:
        assert h.count == big * big // 8
        assert sum(len(a.runs) for a in h.axes) < 10_000


def test_canonical_runs_join_however_cut() -> None:
    """Pieces of one progression, cut and ordered anyhow, give one run; pieces that
    interleave in HF (one RoPE head's two halves on two ranges) are untangled."""
    whole = ((0, 0, 100, 1, 1),)
    assert canonical_runs([(50, 50, 50, 1, 1), (0, 0, 10, 1, 1), (10, 10, 40, 1, 1)]) == whole
    assert canonical_runs([(1, 1, 2, 2, 2), (0, 0, 2, 2, 2)]) == ((0, 0, 4, 1, 1),)
    a = Axis(0, canonical_runs([(5, 0, 3, 1, 1)]))
    b = Axis.from_pairs(0, [5, 6, 7], [0, 1, 2])
    assert a == b and a.hf_set == ((5, 3, 1),) and a.ranges() == [(5, 8)]


# ------------------------------------------------------------------------------ pieces


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 60),
            st.integers(1, 6),
            st.integers(1, 4),
            st.integers(-3, 4),
            st.sampled_from([0, 0, 1, 7, 30]),
        ),
        max_size=6,
    ),
    st.randoms(use_true_random=False),
)
@example([(0, 3, 1, 1, 0), (3, 3, 2, 2, 0)], random.Random(0))
def test_canonical_runs_are_hf_runs_of_their_pairs(
    cuts: list[tuple[int, int, int, int, int]], rnd: Any
) -> None:
    """Pieces of an axis (distinct HF indices, any strides, any order, interleaving or
    not) give exactly the runs the element-wise :func:`hf_runs` gives their pairs."""
    pairs: dict[int, int] = {}
    pieces = []
    for h, n, hs, ps, shift in cuts:  # (shift: the positions where the HF indices are, or not)
        if any(h + i * hs in pairs for i in range(n)) or (ps == 0 and n > 1):
            continue
        p0 = h + shift
        pieces.append((h, p0, n, hs, ps))
        pairs.update({h + i * hs: p0 + i * ps for i in range(n)})
    rnd.shuffle(pieces)
    hf = list(pairs)
    assert canonical_runs(pieces) == hf_runs(hf, [pairs[h] for h in hf])


@st.composite
def _transforms(draw: st.DrawFn) -> tuple[tuple[Transform, ...], Split | None, int]:
    """Any chain of RoPE, transposes and pads over a 2-D box, in any order (the language
    writes the pad last; the arithmetic takes any), and maybe a (grouped) split."""
    chain = draw(
        st.lists(
            st.one_of(
                st.builds(lambda h: Transform("rope", head_dim=h), st.sampled_from([2, 4, 6])),
                st.just(Transform("transpose")),
                st.builds(
                    lambda d, s: Transform("pad", dim=d, size=s),
                    st.integers(0, 1),
                    st.integers(0, 40),
                ),
            ),
            max_size=4,
        )
    )
    split = None
    if draw(st.booleans()):
        groups = draw(st.sampled_from([1, 2, 3]))
        per = draw(st.integers(1, 8))
        split = Split(
            draw(st.integers(0, 1)), draw(st.integers(0, 5)), per * groups, per * groups * 3, groups
        )
    return tuple(chain), split, draw(st.integers(0, 1))


@settings(max_examples=500, deadline=None)
@given(_transforms(), st.integers(0, 20), st.integers(1, 24))
@example(((Transform("pad", size=2), Transform("rope", head_dim=4)), None, 0), 0, 8)
def test_a_range_maps_as_source_indices_maps_it(
    how: tuple[tuple[Transform, ...], Split | None, int], a: int, n: int
) -> None:
    """One dimension's range, run by run, against :func:`source_indices`'s element-wise
    map of the same box: the same HF dimension, the same HF index at every offset."""
    transforms, split, d = how
    offsets, sizes = [0, 0], [3, 3]
    offsets[d], sizes[d] = a, n
    per_dim, dim_of = source_indices(transforms, offsets, sizes, split)
    k, runs = _hf_of_range(Source(0, ("w",), (0, 0), False, transforms, split), 2, d, a, n)
    assert dim_of[k] == d
    got = sorted((o + i * s, h + i * hs) for h, o, c, hs, s in runs for i in range(c))
    assert got == list(enumerate(per_dim[k]))


def test_engine_rank_holding_only_padding(tmp_path: Path) -> None:
    """10 vocabulary rows padded to 64 over tp 4: engine ranks 1-3 hold padding only (an
    empty axis). The element-wise planner raised IndexError here (an empty axis had no
    bounds); now they receive nothing of it, rank 0 its 10 real rows."""
    train = _write(
        tmp_path / "t",
        {"w.weight": [10, 4], "n.weight": [4]},
        lines="    w.proj -> w.weight\n    n.proj -> n.weight",
    )
    engine = _write(
        tmp_path / "e",
        {"w.weight": [64, 4], "n.weight": [4]},
        lines="    w.proj -> w.weight pad 0 to 64\n    n.proj -> n.weight",
        world=4,
        tp=4,
    )
    text = Path(engine).read_text(encoding="utf-8").replace("hf {", 'hf "hf.json" {')
    Path(engine).write_text(text, encoding="utf-8")
    tensors = {
        "w.proj": {"shape": [10, 4], "dtype": "F32", "file": "model.safetensors"},
        "n.proj": {"shape": [4], "dtype": "F32", "file": "model.safetensors"},
    }
    hf = {"format": "shardspec-hf-manifest/1", "config": {}, "tensors": tensors}
    (tmp_path / "e" / "hf.json").write_text(dump_hf_manifest(hf), encoding="utf-8")
    plan = _plan(train, engine, {}, {})
    assert plan.status == 0 and plan.diagnostics == []
    assert plan.received == [(10 * 4 + 4) * 4, 4 * 4, 4 * 4, 4 * 4]
    assert plan.owned == plan.received
