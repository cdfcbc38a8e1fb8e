"""The compact IR of a rule, and what a spec of many rules costs in memory.

A :class:`~shardspec.frontend.ir.Rule` keeps the fields most rules leave at their defaults
in a :class:`~shardspec.frontend.ir.RuleRest` shared by every rule that sets none of them;
it must read, compare, hash and show exactly as the rule that was built (the IR's public
attributes are what checks, resolve and codegen read). The memory bounds are generous: they
fail for the IR as it was before (1,064 bytes a rule parsed, 299 held by the checks, as this
test measures them at commit 433b66a; 992 and 251 at 0fd98b7, before the rule table) and
pass with room at today's (about 36 and 58: the fast reader keeps a large spec's rules in
columns, :class:`~shardspec.frontend.ir.RuleTable`, and the checks read one rule a shape)."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.bench_input_size import rules_text
from shardspec.checks.run import check
from shardspec.findings.diagnostics import Span
from shardspec.frontend import ir
from shardspec.frontend.parse import parse

SOURCE = ir.Source("r.shard", "param p [a, b] { shard a over tp }\n" * 4)
AT = ir.Anchor(SOURCE, 35)


def _name(start: int, text: str) -> ir.Name:
    return ir.Name(at=AT, start=start, end=start + len(text), text=text)


NAMES = st.builds(_name, st.integers(0, 30), st.sampled_from(["a", "tp", "dp", "ffn"]))
NAME_TUPLES = st.lists(NAMES, max_size=2).map(tuple)
SHARDS = st.builds(
    lambda dim, axes: ir.ShardItem(at=AT, start=1, end=20, dim=dim, axes=axes),
    NAMES,
    NAME_TUPLES,
)
STYLES = st.builds(
    lambda kind, dtensor: ir.StyleItem(at=AT, start=2, end=12, kind=kind, dtensor=dtensor),
    NAMES,
    st.booleans(),
)
HEADS = st.builds(lambda t: ir.HeadSize(at=AT, start=3, end=9, target=t, size=128), NAMES)
FUSIONS = st.builds(
    lambda dim, c: ir.FuseItem(
        at=AT,
        start=4,
        end=30,
        dim=dim,
        components=(ir.Component(at=AT, start=c.start, end=c.end, name=c),),
    ),
    NAMES,
    NAMES,
)

# Every field of a rule but its place, and a value of each that a rule may hold.
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "index": st.integers(0, 10**6),
    "pattern": st.builds(
        lambda t: ir.Pattern(at=AT, start=6, end=6 + len(t), text=t), st.sampled_from(["p", "*"])
    ),
    "dims": NAME_TUPLES,
    "dims_given": st.booleans(),
    "replicate_all": st.booleans(),
    "shards": st.lists(SHARDS, max_size=2).map(tuple),
    "fusions": st.lists(FUSIONS, max_size=1).map(tuple),
    "local": NAME_TUPLES,
    "replicate": NAME_TUPLES,
    "checkpoint_shards": st.lists(SHARDS, max_size=1).map(tuple),
    "checkpoint_replicate": st.none() | st.just(Span("r.shard", 2, 3, 2, 24)),
    "style": st.none() | STYLES,
    "heads": st.lists(HEADS, max_size=2).map(tuple),
    "extra_styles": st.lists(STYLES, max_size=1).map(tuple),
    "view": st.none() | NAMES,
    "extra_views": NAME_TUPLES,
}
REQUIRED = ("index", "pattern", "dims")


@st.composite
def rule_fields(draw: st.DrawFn) -> dict[str, Any]:
    """The required fields and any of the others (those left out take their defaults)."""
    given_ = draw(st.sets(st.sampled_from([f for f in FIELDS if f not in REQUIRED])))
    return {f: draw(s) for f, s in FIELDS.items() if f in REQUIRED or f in given_}


DEFAULTS = {
    "dims_given": True,
    "replicate_all": False,
    "checkpoint_replicate": None,
    "style": None,
    "view": None,
}


@settings(max_examples=300, deadline=None)
@given(rule_fields(), rule_fields())
def test_a_rule_reads_compares_and_shows_its_fields(a: dict[str, Any], b: dict[str, Any]) -> None:
    rule = ir.Rule(at=AT, start=0, end=40, **a)
    # Each field reads back as given, or as its default (None, a flag's, or empty).
    for f in FIELDS:
        assert getattr(rule, f) == a.get(f, DEFAULTS.get(f, ())), f
    # Shown and compared by every field, in the order the rule's fields were declared in.
    shown = ", ".join(f"{f}={getattr(rule, f)!r}" for f in FIELDS)
    assert repr(rule) == f"Rule(span={rule.span!r}, {shown})"
    twin = ir.Rule(at=AT, start=0, end=40, **a)
    assert twin == rule and hash(twin) == hash(rule)
    other = ir.Rule(at=AT, start=0, end=40, **b)
    assert (other == rule) == all(getattr(other, f) == getattr(rule, f) for f in FIELDS)
    moved = ir.Rule(at=ir.Anchor(SOURCE, 0), start=0, end=40, **a)
    assert moved != rule  # another place


def test_rules_that_set_no_rare_field_share_one_rest() -> None:
    spec, diags = parse(rules_text(50), "s.shard")
    assert spec is not None and not diags
    rests = {id(r.rest) for r in spec.rules}
    # one per kind of rule in the text (dims given or not, `replicate` or not)
    assert len(rests) == len({(r.dims_given, r.replicate_all) for r in spec.rules}) == 2


def _held_per_rule(n: int, run: Any) -> tuple[Any, float]:
    """What ``run()`` returns and the bytes a rule it leaves allocated (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        got = run()
        gc.collect()
        return got, (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()


def test_the_ir_and_checks_of_many_rules_stay_small() -> None:
    n = 20_000
    text = rules_text(n)
    parse("param x replicate", "warm.shard")  # the parser's tables are no rule's
    (spec, diags), parsed = _held_per_rule(n, lambda: parse(text, "s.shard"))
    assert spec is not None and not diags
    assert parsed < 150, f"{parsed:.0f} bytes a rule of about {len(text) / n:.0f}"
    check(spec, manifest=None, use_manifest=False)  # the checks' caches are no rule's
    _, checked = _held_per_rule(n, lambda: check(spec, manifest=None, use_manifest=False))
    assert checked < 150, f"{checked:.0f} bytes a rule held by the checks' results"
