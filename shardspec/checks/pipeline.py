"""Checks of the ``pipeline`` block: its axis and patterns (SS090), then, with a manifest,
that every parameter lives on exactly one stage (SS091, SS092), that the layers split
over the stages (SS094) with none left empty (SS093), that stage-local names map back to
global ones (SS095), and that every pattern places something (SS096)."""

from __future__ import annotations

from shardspec import ir
from shardspec.checks.coverage import _entry_span, _more
from shardspec.checks.registry import diag
from shardspec.checks.structure import _PATTERN_SYNTAX, _did_you_mean
from shardspec.diagnostics import Diagnostic
from shardspec.patterns import PatternError
from shardspec.resolve import Resolved
from shardspec.stages import claims, is_layer_number, layer_of, prefix_glob


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
                _did_you_mean(axis, axes) or f"declare it in the mesh, e.g. `{axis}: 2`",
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
    for what, pat in _patterns(p):
        g = prefix_glob(pat.text)
        if not any(g.match(f) is not None for f in names):
            out.append(
                diag(
                    "SS096",
                    f"{what} pattern {pat.text!r} places no parameter",
                    pat.span,
                    "patterns are module prefixes of the manifest's names "
                    "(`output` places `output.weight`); fix or delete it",
                )
            )
    unplaced, twice = [], {}
    for f in names:
        c = claims(spec, f)
        if not c:
            unplaced.append(f)
        elif len(c) > 1:
            twice.setdefault(tuple(c), []).append(f)
    if unplaced:
        out.append(
            diag(
                "SS091",
                f"{len(unplaced)} parameter(s) on no pipeline stage: {_more(unplaced)}",
                _entry_span(res, unplaced[0]),
                f"add their modules to `first`, `last` or the split of `pipeline {p.axis.text}`",
            )
        )
    for c, fqns in twice.items():
        pat = _claiming(p, spec, c[-1], fqns[0])
        out.append(
            diag(
                "SS092",
                f"{len(fqns)} parameter(s) placed by both {' and '.join(c)}: {_more(fqns)}",
                pat.span if pat is not None else p.span,
                "each parameter lives on exactly one stage; narrow one of the patterns",
            )
        )
    out.extend(_check_layer_names(res, p, spec, names))
    if out:
        return out
    err = res.stage_error
    if err is not None:
        split = p.splits[0] if p.splits else None
        span = p.span
        if err.code == "SS094" and split is not None:
            span = split.counts_span or split.pattern.span
        out.append(diag(err.code, str(err), span, err.hint))
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
