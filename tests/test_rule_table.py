"""The rules of a large spec in columns (:class:`~shardspec.frontend.ir.RuleTable`).

The fast reader keeps the rules of a spec of many rules as columns and reads a rule's
node again from the text when asked for; resolve and the checks read one rule per shape
(the text of a rule but its pattern). Here the table is used from the first rule
(``COLUMNS_FROM`` 0), and it must give the nodes the eager parse gives (every field and
span), and lint must find exactly what it finds with the rules as a tuple."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardspec.frontend.fastparse as fastparse
from bench.bench_input_size import rules_text
from shardspec.checks.run import check
from shardspec.frontend import ir
from shardspec.frontend.parse import parse
from shardspec.resolve.params import resolve
from tests.test_fastparse import joined, statements


@pytest.fixture
def columns() -> Iterator[None]:
    """Rules in columns from the first one."""
    old = fastparse.COLUMNS_FROM
    fastparse.COLUMNS_FROM = 0
    try:
        yield
    finally:
        fastparse.COLUMNS_FROM = old


def _both(text: str) -> tuple[ir.Spec | None, ir.Spec | None]:
    """``text`` parsed with its rules in columns, and parsed eagerly (a tuple)."""
    old = fastparse.COLUMNS_FROM
    fastparse.COLUMNS_FROM = 0
    try:
        table, _ = parse(text, "t.shard")
    finally:
        fastparse.COLUMNS_FROM = old
    eager, _ = parse(text, "t.shard", fast=False)
    return table, eager


def _same_nodes(table: ir.Spec | None, eager: ir.Spec | None) -> None:
    assert (table is None) == (eager is None)
    if table is None or eager is None:
        return
    assert table == eager
    assert len(table.rules) == len(eager.rules)
    for a, b in zip(table.rules, eager.rules, strict=True):
        assert a == b and repr(a) == repr(b) and a.span == b.span
        for f in ir._RULE_FIELDS:
            assert getattr(a, f) == getattr(b, f), f
    # read backwards and by negative index too (a node read again, not a cached one)
    for i in range(len(eager.rules) - 1, -1, -1):
        assert table.rules[i] == eager.rules[i] == table.rules[i - len(eager.rules)]


BAD_RULES = [
    "param model.{i}.w [a, b] { shard a over tp }",  # capture names no dimension
    "param model.x.w [a, a] { shard a over tp }",  # a dimension named twice
    "param model..w [a] replicate",  # a bad pattern
    "param model.y.w [a, b] { shard c over zz }",  # unknown dimension, unknown axis
    "param model.z.w [e, b] { style expert_parallel shard e over dp_shard }",
    "param model.q.w [a] { fuse a as g }",  # one component
    "param model.h.w [a] { heads b 8 }",  # heads of no dimension
    "param model.s.w [a, b] { shard a over tp style sequence_parallel }",
    "param model.k.w [a, b] { checkpoint shard b over tp checkpoint replicate }",
    "param model.v.w [a] { view nope }",
    "param m.{e}.w [e, a] { shard e over tp }",  # a name-indexed dim over a non-local axis
    # the shapes of sound rules (rules_text's), with a capture: SS027 where the sound
    # rule of that shape finds nothing (a check must key by the pattern's captures too)
    "param m.{ffn}.w [ffn, hidden] {\n    shard ffn over tp\n}",
    "param m.{heads}.w [heads, hidden] {\n    heads heads 128\n    shard heads over tp\n}",
    "param m.{ffn}.w [hidden, ffn] {\n    shard ffn over tp\n    style rowwise\n}",
    "param m.{x}.w [ffn, hidden] {\n    fuse ffn as gate, up\n    shard ffn over tp\n}",
]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(statements(), max_size=6), st.data())
def test_the_table_gives_the_eager_nodes(stmts: list[list[str]], data: st.DataObject) -> None:
    text = "".join(data.draw(joined(s)) for s in stmts)
    _same_nodes(*_both(text))


def _lint(text: str) -> tuple[list[str], ir.Spec]:
    spec, diags = parse(text, "t.shard")
    assert spec is not None
    res, found = check(spec, manifest=None, use_manifest=False)
    shown = [f"{d.code} {d.span} {d.message} | {d.hint}" for d in [*diags, *found]]
    assert sorted(res.broken) == sorted(res.broken)  # (a frozenset: compared below)
    return shown, spec


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(BAD_RULES), max_size=6),
    st.lists(st.integers(0, 60), max_size=6),
    st.integers(1, 60),
)
def test_lint_finds_the_same_in_columns(bad: list[str], where: list[int], n: int) -> None:
    """Sound rules of a few shapes and unsound ones among them: the same findings, the
    same broken rules, the same rule specs and views, with the rules in columns or not."""
    head, *rules = rules_text(n).split("\nparam ")
    rules = [f"\nparam {r}" for r in rules]
    for line, at in zip(bad, where, strict=False):
        rules.insert(min(at, len(rules)), "\n" + line)
    text = "".join([head, *rules])
    old = fastparse.COLUMNS_FROM
    try:
        fastparse.COLUMNS_FROM = 0
        got, table = _lint(text)
        fastparse.COLUMNS_FROM = 10**9
        want, eager = _lint(text)
    finally:
        fastparse.COLUMNS_FROM = old
    assert isinstance(table.rules, ir.RuleTable) and isinstance(eager.rules, tuple)
    assert got == want
    if any("{" in b.split()[1] for b in bad[: len(where)]):
        assert any("SS027" in g for g in got)
    a, b = resolve(table, None), resolve(eager, None)
    assert dict(a.globs) == dict(b.globs)
    assert dict(a.rule_specs) == dict(b.rule_specs)
    assert dict(a.rule_views) == dict(b.rule_views)


def test_a_large_spec_keeps_its_rules_in_columns() -> None:
    spec, _ = parse(rules_text(fastparse.COLUMNS_FROM), "s.shard")
    assert spec is not None and isinstance(spec.rules, ir.RuleTable)
    assert len(spec.rules.shapes) == 5  # the five kinds of rule the text repeats
    small, _ = parse(rules_text(fastparse.COLUMNS_FROM - 1), "s.shard")
    assert small is not None and isinstance(small.rules, tuple)


def test_out_of_range(columns: None) -> None:
    spec, _ = parse(rules_text(3), "s.shard")
    assert spec is not None and isinstance(spec.rules, ir.RuleTable)
    with pytest.raises(IndexError):
        spec.rules[3]
    res = resolve(spec, None)
    assert res.rule_specs.get(3) is None and res.globs.get(-1) is None
    assert res.rule_views.get(None) is None  # type: ignore[call-overload]


def test_a_sound_spec_is_checked_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linting a sound spec in columns reads no rule's node again: every check of every
    rule asks its shape's first rule (a check that walks ``spec.rules`` re-reads each rule
    from the text, which made a 100,000-rule lint twice as slow)."""
    reads = []
    reader = fastparse._rule_reader

    def counting(text: str, source: ir.Source) -> object:
        read = reader(text, source)

        def again(start: int, index: int) -> ir.Rule:
            reads.append(index)
            return read(start, index)

        return again

    monkeypatch.setattr(fastparse, "_rule_reader", counting)
    got, spec = _lint(rules_text(2 * fastparse.COLUMNS_FROM))
    assert isinstance(spec.rules, ir.RuleTable)
    assert not [g for g in got if "error" in g], got
    assert reads == []
    # a pad by name is resolved from the rules' shapes and patterns, reading no rule
    target = "model.layers.0.mlp.experts.0.gate_up_proj.w0.weight"
    hf = f"hf {{\n    a.weight -> {target} pad ffn to 64\n}}\n"
    spec, diags = parse(rules_text(2 * fastparse.COLUMNS_FROM) + hf, "t.shard")
    assert spec is not None and spec.hf is not None and not diags
    assert spec.hf.maps[0].transforms[0].dim == 0
    assert reads == []
