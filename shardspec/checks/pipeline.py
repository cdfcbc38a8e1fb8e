"""Checks of the ``pipeline`` block: its axis and patterns (SS090), then, with a manifest,
that every parameter lives on exactly one stage (SS091, SS092), that the layers split
over the stages (SS094) with none left empty (SS093), that stage-local names map back to
global ones (SS095), that every pattern places something (SS096), that ties fit the
manifest (SS097) and that a tie's alias is laid out as its source (SS098)."""

from __future__ import annotations

import re

from shardspec.checks.coverage import _more, entry_span
from shardspec.checks.structure import _PATTERN_SYNTAX
from shardspec.core.layout import Mesh, ParamLayout, first_difference, local_indices
from shardspec.core.patterns import PatternError
from shardspec.core.stages import (
    StageProblem,
    claims,
    is_layer_number,
    layer_of,
    prefix_glob,
    tie_problems,
    tied_aliases,
)
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic
from shardspec.findings.suggest import did_you_mean
from shardspec.frontend import ir
from shardspec.resolve.params import Resolved, tied_to

_GLOB_CHARS = re.compile(r"[*?{}\[\]]")

# The check code of each problem the stage arithmetic (shardspec.core.stages) names.
STAGE_CODES: dict[StageProblem, str] = {
    StageProblem.UNPLACED: "SS091",
    StageProblem.PLACED_TWICE: "SS092",
    StageProblem.EMPTY_STAGE: "SS093",
    StageProblem.SPLIT: "SS094",
    StageProblem.NAMES: "SS095",
    StageProblem.BAD_TIE: "SS097",
}


def _patterns(p: ir.Pipeline) -> list[tuple[str, ir.Pattern]]:
    return (
        [("first", x) for x in p.first]
        + [("last", x) for x in p.last]
        + [("split", s.pattern) for s in p.splits]
    )


def check_pipeline_block(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS090: the pipeline axis is a mesh axis that nothing else uses; its patterns are
    sound module prefixes; one split with one capture; a manifest to place names by."""
    p = spec.pipeline
    if p is None:
        return []
    out = []
    axis = p.axis.text
    axes = [a.name.text for a in spec.mesh.axes] if spec.mesh else []
    if spec.mesh is not None and axis not in axes:
        out.append(
            diag(
                "SS090",
                f"pipeline axis {axis!r} is not a mesh axis",
                p.axis.span,
                did_you_mean(axis, axes) or f"declare it in the mesh, e.g. `{axis}: 2`",
            )
        )
    if spec.fsdp is not None and spec.fsdp.text == axis:
        out.append(
            diag(
                "SS090",
                f"{axis!r} is both the pipeline axis and the FSDP axis",
                spec.fsdp.span,
                "stages hold different parameters: shard with FSDP over another axis",
            )
        )
    for rule in spec.rules:
        used = [a for s in rule.shards for a in s.axes]
        used += list(rule.local) + list(rule.replicate)
        used += [a for s in rule.checkpoint_shards for a in s.axes]
        for a in used:
            if a.text == axis:
                out.append(
                    diag(
                        "SS090",
                        f"rule {rule.pattern.text!r} places its parameter over the pipeline "
                        f"axis {axis!r}",
                        a.span,
                        "a stage holds its parameters whole on its own ranks: the pipeline "
                        "block says which stage, rules say how within it",
                    )
                )
    for what, pat in _patterns(p):
        try:
            g = prefix_glob(pat.text)
        except PatternError as e:
            out.append(
                diag(
                    "SS090",
                    f"bad {what} pattern {pat.text!r}: {e}",
                    pat.span,
                    "patterns are module prefixes; " + _PATTERN_SYNTAX,
                )
            )
            continue
        if what == "split" and len(g.captures) != 1:
            out.append(
                diag(
                    "SS090",
                    f"split pattern {pat.text!r} has {len(g.captures)} captures",
                    pat.span,
                    "capture the layer index once, as in `split layers.{layer}`",
                )
            )
        elif what != "split" and g.captures:
            out.append(
                diag(
                    "SS090",
                    f"{what} pattern {pat.text!r} captures a name",
                    pat.span,
                    "only the split pattern indexes layers; write `*` here",
                )
            )
    out.extend(_check_tie_lines(p))
    for extra in p.splits[1:]:
        out.append(
            diag(
                "SS090",
                "the pipeline has more than one split",
                extra.span,
                f"the first one is at line {p.splits[0].span.line}; split one layer family",
            )
        )
    if spec.manifest is None:
        out.append(
            diag(
                "SS090",
                "a pipeline needs a manifest: stages are placed by the whole model's names",
                p.span,
                'add `manifest "model.json"` (made by `shardspec manifest`)',
            )
        )
    return out


def _check_tie_lines(p: ir.Pipeline) -> list[Diagnostic]:
    """SS090 for tie lines: two literal parameter names, an alias tied once, to another
    name that is no alias itself."""
    out = []
    aliases: dict[str, ir.StageTie] = {}
    for t in p.ties:
        bad = [x for x in (t.alias, t.source) if _GLOB_CHARS.search(x.text)]
        for x in bad:
            out.append(
                diag(
                    "SS090",
                    f"tie names {x.text!r}, a pattern: a tie joins two parameters",
                    x.span,
                    "write whole parameter names: `tie output.weight = tok_embeddings.weight`",
                )
            )
        if bad:
            continue
        if t.alias.text == t.source.text:
            out.append(
                diag("SS090", f"{t.alias.text!r} is tied to itself", t.span, "delete the tie")
            )
            continue
        if t.alias.text in aliases:
            first = aliases[t.alias.text]
            out.append(
                diag(
                    "SS090",
                    f"{t.alias.text!r} is tied twice",
                    t.alias.span,
                    f"the first tie is at line {first.span.line}; an alias has one source",
                )
            )
            continue
        aliases[t.alias.text] = t
    for t in p.ties:
        if aliases.get(t.source.text) is not None and aliases.get(t.alias.text) is t:
            out.append(
                diag(
                    "SS090",
                    f"the tie's source {t.source.text!r} is itself an alias",
                    t.source.span,
                    f"tie {t.alias.text} to {aliases[t.source.text].source.text}, the weight "
                    "the model holds",
                )
            )
    return out


def check_stages(res: Resolved) -> list[Diagnostic]:
    """SS091-SS096 with a manifest, for a pipeline block without SS090 findings."""
    p = res.spec.pipeline
    if p is None or res.manifest is None:
        return []
    if check_pipeline_block(res.spec, set()):
        return []  # reported by the structure checks; placing would only repeat them
    spec = res.pipeline
    assert spec is not None
    out = []
    names = [f for f, _ in res.params]
    buffers = [f for f, _ in res.buffers]
    ties = tie_problems(spec, names, tied_to(res.manifest))
    for i, role, message, hint in ties:
        t = p.ties[i]
        out.append(diag("SS097", message, (t.alias if role == "alias" else t.source).span, hint))
    # An alias is a parameter of its stage; a buffer lives on its module's stage.
    placed = names + [a for a, _ in spec.ties] + buffers
    for what, pat in _patterns(p):
        g = prefix_glob(pat.text)
        if not any(g.match(f) is not None for f in placed):
            out.append(
                diag(
                    "SS096",
                    f"{what} pattern {pat.text!r} places no parameter",
                    pat.span,
                    "patterns are module prefixes of the manifest's names "
                    "(`output` places `output.weight`); fix or delete it",
                )
            )
    unplaced: list[str] = []
    twice: dict[tuple[tuple[str, ...], str], list[str]] = {}
    aliases = tied_aliases(spec, tied_to(res.manifest))
    for f in names:
        if f in aliases:
            continue  # the tie's alias: the tie's checks place it
        c = claims(spec, f)
        if not c:
            unplaced.append(f)
        elif len(c) > 1:
            twice.setdefault((tuple(c), "parameter"), []).append(f)
    for f in buffers:  # a buffer no declaration covers is every stage's
        c = claims(spec, f)
        if len(c) > 1:
            twice.setdefault((tuple(c), "buffer"), []).append(f)
    if unplaced:
        out.append(
            diag(
                "SS091",
                f"{len(unplaced)} parameter(s) on no pipeline stage: {_more(unplaced)}",
                entry_span(res, unplaced[0]),
                f"add their modules to `first`, `last` or the split of `pipeline {p.axis.text}`",
            )
        )
    for (kinds, noun), fqns in twice.items():
        claimant = _claiming(p, spec, kinds[-1], fqns[0])
        out.append(
            diag(
                "SS092",
                f"{len(fqns)} {noun}(s) placed by both {' and '.join(kinds)}: {_more(fqns)}",
                claimant.span if claimant is not None else p.span,
                f"each {noun} lives on exactly one stage; narrow one of the patterns",
            )
        )
    out.extend(_check_layer_names(res, p, spec, names + buffers))
    if not ties:
        out.extend(_check_tie_layouts(res, p))
    if out:
        return out
    err = res.stage_error
    if err is not None:
        split = p.splits[0] if p.splits else None
        span = p.span
        if err.problem is StageProblem.SPLIT and split is not None:
            span = split.counts_span or split.pattern.span
        out.append(diag(STAGE_CODES[err.problem], str(err), span, err.hint))
    return out


def _claiming(p: ir.Pipeline, spec, what: str, fqn: str) -> ir.Pattern | None:
    for kind, pat in _patterns(p):
        if kind == what and prefix_glob(pat.text).match(fqn) is not None:
            return pat
    return None


def _check_layer_names(res: Resolved, p: ir.Pipeline, spec, names: list[str]) -> list[Diagnostic]:
    """SS095: layer values are whole numbers (written once each way, for local names)."""
    if not p.splits:
        return []
    split = p.splits[0]
    values = {v for v in (layer_of(spec, f) for f in names) if v is not None}
    bad = sorted(v for v in values if not is_layer_number(v))
    if bad:
        return [
            diag(
                "SS095",
                f"split {split.pattern.text!r} captures {_more([repr(b) for b in bad])}, "
                "not layer numbers",
                split.pattern.span,
                "split a family indexed by whole numbers, such as `layers.{layer}`",
            )
        ]
    if spec.local_names:
        padded = sorted(v for v in values if str(int(v)) != v)
        if padded:
            return [
                diag(
                    "SS095",
                    f"stage-local names cannot map layer {padded[0]!r} back: local names "
                    "count from 0 in plain digits",
                    split.pattern.span,
                    "drop `local`, or name the layers 0, 1, 2, ...",
                )
            ]
    return []


def _check_tie_layouts(res: Resolved, p: ir.Pipeline) -> list[Diagnostic]:
    """SS098: a rule that matches a tie's alias lays it out as the source's rule does (the
    alias's stage holds a copy of the source's shards; the rule gives its module a style)."""
    if res.mesh is None:
        return []
    out = []
    for t in p.ties:
        am = res.tie_matches.get(t.alias.text)
        sm = res.matches.get(t.source.text)
        if am is None or sm is None or am.layout is None or sm.layout is None:
            continue
        mesh = res.mesh_for(sm)
        assert mesh is not None
        where = _differs(am.layout, sm.layout, mesh)
        if where is None:
            continue
        rule = res.spec.rules[am.winner] if am.winner is not None else None
        coord, want, have = where
        out.append(
            diag(
                "SS098",
                f"tied {t.alias.text} is laid out differently from its source "
                f"{t.source.text}: at mesh coordinate {coord} its rule gives indices {have}, "
                f"the source's {want}",
                rule.pattern.span if rule is not None else t.span,
                "a tie's alias holds a copy of the source's shards: shard it over the same "
                "axes in the same order (the rule may still state the module's style)",
            )
        )
    return out


def _differs(alias: ParamLayout, source: ParamLayout, mesh: Mesh):
    """The first mesh coordinate where the two layouts give a rank different indices
    (read within a stage), with the source's and the alias's; None when they agree."""
    import dataclasses

    a = dataclasses.replace(alias, stage_axis=None, stages=())
    s = dataclasses.replace(source, stage_axis=None, stages=())
    if a.local != s.local:
        return (), f"local over {sorted(s.local)}", f"local over {sorted(a.local)}"
    coord = first_difference(
        s, mesh, lambda c: local_indices(s, mesh, c) != local_indices(a, mesh, c), a
    )
    if coord is None:
        return None
    return coord, _fmt(local_indices(s, mesh, coord)), _fmt(local_indices(a, mesh, coord))


def _fmt(ranges) -> str:
    return "[" + ", ".join(",".join(f"{a}:{b}" for a, b in r) or "-" for r in ranges) + "]"
