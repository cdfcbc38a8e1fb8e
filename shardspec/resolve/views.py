"""The spec's views (named meshes) in plain data, and the view of each rule.

A spec with one unnamed mesh is one implicit view (:data:`~shardspec.core.views.SINGLE`),
so that everything downstream can ask for a rule's view and its FSDP axis the same way.
The checks (:mod:`shardspec.checks.views`) report what is wrong; this only reads.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import TypeVar

from shardspec.core.patterns import PatternError, compile_glob
from shardspec.core.views import SINGLE, Views
from shardspec.frontend import ir

_T = TypeVar("_T")


class PerShape(Mapping[int, _T]):
    """A value per rule of a :class:`~shardspec.frontend.ir.RuleTable` that only its shape
    decides (the text of the rule but its pattern): one value per shape, read by index."""

    __slots__ = ("_table", "_values")

    def __init__(self, table: ir.RuleTable, values: list[_T]) -> None:
        self._table, self._values = table, values

    def __getitem__(self, index: int) -> _T:
        if not isinstance(index, int) or not 0 <= index < len(self._table):
            raise KeyError(index)
        return self._values[self._table.shape_of(index)]

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._table)))


def per_rule(rules: Sequence[ir.Rule], f: Callable[[ir.Rule], _T]) -> Mapping[int, _T]:
    """``f`` of each rule, by rule index, where ``f`` reads no rule's pattern nor place:
    called once per shape of a rule table."""
    if isinstance(rules, ir.RuleTable):
        return PerShape(rules, [f(rep) for rep in rules.shapes])
    return {r.index: f(r) for r in rules}


def captures_key(table: ir.RuleTable, index: int) -> Hashable:
    """What a check that reads a rule's pattern only for its captures reads of rule
    ``index``: its shape and its pattern's captures (None: the pattern does not compile)."""
    try:
        captures: tuple[str, ...] | None = compile_glob(table.pattern_text(index)).captures
    except PatternError:
        captures = None
    return table.shape_of(index), captures


def views_of(spec: ir.Spec) -> Views | None:
    """The spec's views (None: no mesh). A spec with an unnamed mesh has that one (an
    unnamed mesh beside named ones is an error, SS100). Each view's FSDP axis is the
    ``fsdp AXIS`` that names one of its axes; with one mesh, the ``fsdp`` statement's axis
    where the mesh has it."""
    if spec.mesh is None:
        return None
    if spec.mesh.name is None:
        axes = tuple(a.name.text for a in spec.mesh.axes)
        fsdp = spec.fsdp.text if spec.fsdp is not None and spec.fsdp.text in axes else None
        return Views(((SINGLE, axes),), ((SINGLE, fsdp),))
    declared: dict[str, tuple[str, ...]] = {}
    for m in spec.views:
        if m.name is None:
            continue  # an unnamed mesh beside views (SS100)
        declared.setdefault(m.name.text, tuple(a.name.text for a in m.axes))
    views = Views(tuple(declared.items()))
    shared = set(views.shared)
    own: dict[str, str] = {}
    for f in spec.fsdps:
        owners = views.views_of(f.text)
        if len(owners) == 1 and f.text not in shared:
            own.setdefault(owners[0], f.text)
    return Views(views.axes, tuple((v, own.get(v)) for v in views.names))


def rule_axes(rule: ir.Rule) -> list[ir.Name]:
    """Every axis a rule names (shard, checkpoint shard, local, replicate), in file order."""
    out = [a for s in (*rule.shards, *rule.checkpoint_shards) for a in s.axes]
    return sorted([*out, *rule.local, *rule.replicate], key=lambda n: (n.span.line, n.span.col))


def named_views(views: Views, rule: ir.Rule) -> dict[str, ir.Name]:
    """The views whose own (unshared) axes ``rule`` names, each with the first such axis."""
    shared = set(views.shared)
    out: dict[str, ir.Name] = {}
    for a in rule_axes(rule):
        owners = views.views_of(a.text)
        if a.text not in shared and len(owners) == 1:
            out.setdefault(owners[0], a)
    return out


def rule_view(views: Views, rule: ir.Rule) -> str:
    """The view that places ``rule``'s parameters: the one its ``view`` item states, else
    the one whose axes it names, else the default (first declared) view. Contradictions
    (SS104) resolve the same way, the stated view first."""
    if rule.view is not None and rule.view.text in views.names:
        return rule.view.text
    named = named_views(views, rule)
    return next(iter(named), views.default)


def rule_fsdp(spec: ir.Spec) -> Mapping[int, str | None]:
    """Each rule's FSDP axis: its view's."""
    views = views_of(spec)
    if views is None:
        return {}
    return per_rule(spec.rules, lambda r: views.fsdp_of(rule_view(views, r)))
