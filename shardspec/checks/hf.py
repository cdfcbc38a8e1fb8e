"""Checks on a spec's ``hf { ... }`` block: how a Hugging Face checkpoint maps onto the
model's storage units.

* :func:`check_hf_items` needs nothing but the spec (SS070 malformed items);
* :func:`check_hf_units` needs the model manifest (units produced once, transforms that
  apply, rules that produce something, config names);
* with an HF manifest as well, keys (unexpected, missing), shapes and config values.

Findings are grouped (one per rule, or per name shape such as ``model.layers.N.x``) and
capped, so a checkpoint with thousands of unexpected keys prints a screenful, not thousands.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from shardspec.checks.coverage import entry_span
from shardspec.checks.layouts import dim_span
from shardspec.core.hfmap import (
    Fused,
    HFMap,
    MapRule,
    _glob_regex,
    _RuleIndex,
    _template_regex,
    dtype_kind,
    fused_of,
    hf_dim,
    padded_dims,
    padded_size,
    template_captures,
    transform_problem,
    unit_names,
)
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span
from shardspec.findings.suggest import closest, ratio
from shardspec.frontend import ir
from shardspec.inputs.hfmanifest import HFManifest
from shardspec.resolve import hf as resolve_hf
from shardspec.resolve.hf import (
    build_hfmap,
    glob_problem,
    key_problem,
    template_problem,
)
from shardspec.resolve.params import Resolved

MAX_GROUPS = 20  # findings of one kind before the rest is summed up in one more
_DIGITS = re.compile(r"[0-9]+")


def _shape(shape: tuple[int, ...]) -> str:
    return str(list(shape))


# ------------------------------------------------------------------------ SS070: the items


_CAPTURE_NAME = re.compile(r"\{[^}]*\}")


def check_hf_items(spec: ir.Spec) -> tuple[list[Diagnostic], set[int]]:
    """SS070 for malformed items; returns the findings and the map lines (indices into
    ``spec.hf.maps``) that take no further part."""
    hf = spec.hf
    assert hf is not None
    out: list[Diagnostic] = []
    bad: set[int] = set()
    for i, m in enumerate(hf.maps):
        for side, pat in (("Hugging Face name", m.hf), ("target", m.target)):
            why = template_problem(pat.text)
            if why:
                out.append(diag("SS070", f"{side} {pat.text!r}: {why}", pat.span, _TEMPLATE_HINT))
                bad.add(i)
    first: dict[str, ir.HFMapItem] = {}
    for i, m in enumerate(hf.maps):
        if i in bad:
            continue
        # The same name whatever its captures are called: `{i}` and `{j}` read alike.
        shape = _CAPTURE_NAME.sub("{}", m.hf.text)
        if shape in first:
            line = first[shape].span.line
            out.append(
                diag(
                    "SS080",
                    f"Hugging Face name {m.hf.text!r} is read by line {line} too",
                    m.hf.span,
                    "map an HF tensor once; for tied weights, map the source and declare "
                    "the other key with `tie ALIAS = SOURCE`",
                )
            )
        first.setdefault(shape, m)
    hfmap = build_hfmap(hf)
    for i, why in hfmap.problems():
        if i in bad:
            continue
        m = hf.maps[i]
        span = m.span
        every = [*m.transforms, *(t for p in m.parts or [] for t in p.transforms)]
        if why.startswith("rope"):
            span = next((t.span for t in every if t.kind == "rope"), m.span)
        elif "named twice" in why:
            twice = [p for p in m.parts or [] if repr(p.name.text) in why]
            span = twice[-1].name.span if twice else m.span
        elif "stack index" in why and m.stack is not None:
            span = m.stack.span
        elif why.startswith("`pad"):
            span = next((t.span for t in every if t.kind == "pad"), m.span)
            out.append(diag("SS070", why, span, _PAD_HINT))
            bad.add(i)
            continue
        out.append(diag("SS070", why, span, _CAPTURE_HINT))
        bad.add(i)
    for kind, items in (("drop", hf.drops), ("keep", hf.keeps)):
        for g in items:
            why = glob_problem(g.pattern.text)
            if why:
                out.append(
                    diag("SS070", f"{kind} {g.pattern.text!r}: {why}", g.pattern.span, _GLOB_HINT)
                )
    aliases: dict[str, ir.HFTie] = {}
    for t in hf.ties:
        why = key_problem(t.alias.text) or key_problem(t.source.text)
        if why:
            out.append(diag("SS070", f"tie: {why}", t.span, "write `tie ALIAS = SOURCE`"))
        elif t.alias.text == t.source.text:
            out.append(diag("SS070", f"tie {t.alias.text!r} to itself", t.span, "delete the tie"))
        elif t.alias.text in aliases:
            earlier = aliases[t.alias.text]
            out.append(
                diag(
                    "SS070",
                    f"{t.alias.text!r} is tied twice (first at line {earlier.span.line})",
                    t.alias.span,
                    "an alias is the same tensor as one source: keep one tie",
                )
            )
        aliases.setdefault(t.alias.text, t)
    for t in hf.ties:
        if t.source.text in aliases and t.source.text != t.alias.text:
            other = aliases[t.source.text]
            out.append(
                diag(
                    "SS070",
                    f"tie source {t.source.text!r} is itself an alias (line {other.span.line})",
                    t.source.span,
                    f"tie to {other.source.text!r} directly",
                )
            )
    seen: dict[str, ir.HFConfig] = {}
    for c in hf.configs:
        if c.name.text in seen:
            out.append(
                diag(
                    "SS070",
                    f"config {c.name.text!r} is bound twice "
                    f"(first at line {seen[c.name.text].span.line})",
                    c.name.span,
                    "keep one binding",
                )
            )
        seen.setdefault(c.name.text, c)
    return out, bad


_TEMPLATE_HINT = (
    "a map line names tensors literally, with `{name}` captures for the parts that vary: "
    "`model.layers.{i}.mlp.up_proj.weight -> layers.{i}.feed_forward.w13.weight.up`"
)
_CAPTURE_HINT = (
    "both sides must use the same `{captures}`, and a stack index `[e]` must be a capture "
    "of the Hugging Face name only"
)
_GLOB_HINT = "`*` matches one segment (or part of one), `**` any number of segments"


# ---------------------------------------------------------------------- units and HF keys
#
# A model with expert parallelism has one storage unit per global expert index: tens of
# thousands of units from a few hundred parameters. Checking them one by one (a regex per
# rule per unit, a Source per unit) made the hf checks cost many times the rest of lint,
# so units are checked in groups: the units one parameter expands to, whose names differ
# only in the whole-segment expert indices (`_Group`). When every rule that could produce
# such a name captures each of those segments whole, with a capture used nowhere else in
# its target (`_uniform`), one name answers for the group: the same rules match every
# name, the same transforms apply (same shape), and the keys differ only in the indices.
# Otherwise, its names are checked one at a time. The findings only ever show the first
# name of a kind (in sorted order) and a count, so groups add up as (first name, count);
# tests/test_hf_lint_fast.py compares the result with a brute-force oracle that tries every
# map line on every unit and key.


@dataclass
class _Unit:
    name: str
    shape: tuple[int, ...]
    fqn: str  # the manifest parameter it comes from
    rule: int  # the spec rule that places that parameter
    fused: Fused | None = None  # the parameter's fused dimension, for a component


@dataclass
class _Group:
    """Storage units ``parts[0] + v[0] + parts[1] + ... + parts[-1]`` for every index
    tuple ``v`` in ``product(range(c) for c in counts)``, in that order (one unit when
    ``counts`` is empty), all of one shape and from one parameter."""

    parts: tuple[str, ...]
    counts: tuple[int, ...]
    shape: tuple[int, ...]
    fqn: str
    rule: int
    fused: Fused | None = None  # the parameter's fused dimension, for a component
    _names: list[str] | None = None

    def values(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*map(range, self.counts)))

    def names(self) -> list[str]:
        if self._names is None:
            self._names = self._make_names()
        return self._names

    def _make_names(self) -> list[str]:
        parts = self.parts
        if len(parts) == 1:
            return [parts[0]]
        if len(parts) == 2:
            a, b = parts
            return [f"{a}{v}{b}" for v in range(self.counts[0])]
        return [_join(parts, v) for v in itertools.product(*map(range, self.counts))]

    def unit(self, name: str) -> _Unit:
        return _Unit(name, self.shape, self.fqn, self.rule, self.fused)


def _join(parts: tuple[str, ...], values: tuple[int, ...]) -> str:
    out = [parts[0]]
    for v, p in zip(values, parts[1:], strict=True):
        out += [str(v), p]
    return "".join(out)


def _units(res: Resolved) -> dict[str, _Unit]:
    """Every storage unit of the placed parameters and buffers, from their layouts, one by
    one (the first parameter to name a unit keeps it)."""
    units: dict[str, _Unit] = {}
    for fqn, m, spans in _placed(res):
        assert m.layout is not None
        fused = fused_of(m.layout.dims)
        for name, shape in unit_names(fqn, m.layout.dims, spans):
            units.setdefault(name, _Unit(name, shape, fqn, _rule_of(m), fused))
    return units


def _rule_of(m: Any) -> int:
    """The spec rule that places a match (-1: a buffer no rule matches, whole everywhere)."""
    return -1 if m.winner is None else m.winner


def _placed(res: Resolved) -> list[tuple[str, Any, list[tuple[int, int]]]]:
    """``(fqn, match, indexed spans)`` of each placed parameter and stored buffer whose
    units count: one parameter per module name pattern when name-indexed dims expand it to
    every global index."""
    out: list[tuple[str, Any, list[tuple[int, int]]]] = []
    done: set[tuple[int, str]] = set()
    for fqn, m in res.stored:
        if m.layout is None:
            continue
        if m.winner is None:  # a buffer no rule matches: one unit, its whole tensor
            out.append((fqn, m, []))
            continue
        glob = res.globs.get(m.winner)
        if glob is None:
            continue
        indexed = [d.name for d in m.layout.dims if d.name_indexed]
        spans: list[tuple[int, int]] = []
        if indexed:
            found = glob.regex.match(fqn)
            if found is None:  # pragma: no cover - the rule matched it
                continue
            spans = [found.span(v) for v in indexed]
            # Every module behind a name-indexed dim stands for all of its global indices.
            key = fqn
            for s, e in sorted(spans, reverse=True):
                key = key[:s] + "{}" + key[e:]
            if (m.winner, key) in done:
                continue
            done.add((m.winner, key))
        out.append((fqn, m, spans))
    return out


def _groups(res: Resolved) -> tuple[list[_Group], dict[str, _Group]]:
    """The units as groups, and each unit's group by name. Where two parameters name the
    same unit, every unit is its own group, as :func:`_units` makes them."""
    groups: list[_Group] = []
    for fqn, m, spans in _placed(res):
        assert m.layout is not None
        dims = m.layout.dims
        plain = [d for d in dims if not d.name_indexed]
        # Sizes in span order, as unit_names expands them.
        ordered = sorted(zip(spans, (d.size for d in dims if d.name_indexed), strict=True))
        cuts = [0]
        for (s, e), _ in ordered:
            cuts += [s, e]
        cuts.append(len(fqn))
        counts = tuple(n for _, n in ordered)
        fused = fused_of(dims)
        for name, shape in unit_names(fqn, plain, ()):
            parts = [fqn[cuts[k] : cuts[k + 1]] for k in range(0, len(cuts), 2)]
            parts[-1] += name[len(fqn) :]  # the component, if any
            groups.append(_Group(tuple(parts), counts, shape, fqn, _rule_of(m), fused))
    by_name: dict[str, _Group] = {}
    total = 0
    for grp in groups:
        names = grp.names()
        total += len(names)
        by_name.update(zip(names, repeat(grp)))
    if len(by_name) != total:
        units = _units(res)
        groups = [_Group((u.name,), (), u.shape, u.fqn, u.rule, u.fused) for u in units.values()]
        by_name = {grp.parts[0]: grp for grp in groups}
    return groups, by_name


class _Target:
    """A rule's target template, segment by segment (for :func:`_uniform`)."""

    def __init__(self, template: str) -> None:
        self.segs = template.split(".")
        caps = template_captures(template)
        # Segments that are one capture, used once: they match any segment, on their own.
        self.free: dict[int, str] = {}
        self.literal: dict[int, str] = {}
        for k, seg in enumerate(self.segs):
            m = _WHOLE_CAPTURE.fullmatch(seg)
            if m and caps.count(m.group(1)) == 1:
                self.free[k] = m.group(1)
            elif "{" not in seg:
                self.literal[k] = seg


_WHOLE_CAPTURE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _span_segments(parts: tuple[str, ...]) -> tuple[int, ...] | None:
    """The segment positions of a group's indices, or None where an index is not a whole
    segment of the name."""
    if len(parts) == 1:
        return ()
    inner = parts[1:-1]
    if not (parts[0] == "" or parts[0].endswith(".")):
        return None
    if not (parts[-1] == "" or parts[-1].startswith(".")):
        return None
    if any(len(p) < 1 or not (p.startswith(".") and p.endswith(".")) for p in inner):
        return None
    out, at = [], 0
    for p in parts[:-1]:
        at += p.count(".")
        out.append(at)
    return tuple(out)


def _uniform(
    targets: list[_Target], positions: tuple[int, ...], segs_of_names: list[str], component: bool
) -> list[tuple[str, ...]] | None:
    """For a group whose indices sit at segment ``positions`` of names with segments
    ``segs_of_names``: per
    rule, the captures that take the indices (empty where the rule cannot produce any of
    the names), or None when the rules cannot be shown to treat every name alike. The
    names of a ``component`` group are ``<fqn>.<component>``: a rule can also match their
    ``<fqn>`` (a split line)."""
    full = segs_of_names
    out: list[tuple[str, ...]] = []
    for t in targets:
        segs = full
        if component and len(t.segs) == len(full) - 1:
            segs = full[:-1]  # the index positions lie before the component
        if len(t.segs) != len(segs):
            out.append(())  # a template matches only names of its segment count
            continue
        if all(p in t.free for p in positions):
            out.append(tuple(t.free[p] for p in positions))
            continue
        if any(segs[k] != lit for k, lit in t.literal.items() if k not in positions):
            out.append(())  # a literal segment that no name of the group has
            continue
        return None
    return out


class _Acc:
    """Findings data, added up over groups of units: (first name in sorted order, count)."""

    def __init__(self, hfmap: HFMap, good: list[int], keys: bool) -> None:
        self.hfmap = hfmap
        self.good = good
        self.keys = keys  # collect the HF keys each unit needs (for the HF manifest)
        self.not_produced: dict[str, list[Any]] = {}  # group key -> [unit, count]
        self.twice: dict[tuple[int, ...], list[Any]] = {}  # rules -> [name, count]
        self.transform_bad: dict[tuple[int, str], list[Any]] = {}  # -> [name, count]
        self.used: set[int] = set()
        # HF key -> (unit, spec map line, expected shape or None where transforms fail)
        self.needed: dict[str, tuple[str, int, tuple[int, ...] | None]] = {}

    @staticmethod
    def _add(table: dict, key: object, first: object, name: str, count: int) -> None:
        cur = table.get(key)
        if cur is None:
            table[key] = [first, name, count]
        else:
            if name < cur[1]:
                cur[0], cur[1] = first, name
            cur[2] += count

    def unit(
        self,
        grp: _Group,
        name: str,
        count: int,
        names: list[str] | None = None,
        values: list[tuple[int, ...]] | None = None,
        xs: list[tuple[str, ...]] | None = None,
    ) -> None:
        """Check unit ``name`` of group ``grp``, standing for ``count`` units (``names``,
        with their index ``values`` and per rule the captures ``xs`` that take them,
        when more than one)."""
        found = self.hfmap.sources(name, grp.shape, grp.fused)
        if not found:
            self._add(self.not_produced, _group_key(name), grp.unit(name), name, count)
            return
        rules = [self.good[s.rule] for s in found]
        self.used.update(rules)
        if len(found) > 1:
            self._add(self.twice, tuple(sorted(rules)), name, name, count)
            return
        (src,) = found
        rule = self.hfmap.rules[src.rule]
        slice_shape = grp.shape[1:] if src.stacked else grp.shape
        why = transform_problem(slice_shape, src.transforms)
        if why:
            self._add(self.transform_bad, (rules[0], why), name, name, count)
        if not self.keys:
            return
        expected = None if why else src.shape
        if names is None:
            self._need(src.keys, name, rules[0], expected)
            return
        assert values is not None and xs is not None
        caps = rule.target_regex.match(name if src.split is None else name.rpartition(".")[0])
        assert caps is not None
        fill = _key_filler(rule, caps.groupdict(), xs[src.rule])
        if isinstance(fill, list):  # one index, no stack: key = str(index).join(fill)
            keys = [str(v).join(fill) for (v,) in values]
            needed = self.needed
            if needed.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
                needed.update(
                    zip(
                        keys,
                        zip(names, repeat(rules[0]), repeat(expected), strict=False),
                        strict=True,
                    )
                )
                return
            for k, n in zip(keys, names, strict=True):
                self._need((k,), n, rules[0], expected)
            return
        stack = range(grp.shape[0]) if src.stacked else None
        for n, v in zip(names, values, strict=True):
            if stack is None:
                self._need((fill(v, None),), n, rules[0], expected)
            else:
                self._need(tuple(fill(v, e) for e in stack), n, rules[0], expected)

    def _need(
        self, keys: tuple[str, ...], name: str, rule: int, expected: tuple[int, ...] | None
    ) -> None:
        needed = self.needed
        for k in keys:
            cur = needed.get(k)
            if cur is None or name < cur[0]:
                needed[k] = (name, rule, expected)


def _key_filler(
    rule: MapRule, caps: dict[str, str], xs: tuple[str, ...]
) -> list[str] | Callable[[tuple[int, ...], int | None], str]:
    """How to name the HF keys of a group's units: ``rule.hf`` filled with ``caps``, the
    captures ``xs`` taking the index values and the stack capture the stack index. Either
    literal chunks, ``str(index).join(chunks)`` being the key (one index, no stack: the
    common case, fast), or ``(index values, stack index) -> key``."""
    pieces = _CAPTURE_SPLIT.split(rule.hf)  # literal, capture, literal, ..., literal
    if len(xs) == 1 and not rule.stack and set(pieces[1::2]) <= caps.keys():
        chunks: list[str] = []
        cur: list[str] = []
        for k, p in enumerate(pieces):
            if k % 2 == 1 and p == xs[0]:
                chunks.append("".join(cur))
                cur = []
            else:
                cur.append(p if k % 2 == 0 else caps[p])
        chunks.append("".join(cur))
        return chunks

    def fill(values: tuple[int, ...], e: int | None) -> str:
        filled = dict(caps)
        filled.update((x, str(v)) for x, v in zip(xs, values, strict=True))
        if rule.stack:
            filled[rule.stack] = str(e)
        return "".join(p if k % 2 == 0 else filled[p] for k, p in enumerate(pieces))

    return fill


_CAPTURE_SPLIT = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _group_key(name: str) -> str:
    return _DIGITS.sub("N", name)


def check_hf_units(
    res: Resolved,
    hf_manifest: HFManifest | None,
    bad: set[int],
    stray: Mapping[str, str] | None = None,
    *,
    uneven: set[Span] | None = None,
) -> list[Diagnostic]:
    """SS071-SS078 (those that need a manifest); SS073-SS075 and config values need the
    HF manifest too. ``uneven`` gets where each rule places a dimension whose uneven split
    SS133 reports (its pad line says how to make it even), so that SS023 does not report
    the same cause again there."""
    spec = res.spec
    hf = spec.hf
    assert hf is not None and res.manifest is not None
    full = build_hfmap(hf, hf_manifest)
    # Only sound map lines take part (hfmap cannot fill a template whose captures differ
    # from its other side's); indices are translated back to the spec's map lines.
    good = [i for i in range(len(full.rules)) if i not in bad]
    hfmap = HFMap(
        tuple(full.rules[i] for i in good), full.drops, full.ties, full.keeps, full.quants
    )
    out: list[Diagnostic] = []
    groups, by_name = _groups(res)
    acc = _Acc(hfmap, good, keys=hf_manifest is not None)
    targets = [_Target(r.target) for r in hfmap.rules]
    kept = _keep_matcher(hfmap)
    for grp in groups:
        if not grp.counts:
            name = grp.parts[0]
            if kept is None or not kept(name):
                acc.unit(grp, name, 1)
            continue
        names = grp.names()
        live = names if kept is None else [n for n in names if not kept(n)]
        if not live:
            continue
        positions = _span_segments(grp.parts)
        xs = None
        if positions is not None and len(live) == len(names):
            xs = _uniform(targets, positions, names[0].split("."), grp.fused is not None)
        if xs is None:
            for n in live:
                acc.unit(grp, n, 1)
        else:
            acc.unit(grp, names[0], len(names), names, grp.values(), xs)
    out += _report_not_produced(res, acc.not_produced, hf_manifest)
    out += _check_splits(res, full, bad, by_name, hf_manifest)
    out += _check_pads(res, full, bad, uneven if uneven is not None else set())
    for rules, (_, first, n) in sorted(acc.twice.items()):
        maps = [hf.maps[i] for i in rules]
        lines = ", ".join(str(m.span.line) for m in maps)
        out.append(
            diag(
                "SS072",
                f"storage unit {_more_n(first, n)} is produced by {len(maps)} map lines "
                f"(lines {lines})",
                maps[-1].target.span,
                "each unit comes from exactly one Hugging Face tensor: narrow or delete one",
            )
        )
    for (i, why), (_, first, n) in sorted(acc.transform_bad.items()):
        m = hf.maps[i]
        out.append(
            diag(
                "SS076",
                f"{_more_n(first, n)}: {why}",
                m.transforms[0].span if m.transforms else m.span,
                "the transforms must apply to the unit's shape (and so invert on export)",
            )
        )
    # Units of parameters that could not be placed (the mesh or their rule broken: that
    # finding is the cause) are unknown: lines that may produce them, and keys those lines
    # read, are not reported as unused or unexpected.
    unplaced = _unplaced(res)
    unsure = _lines_for(hfmap, unplaced)
    unsure_lines = {good[j] for j in unsure}
    for i, m in enumerate(hf.maps):
        if i not in bad and i not in acc.used and i not in unsure_lines:
            out.append(
                diag(
                    "SS078",
                    f"map line {m.hf.text} -> {m.target.text} produces no storage unit",
                    m.target.span,
                    "units are named `<fqn>`, `<fqn>.<component>` for a fused dimension, "
                    "with global expert indices; check the target against the manifest",
                )
            )
    for g in hf.keeps:
        if glob_problem(g.pattern.text) is not None:
            continue
        only = HFMap(keeps=(g.pattern.text,))
        if not any(only.kept(n) for n in by_name) and not any(
            only.kept(f) or only.kept(f + ".") for f in unplaced
        ):
            out.append(
                diag(
                    "SS078",
                    f"keep {g.pattern.text!r} matches no storage unit",
                    g.pattern.span,
                    "delete it if those parameters no longer exist",
                )
            )
    unknown = _check_config_names(res, hf)
    out += unknown
    if hf_manifest is not None:
        out += _check_keys(res, hfmap, hf_manifest, acc, by_name, unsure, stray)
        named = [c for c in hf.configs if not any(d.span == c.name.span for d in unknown)]
        out += _check_config_values(res, named, hf_manifest)
    return out


def _unplaced(res: Resolved) -> list[str]:
    """The manifest's parameters and persistent buffers (not ignored) without a layout:
    the mesh could not be sized, or the rule that would place them is broken (another
    finding says so). Their storage units are unknown."""
    return sorted(
        fqn
        for fqn, m in res.matches.items()
        if m.layout is None and m.ignored_by is None and m.entry.kind in ("param", "buffer")
    )


def _lines_for(hfmap: HFMap, fqns: list[str]) -> set[int]:
    """The map lines (indices into ``hfmap.rules``) whose target may name a unit of one of
    ``fqns``: the parameter itself (``<fqn>``, stacked ``<fqn>[e]``) or a component of it
    (``<fqn>.<component>``). One index lookup per name."""
    if not fqns or not hfmap.rules:
        return set()
    targets = [r.target for r in hfmap.rules]
    parents = [t.rpartition(".")[0] for t in targets]
    out: set[int] = set()
    for templates in (targets, parents):
        index = _RuleIndex(templates)
        regexes = [_template_regex(t) if t else None for t in templates]
        for fqn in fqns:
            for i in index.candidates(fqn):
                rx = regexes[i]
                if i not in out and rx is not None and rx.match(fqn):
                    out.add(i)
    return out


def _more_n(first: str, n: int) -> str:
    """:func:`_more` of ``n`` names whose first is ``first``."""
    return repr(first) + (f" (and {n - 1} more)" if n > 1 else "")


def _keep_matcher(hfmap: HFMap) -> Callable[[str], object] | None:
    """``hfmap.kept`` as one regex (None when nothing is kept)."""
    if not hfmap.keeps:
        return None
    pattern = "|".join(f"(?:{_glob_regex(g).pattern})" for g in hfmap.keeps)
    return re.compile(pattern).match


def _report_not_produced(
    res: Resolved, groups: dict[str, list[Any]], hfm: HFManifest | None
) -> list[Diagnostic]:
    """SS071 from ``{group key: [first unit, its name, count]}``."""
    out = []
    items = sorted(groups.values(), key=lambda v: v[1])
    for first, _, count in items[:MAX_GROUPS]:
        more = f" (and {count - 1} more like it)" if count > 1 else ""
        out.append(
            diag(
                "SS071",
                f"storage unit {first.name!r} {_shape(first.shape)} is produced by no hf map "
                f"line{more}",
                entry_span(res, first.fqn),
                _not_produced_hint(first, hfm),
            )
        )
    rest = items[MAX_GROUPS:]
    if rest:
        n = sum(count for _, _, count in rest)
        first = rest[0][0]
        out.append(
            diag(
                "SS071",
                f"{n} more storage units are produced by no hf map line, such as {first.name!r}",
                entry_span(res, first.fqn),
                "map them, or `keep` them",
            )
        )
    return out


def _not_produced_hint(unit: _Unit, hfm: HFManifest | None) -> str:
    """What to write for a unit no line produces. A component of a fused dimension may come
    from the fused tensor whole: with an HF manifest that has it, the hint is its line."""
    keep = "or `keep` it if the Hugging Face checkpoint has no such tensor"
    if unit.fused is None:
        return f"add a map line `HF_NAME -> {_template_of(unit.name)}`, {keep}"
    base = unit.name.rpartition(".")[0]
    order = ", ".join(c for c, _ in unit.fused.components)
    found = None if hfm is None else _fused_key(unit, base, hfm)
    if found is not None:
        key, shape, transposed = found
        line = f"{_template_of(key)} -> {_template_of(base)}" + (" transpose" if transposed else "")
        return (
            f"the HF manifest has the fused tensor {key!r} {_shape(shape)}: map it whole, "
            f"`{line}` (its parts are {order}, in that order; write `as ...` after the target "
            "for another order)"
        )
    return (
        f"add a map line `HF_NAME -> {_template_of(unit.name)}` for a tensor of its own, or "
        f"`HF_NAME -> {_template_of(base)}` for a fused tensor holding {order} in that order, "
        + keep
    )


def _fused_lines(acc: _Acc, hfm: HFManifest) -> dict[str, str]:
    """Per group of HF keys (``model.layers.N.qkv``), the line that would map a fused
    tensor whose components no line produces."""
    out = {}
    for first, _, _ in acc.not_produced.values():
        if first.fused is None:
            continue
        base = first.name.rpartition(".")[0]
        found = _fused_key(first, base, hfm)
        if found is not None:
            key, _, transposed = found
            line = f"{_template_of(key)} -> {_template_of(base)}"
            out[_group_key(key)] = line + (" transpose" if transposed else "")
    return out


def _fused_key(unit: _Unit, base: str, hfm: HFManifest) -> tuple[str, tuple[int, ...], bool] | None:
    """The HF key that most likely holds the whole fused parameter of ``unit``: its shape
    (or, 2-D, the transpose) and the same numbers in the name; the closest name wins."""
    assert unit.fused is not None
    at, comps = unit.fused.at, unit.fused.components
    whole = list(unit.shape)
    whole[at] = sum(size for _, size in comps)
    shape = tuple(whole)
    digits = _DIGITS.findall(base)
    best: tuple[float, str, tuple[int, ...], bool] | None = None
    for key, t in hfm.tensors.items():
        if t.shape == shape:
            transposed = False
        elif len(shape) == 2 and t.shape == shape[::-1]:
            transposed = True
        else:
            continue
        if _DIGITS.findall(key) != digits:
            continue
        score = 2.0 if key == base else ratio(key, base)  # no difflib over a huge key
        if best is None or score > best[0]:
            best = (score, key, t.shape, transposed)
    return None if best is None else best[1:]


def _template_of(name: str) -> str:
    return _DIGITS.sub("{i}", name, count=1)


def _check_keys(
    res: Resolved,
    hfmap: HFMap,
    hfm: HFManifest,
    acc: _Acc,
    units: dict[str, _Group],
    unsure: set[int],
    stray: Mapping[str, str] | None,
) -> list[Diagnostic]:
    hf = res.spec.hf
    assert hf is not None
    out: list[Diagnostic] = []
    tensors = hfm.tensors
    # Each finding shows the first key of its kind (in sorted order) and a count.
    missing: dict[int, list[Any]] = {}  # rule -> [first key, count]
    wrong: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[Any]] = {}
    kinds: dict[tuple[int, str, str], list[Any]] = {}  # (line, HF dtype, model dtype)
    model_dtype = _model_dtypes(res)
    read: set[str] = set()
    get = tensors.get
    for key, (name, i, expected) in acc.needed.items():
        t = get(key)
        if t is not None:
            present = key
        else:
            tied = hfmap.tie_of(key)
            t = None if tied is None else get(tied)
            if t is None or tied is None:
                _first(missing, i, key, key)
                continue
            present = tied
        read.add(present)
        if expected is not None and t.shape != expected:
            _first(wrong, (i, expected, t.shape), key, present)
        grp = units.get(name)
        dtype = model_dtype.get(grp.fqn) if grp is not None else None
        if dtype is not None and not _same_kind(t.dtype, dtype):
            _first(kinds, (i, t.dtype, dtype), key, present)
    for i, (_, keys, n) in sorted(missing.items()):
        m = hf.maps[i]
        out.append(
            diag(
                "SS074",
                f"HF key {_more_n(keys, n)} that line {m.span.line} needs is not in the HF "
                "manifest",
                m.hf.span,
                "check the Hugging Face name against the HF manifest (a tied key may be "
                "absent when its `tie` source is there)",
            )
        )
    for (i, expected, got), (_, present, n) in sorted(wrong.items()):
        m = hf.maps[i]
        out.append(
            diag(
                "SS075",
                f"HF key {_more_n(present, n)} has shape {_shape(got)}, line {m.span.line} "
                f"expects {_shape(expected)}",
                m.hf.span,
                _pad_hint(hfmap.rules[acc.good.index(i)], expected, got)
                or "the expected shape is the unit's, inverted through the transforms "
                "(and without the stacked first dimension for `[e]`)",
            )
        )
    for (i, hf_dtype, dtype), (_, present, n) in sorted(kinds.items()):
        m = hf.maps[i]
        kind = dtype_kind(hf_dtype)
        what = (
            f"{hf_dtype} ({kind} values)"
            if kind
            else f"{hf_dtype!r}, which is no safetensors dtype"
        )
        out.append(
            diag(
                "SS084",
                f"HF key {_more_n(present, n)} is {what} in the HF manifest, and line "
                f"{m.span.line} loads it into a {dtype} parameter",
                m.hf.span,
                f"load_hf never casts {kind or 'unknown'} data to {dtype_kind(dtype)}: check "
                "that the HF manifest describes the checkpoint (rebuild it with `shardspec "
                "hf-manifest`), or map the key onto a parameter of its kind",
            )
        )
    unexpected: dict[str, list[str]] = defaultdict(list)
    bases = _bases(units)
    rest = sorted(tensors.keys() - acc.needed.keys() - read)
    if stray is None:  # (scales its line's template misses: SS110/SS112)
        stray = resolve_hf.stray_scales(hf, hfm)
    for key in rest:
        if hfmap.tie_of(key) is not None or hfmap.dropped(key) or hfmap.is_scale(key):
            continue  # (a scale is its fp8 line's: checks/fp8.py)
        if key in stray:
            continue
        if _consumed(hfmap, key, units, bases, unsure):
            continue
        unexpected[_group_key(key)].append(key)
    groups = sorted(unexpected.values(), key=lambda ks: ks[0])
    whole = _fused_lines(acc, hfm) if groups else {}
    for keys in groups[:MAX_GROUPS]:
        more = f" (and {len(keys) - 1} more like it)" if len(keys) > 1 else ""
        line = whole.get(_group_key(keys[0]))
        out.append(
            diag(
                "SS073",
                f"unexpected HF key {keys[0]!r}{more}: no map line consumes it",
                _key_span(hfm, keys[0]),
                f"it holds a fused parameter's components that no line produces: map it "
                f"whole, `{line}`"
                if line
                else "map it (`HF_NAME -> UNIT`), `drop` it, or `tie` it to the key it duplicates",
            )
        )
    out += rest_of_groups(
        "SS073", groups[MAX_GROUPS:], hfm, "unexpected HF keys", "map them, or `drop` them"
    )
    out += _check_drops(res, hfmap, hfm, acc, units)
    for g in hf.drops:
        if glob_problem(g.pattern.text) is not None:
            continue
        only = HFMap(drops=(g.pattern.text,))
        if not any(only.dropped(k) for k in tensors):
            out.append(
                diag(
                    "SS078",
                    f"drop {g.pattern.text!r} matches no key of the HF manifest",
                    g.pattern.span,
                    "check the pattern against the HF manifest's keys; delete it if the "
                    "checkpoint has no such tensors",
                )
            )
    return out


def _check_drops(
    res: Resolved, hfmap: HFMap, hfm: HFManifest, acc: _Acc, units: dict[str, _Group]
) -> list[Diagnostic]:
    """SS086: a dropped HF key that holds model state no map line fills. Its target is
    the parameter, buffer or storage unit of its own name, what a map line would make of
    it, or its sibling in a mapped module (``...mlp.gate.bias`` beside a line for
    ``...mlp.gate.weight``); one finding per drop item (its first key and a count)."""
    hf = res.spec.hf
    assert hf is not None
    dropped = sorted(k for k in hfm.tensors.keys() - acc.needed.keys() if hfmap.dropped(k))
    if not dropped:
        return []
    entries = {f: m for f, m in res.stored}
    siblings = _sibling_map(hfmap)
    per_unit: dict[str, list[str]] = defaultdict(list)  # entry -> its units
    for name, grp in units.items():
        per_unit[grp.fqn].append(name)

    def filled(unit: str) -> bool:
        grp = units[unit]
        return not hfmap.kept(unit) and bool(hfmap.sources(unit, grp.shape, grp.fused))

    found: dict[int, list[tuple[str, str]]] = defaultdict(list)  # drop item -> (key, target)
    for key in dropped:
        targets = [key, *(u for _, u, _ in hfmap.consumers(key))]
        targets += [u for _, u, _ in siblings.consumers(key)]
        for target in targets:
            names = [target] if target in units else per_unit.get(target, [])
            if not names or all(filled(n) for n in names):
                continue
            item = next(i for i, g in enumerate(hf.drops) if _drops(g.pattern.text, key))
            found[item].append((key, target))
            break
    out = []
    for item, hits in sorted(found.items()):
        key, target = hits[0]
        fqn = units[target].fqn if target in units else target
        kind = "buffer" if entries[fqn].buffer else "parameter"
        what = f"{kind} {fqn!r}" + (f" (unit {target!r})" if target != fqn else "")
        more = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
        kept = " (a `keep` leaves it as it is)" if hfmap.kept(target) else ""
        out.append(
            diag(
                "SS086",
                f"drop {hf.drops[item].pattern.text!r} discards HF key {key!r}{more}, which holds "
                f"the model's {what}: no map line fills it{kept}, so load_hf leaves it as it "
                "is and export_hf omits the key",
                hf.drops[item].pattern.span,
                f"map it, `{_template_of(key)} -> {_template_of(target)}`, and delete the drop "
                "(and any `keep` of it)",
            )
        )
    return out


def _drops(pattern: str, key: str) -> bool:
    """Whether the drop item ``pattern`` matches HF key ``key``."""
    return HFMap(drops=(pattern,)).dropped(key)


def _sibling_map(hfmap: HFMap) -> HFMap:
    """Lines that map any last segment of each line's modules: ``model.layers.{i}.mlp.gate.
    {x} -> layers.{i}.moe.router.{x}`` for ``model.layers.{i}.mlp.gate.weight -> layers.{i}.
    moe.router.weight``, what an HF key beside a mapped tensor obviously maps to."""
    rules: dict[tuple[str, str], MapRule] = {}
    for r in hfmap.rules:
        hf_mod, _, _ = r.hf.rpartition(".")
        target_mod, _, _ = r.target.rpartition(".")
        if r.stack or not hf_mod or not target_mod:
            continue
        if set(template_captures(hf_mod)) != set(template_captures(target_mod)):
            continue
        rule = MapRule(f"{hf_mod}.{{sibling_}}", f"{target_mod}.{{sibling_}}")
        rules.setdefault((rule.hf, rule.target), rule)
    return HFMap(tuple(rules.values()))


def _model_dtypes(res: Resolved) -> dict[str, str]:
    """The manifest's dtype of each stored entry (placed parameter or persistent buffer)
    whose dtype is a known one (an unknown dtype string is another check's finding)."""
    return {fqn: m.entry.dtype for fqn, m in res.stored if dtype_kind(m.entry.dtype) is not None}


def _same_kind(hf_dtype: str, dtype: str) -> bool:
    kind = dtype_kind(hf_dtype)
    return kind is not None and kind == dtype_kind(dtype)


def _bases(units: dict[str, _Group]) -> dict[str, _Group]:
    """The fused parameters' names (a unit's name without its component) -> a group of
    their units."""
    return {n.rpartition(".")[0]: g for n, g in units.items() if g.fused is not None}


def _first(table: dict, kind: object, key: str, shown: str) -> None:
    """Count ``key`` under ``kind``, showing ``shown`` for the smallest key of the kind."""
    cur = table.get(kind)
    if cur is None:
        table[kind] = [key, shown, 1]
    else:
        if key < cur[0]:
            cur[0], cur[1] = key, shown
        cur[2] += 1


def _consumed(
    hfmap: HFMap,
    key: str,
    units: dict[str, _Group],
    bases: dict[str, _Group],
    unsure: set[int] = frozenset(),  # type: ignore[assignment]
) -> bool:
    """A rule reads ``key`` for a real unit (with a stack index inside its first dim), or
    for the components of a fused parameter (``bases``, by the parameter's name); or a rule
    in ``unsure`` reads it (for a parameter that could not be placed: units unknown)."""
    for i, unit, index in hfmap.consumers(key):
        if i in unsure:
            return True
        u = units.get(unit) or bases.get(unit)
        if u is None:
            continue
        if index is None or (u.shape and 0 <= index < u.shape[0]):
            return True
    return False


def rest_of_groups(
    code: str, rest: list[list[str]], hfm: HFManifest, what: str, hint: str
) -> list[Diagnostic]:
    """One finding for the groups of keys beyond the first :data:`MAX_GROUPS` (each group a
    sorted list of keys): how many keys, and the first."""
    if not rest:
        return []
    n = sum(len(keys) for keys in rest)
    first = rest[0][0]
    return [diag(code, f"{n} more {what}, such as {first!r}", _key_span(hfm, first), hint)]


def _key_span(hfm: HFManifest, key: str) -> Span:
    line, col = hfm.position(key)
    return Span(hfm.path, line, col, line, col + len(key) + 2)


# ------------------------------------------------------------------------------ config


def _sizes(res: Resolved) -> dict[str, list[tuple[int, str]]]:
    """Per dimension or component name: (global size, parameter), per placed parameter in
    order."""
    out: dict[str, list[tuple[int, str]]] = defaultdict(list)
    of_layout: dict[int, list[tuple[str, int]]] = {}  # layouts are shared between params
    for fqn, m in res.params:
        if m.layout is None:
            continue
        found = of_layout.get(id(m.layout))
        if found is None:
            found = []
            for d in m.layout.dims:
                found.append((d.name, d.size))
                if d.fusion is not None:
                    found += [(comp, size * d.fusion.groups) for comp, size in d.fusion.components]
            of_layout[id(m.layout)] = found
        for name, size in found:
            out[name].append((size, fqn))
    return out


def _check_config_names(res: Resolved, hf: ir.HFBlock) -> list[Diagnostic]:
    names = {d.text for r in res.spec.rules for d in r.dims}
    names |= {c.name.text for r in res.spec.rules for f in r.fusions for c in f.components}
    out = []
    for c in hf.configs:
        if c.name.text not in names:
            out.append(
                diag(
                    "SS077",
                    f"config {c.name.text!r} names no dimension or fused component of any rule",
                    c.name.span,
                    "bind a rule's dimension name (`hidden`) or component name (`q`, `gate`)",
                )
            )
    return out


def _check_config_values(
    res: Resolved, configs: list[ir.HFConfig], hfm: HFManifest
) -> list[Diagnostic]:
    out = []
    all_sizes: dict[str, list[tuple[int, str]]] | None = None
    for c in configs:
        value, why = _config_product(c.factors, hfm)
        if why is not None:
            out.append(why)
        else:
            assert value is not None
            if all_sizes is None:
                all_sizes = _sizes(res)
            sizes = all_sizes.get(c.name.text, [])
            off = [(s, fqn) for s, fqn in sizes if s != value]
            if off:
                s, fqn = off[0]
                more = f" (and {len(off) - 1} more)" if len(off) > 1 else ""
                shown = " * ".join(f.text for f in c.factors)
                out.append(
                    diag(
                        "SS077",
                        f"config {c.name.text} = {shown} = {value}, but {fqn!r}{more} has "
                        f"{c.name.text} of {s}",
                        c.span,
                        "the model and the Hugging Face config disagree: check the model's "
                        "sizes, or the binding",
                    )
                )
    return out


def _config_product(
    factors: tuple[ir.HFConfigFactor, ...], hfm: HFManifest, code: str = "SS077"
) -> tuple[int | None, Diagnostic | None]:
    """The value of a product of config.json keys and whole numbers, or why it has none."""
    values: list[int] = []
    for f in factors:
        if f.number is not None:
            values.append(f.number)
            continue
        if f.text not in hfm.config:
            return None, diag(
                code,
                f"config.json has no key {f.text!r}",
                f.span,
                "the keys are those of the HF manifest's config (config.json)",
            )
        v = hfm.config[f.text]
        if not isinstance(v, int) or isinstance(v, bool):
            return None, diag(
                code,
                f"config.json's {f.text!r} is {v!r}, not a whole number",
                f.span,
                "a binding multiplies whole numbers",
            )
        values.append(v)
    return math.prod(values), None


# ------------------------------------------------------------------------------ splits


def _check_splits(
    res: Resolved,
    hfmap: HFMap,
    bad: set[int],
    units: dict[str, _Group],
    hfm: HFManifest | None,
) -> list[Diagnostic]:
    """SS081: split lines that do not fit their target: an `as` list or `grouped` on a
    parameter without a fused dimension, a part that is no component of it, a stated size
    that differs from the component's, transforms that move the fused dimension of some
    parts only, or a stack index over the fused dimension itself. SS082 and SS083: a
    split line's storage that contradicts the fused dimension's groups."""
    hf = res.spec.hf
    assert hf is not None
    rules = hfmap.rules
    splitting = [i for i, r in enumerate(rules) if i not in bad]
    if not splitting:
        return []
    # Per map line, the first fused parameter (by name) it splits and the first plain unit
    # its `as` list (or `grouped`) names.
    first_fused: dict[int, tuple[str, _Group]] = {}
    first_plain: dict[int, str] = {}
    index = hfmap._target_index
    for name, grp in sorted(units.items()):
        if grp.fused is not None:
            base = name.rpartition(".")[0]
            for i in index.candidates(base):
                if i not in bad and i not in first_fused and rules[i].target_regex.match(base):
                    first_fused[i] = (base, grp)
        else:
            for i in index.candidates(name):
                r = rules[i]
                splits = r.parts is not None or r.grouped
                if splits and i not in first_plain and r.target_regex.match(name):
                    first_plain[i] = name
    out: list[Diagnostic] = []
    for i, name in sorted(first_plain.items()):
        if i in first_fused:
            continue
        m = hf.maps[i]
        out.append(
            diag(
                "SS081",
                f"line {m.span.line} splits {name!r}, which has no fused dimension",
                m.target.span,
                "an `as` list and `grouped` say how an HF tensor holds the components of "
                "a `fuse` dimension; map a tensor to a plain parameter without them",
            )
        )
    for i, (base, grp) in sorted(first_fused.items()):
        out += _split_problems(hf.maps[i], rules[i], base, grp, hfm)
        out += _grouped_problems(res, hf.maps[i], rules[i], base, grp)
    return out


def _grouped_problems(
    res: Resolved, m: ir.HFMapItem, rule: MapRule, base: str, grp: _Group
) -> list[Diagnostic]:
    """SS082: a split line that reads the parameter's own name (the model loads its own
    checkpoint, which stores the model's layout) as contiguous components, while the
    fused dimension declares groups. SS083: `grouped` on a fused dimension without groups.
    """
    assert grp.fused is not None
    groups = grp.fused.groups
    fuse = _fuse_item(res, grp.rule)
    comps = ", ".join(f"{c} {n}" for c, n in grp.fused.components)
    dim = fuse.dim.text if fuse is not None else "DIM"
    if m.grouped is not None and groups == 1:
        return [
            diag(
                "SS083",
                f"line {m.span.line} reads its Hugging Face tensor group by group, but the "
                f"fused dimension of {base!r} declares no groups",
                m.grouped,
                f"if the tensor interleaves the components (gpt-oss's gate_up_proj, Megatron's "
                f"qkv), declare the model's groups: `fuse {dim} as N groups of ...` with the "
                "sizes per group; if it holds them one after another, delete `grouped`",
            )
        ]
    per_group = ", ".join(f"{c} {n // groups}" for c, n in grp.fused.components)
    transforms = [*m.transforms, *(t for p in m.parts or [] for t in p.transforms)]
    own = _CAPTURE_NAME.sub("{}", rule.hf) == _CAPTURE_NAME.sub("{}", rule.target)
    if m.grouped is not None or groups == 1 or not own or rule.stack or transforms:
        return []
    return [
        diag(
            "SS082",
            f"line {m.span.line} reads the Hugging Face tensor named as {base!r} (the "
            f"model's own) as {comps} one after another, but the model holds {groups} "
            f"groups of {per_group}",
            m.target.span,
            "a tensor named as the parameter is the model's own checkpoint, stored as the "
            f"model holds it: if the model really is grouped, add `grouped` "
            f"(`{m.hf.text} -> {m.target.text} grouped`); if it holds the components one "
            f"after another (Phi3's q|k|v), drop the groups: `fuse {dim} as {comps}`",
        )
    ]


def _fuse_item(res: Resolved, rule: int) -> ir.FuseItem | None:
    """The `fuse` item of spec rule ``rule`` (by its index)."""
    for r in res.spec.rules:
        if r.index == rule:
            return r.fusions[0] if r.fusions else None
    return None


def _split_problems(
    m: ir.HFMapItem, rule: MapRule, base: str, grp: _Group, hfm: HFManifest | None
) -> list[Diagnostic]:
    assert grp.fused is not None
    at, comps = grp.fused.at, grp.fused.components
    sizes = dict(comps)
    known = ", ".join(f"{c} {n}" for c, n in comps)
    out = []
    if rule.stack and at == 0:
        out.append(
            diag(
                "SS081",
                f"{base!r}: the stack index [{rule.stack}] takes the fused dimension itself",
                m.stack.span if m.stack else m.span,
                "stack over the experts' dimension; the fused dimension must be another one",
            )
        )
        return out
    for p in m.parts or []:
        name = p.name.text
        if name not in sizes:
            out.append(
                diag(
                    "SS081",
                    f"{name!r} is not a component of {base!r}, whose fused dimension is {known}",
                    p.name.span,
                    "name the components of the `fuse` line, in the order the Hugging Face "
                    "tensor stores them",
                )
            )
            continue
        if p.size is None:
            continue
        stated: int | None
        if len(p.size) == 1 and p.size[0].number is not None:
            stated = p.size[0].number
        elif hfm is None:
            continue  # config values need the HF manifest (SS079 says it is missing)
        else:
            stated, why = _config_product(p.size, hfm, "SS081")
            if why is not None:
                out.append(why)
                continue
        if stated != sizes[name]:
            out.append(
                diag(
                    "SS081",
                    f"part {name} is stated as {stated}, but component {name} of {base!r} "
                    f"has {sizes[name]}",
                    p.size_span or p.span,
                    f"the components are {known} (global sizes, all groups); fix the size "
                    "or the `fuse` line",
                )
            )
    parts = rule.parts or ()
    ndim = len(grp.shape) - (1 if rule.stack else 0)
    d = at - (1 if rule.stack else 0)
    dims = {hf_dim(ndim, rule.transforms + p.transforms, d) for p in parts}
    if len(dims) > 1:
        out.append(
            diag(
                "SS081",
                f"the parts' transforms put {base!r}'s fused dimension on different Hugging "
                "Face dimensions",
                m.span,
                "the parts lie along one dimension of the Hugging Face tensor: `transpose` "
                "goes before `as`, for every part",
            )
        )
    return out


# ------------------------------------------------------------------------------ no file


# ------------------------------------------------------------- SS132-SS133: padded dims


_PAD_HINT = (
    "end a whole-tensor line with the pad, after any `rope`: "
    "`model.embed_tokens.weight -> tok.weight pad 0 to 64`"
)


def _check_pads(res: Resolved, full: HFMap, bad: set[int], uneven: set[Span]) -> list[Diagnostic]:
    """SS132 (the model's padded size is not the HF size rounded up to the multiple, the HF
    size is unknown, or the multiple names no mesh axis or one twice) and SS133 (a padded
    dimension that does not split evenly over the axes sharding it, FSDP's aside), once
    per line; each SS133's dimension, where its rule places it, goes into ``uneven``."""
    hf = res.spec.hf
    assert hf is not None
    lines = {
        i
        for i, r in enumerate(full.rules)
        if i not in bad and any(t.kind == "pad" for t in r.transforms)
    }
    if not lines or res.mesh is None:
        return []
    mesh = res.mesh
    found: dict[tuple[str, int], tuple[str, str]] = {}  # (code, line) -> (message, hint)
    for fqn, m in res.stored:
        if m.layout is None or any(d.name_indexed for d in m.layout.dims):
            continue
        fused = fused_of(m.layout.dims)
        fsdp = res.fsdp_of_rule(m.winner)
        for name, shape in unit_names(fqn, m.layout.dims, ()):
            srcs = full.sources(name, shape, fused)
            if len(srcs) != 1 or srcs[0].rule not in lines:
                continue
            src = srcs[0]
            sub = shape[1:] if src.stacked else shape
            first = 1 if src.stacked else 0
            for d, t in padded_dims(len(sub), src.transforms):
                if d >= len(sub):
                    continue  # SS076
                for code, why, hint in _pad_findings(name, sub[d], t, mesh, m, d + first, fsdp):
                    found.setdefault((code, src.rule), (why, hint))
                    if code == "SS133" and m.winner is not None:
                        rule = res.spec.rules[m.winner]
                        uneven.add(dim_span(rule, m.layout.dims[d + first].name))
    out = []
    for (code, i), (why, hint) in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        pad = next(t for t in hf.maps[i].transforms if t.kind == "pad")
        out.append(diag(code, why, pad.span, hint))
    return out


def _pad_findings(
    name: str, size: int, t: Any, mesh: Any, m: Any, dim: int, fsdp: str | None
) -> list[tuple[str, str, str]]:
    """What is wrong with unit ``name``'s dimension ``dim`` of model size ``size``, padded
    by ``t``: ``(code, message, hint)``."""
    twice = next((a for i, a in enumerate(t.axes) if a in t.axes[:i]), None)
    if twice is not None:
        once = " x ".join(dict.fromkeys(t.axes))
        return [
            (
                "SS132",
                f"`{t}` names mesh axis {twice!r} twice: the multiple would count its size twice",
                f"name each axis once: `pad {t.dim} to {t.multiple} x {once}`",
            )
        ]
    unknown = [a for a in t.axes if a not in mesh.names]
    if unknown:
        near = closest(unknown[0], list(mesh.names))
        return [
            (
                "SS132",
                f"`{t}`: {unknown[0]!r} is no mesh axis",
                f"did you mean `{near}`?" if near else f"name a mesh axis: {', '.join(mesh.names)}",
            )
        ]
    if t.size == 0:
        return [
            (
                "SS132",
                f"{name}: `{t}` needs the HF size of the dimension it pads, and the spec's HF "
                "manifest gives none",
                'name the HF manifest: `hf "model.hf.json" { ... }` (made by `shardspec '
                "hf-manifest HF_DIR -o FILE`)",
            )
        ]
    multiple = t.multiple * math.prod(mesh.size(a) for a in t.axes)
    out = []
    want = padded_size(t.size, multiple)
    if size != want:
        fits = _fitting_multiples(t.size, size)
        if size == t.size:
            hint = "the model's dimension is the HF one's size, not padded: delete the pad"
        elif fits:
            hint = (
                f"the model's {size} rows are {t.size} padded to a multiple of "
                f"{' or '.join(map(str, fits))}: write `pad {t.dim} to {fits[0]}`"
            )
        else:
            hint = (
                "the model's dimension is smaller than the HF one: check the model's "
                f"manifest (a model padded to {multiple} has {want})"
            )
        out.append(
            (
                "SS132",
                f"{name}: dimension {dim} has {size} in the model, but the HF size {t.size} "
                f"padded to a multiple of {multiple} is {want}",
                hint,
            )
        )
        return out
    axes = [a for a in m.layout.dims[dim].axes if a != fsdp]
    ways = math.prod(mesh.size(a) for a in axes)
    if ways > 1 and size % ways:
        out.append(
            (
                "SS133",
                f"{name}: the padded dimension {dim} ({size}) does not split evenly over "
                f"{' x '.join(axes)} ({ways} ways)",
                f"pad to a multiple of the split too, so that every rank holds the same rows: "
                f"`pad {t.dim} to {t.multiple} x {' x '.join(axes)}`",
            )
        )
    return out


def _pad_hint(rule: MapRule, expected: tuple[int, ...], got: tuple[int, ...]) -> str:
    """For an HF tensor smaller than the model's along one dimension and equal along the
    rest: the ``pad`` to end the line with (the model's dimension, a multiple that pads the
    HF size to the model's), or ``""``."""
    diff = [k for k, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b]
    if len(expected) != len(got) or len(diff) != 1 or expected[diff[0]] < got[diff[0]]:
        return ""
    k = diff[0]
    fits = _fitting_multiples(got[k], expected[k])
    # the model's dimension that HF dimension k becomes (a pad ends the chain)
    d = next(i for i in range(len(got)) if hf_dim(len(got), rule.transforms, i) == k)
    return (
        f"the model's dimension {d} is larger ({expected[k]} against {got[k]}): if the model "
        f"pads it (a vocabulary padded for tensor parallelism), end the line with "
        f"`pad {d} to {fits[0]}`"
    )


def _fitting_multiples(hf_size: int, size: int) -> list[int]:
    """Multiples that pad ``hf_size`` to exactly ``size`` (divisors of ``size`` above
    ``size - hf_size``), at most two: vLLM's 64 where it fits, else powers of two, else
    the smallest."""
    if not 0 < hf_size <= size:
        return []
    fit = [m for m in range(size - hf_size + 1, size + 1) if size % m == 0]
    twos = [m for m in fit if m & (m - 1) == 0]
    first = [64] if 64 in fit else []
    out = first + [m for m in twos if m not in first] + [m for m in fit if m not in twos]
    return out[:2]


def no_hf_manifest(spec: ir.Spec) -> list[Diagnostic]:
    """SS079 when the hf block names no HF manifest."""
    hf = spec.hf
    if hf is None or hf.manifest is not None:
        return []
    span = Span(hf.span.file, hf.span.line, hf.span.col, hf.span.line, hf.span.col + 2)
    return [
        diag(
            "SS079",
            "the hf block names no HF manifest: key, shape and config checks did not run",
            span,
            'write `hf "model.hf.json" { ... }` (made by `shardspec hf-manifest HF_DIR -o FILE`)',
        )
    ]


def stored_units(res: Resolved) -> list[tuple[str, tuple[int, ...], str, Fused | None]]:
    """Every storage unit a checkpoint of ``res`` holds: ``(key, global shape, the
    parameter or buffer it comes from, its fused dimension for a component)`` (for
    ``shardspec diff``)."""
    return [(u.name, u.shape, u.fqn, u.fused) for u in _units(res).values()]
