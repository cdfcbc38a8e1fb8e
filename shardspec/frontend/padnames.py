"""``pad vocab to 64``: a map line's pad names the target rule's dimension; here it becomes
the index it stands for (the dimension of the tensor at that point of the line's chain,
as ``pad 0 to 64`` gives it), when the spec is read, so that every later stage sees an
index as before.

The rules that decide: the one that wins the line's target (its ``{name}`` captures
standing for a segment; the highest precedence, ties all kept), or, where none matches,
every rule; among them the tensor dimensions (not name captures) of that name. One
position among them is the answer; none, or several, is SS118.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from shardspec.core.patterns import PatternError, compile_glob
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic
from shardspec.findings.suggest import did_you_mean
from shardspec.frontend import ir

_CAPTURE = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")


def resolve_pad_names(spec: ir.Spec) -> tuple[ir.Spec, list[Diagnostic]]:
    """``spec`` with every named pad's ``dim`` set, and SS118 for names that resolve to no
    dimension or to several positions."""
    hf = spec.hf
    if hf is None or not any(t.dim_name for m in hf.maps for t in _all(m)):
        return spec, []
    out: list[Diagnostic] = []
    maps = []
    for m in hf.maps:
        if not any(t.dim_name for t in _all(m)):
            maps.append(m)
            continue
        dims = _tensor_dims(spec.rules, m.target.text)
        transforms = _resolved(m.transforms, spec.rules, dims, out)
        parts = m.parts
        if parts is not None:
            parts = tuple(
                dataclasses.replace(p, transforms=_resolved(p.transforms, spec.rules, dims, out))
                for p in parts
            )
        maps.append(dataclasses.replace(m, transforms=transforms, parts=parts))
    return dataclasses.replace(spec, hf=dataclasses.replace(hf, maps=tuple(maps))), out


def _all(m: ir.HFMapItem) -> list[ir.HFTransform]:
    return [*m.transforms, *(t for p in m.parts or () for t in p.transforms)]


def _tensor_dims(rules: Sequence[ir.Rule], target: str) -> list[tuple[int, list[str]]]:
    """The rules that place ``target`` (captures standing for any segment), else every
    rule: each one's index and tensor dimensions' names (of a rule table, read from its
    shape: no rule's node is read again)."""
    sample = _CAPTURE.sub("x0", target)
    table = rules if isinstance(rules, ir.RuleTable) else None
    every: list[tuple[int, list[str]]] = []
    matching: list[tuple[tuple[int, ...], int, list[str]]] = []
    for i in range(len(rules)):
        shape = rules[i] if table is None else table.shapes[table.shape_of(i)]
        try:
            glob = compile_glob(shape.pattern.text if table is None else table.pattern_text(i))
        except PatternError:
            continue
        dims = [d.text for d in shape.dims if d.text not in glob.captures]
        every.append((i, dims))
        if glob.match(sample) is not None or glob.match(target) is not None:
            matching.append((glob.key, i, dims))
    if matching:
        best = max(key for key, _, _ in matching)  # the rule that wins (resolve's precedence)
        every = [(i, dims) for key, i, dims in matching if key == best]
    return every


def _resolved(
    chain: tuple[ir.HFTransform, ...],
    every: Sequence[ir.Rule],
    rules: list[tuple[int, list[str]]],
    out: list[Diagnostic],
) -> tuple[ir.HFTransform, ...]:
    got = []
    for i, t in enumerate(chain):
        if t.dim_name is not None:
            model_dim = _position(t.dim_name, every, rules, out)
            if model_dim is not None:
                # the tensor at the pad's point: transposes after it swap a 2-D tensor's dims
                swaps = sum(1 for later in chain[i + 1 :] if later.kind == "transpose")
                ndim = len(next(d for _, d in rules if t.dim_name.text in d))
                dim = 1 - model_dim if swaps % 2 and ndim == 2 else model_dim
                t = dataclasses.replace(t, dim=dim)
        got.append(t)
    return tuple(got)


def _position(
    name: ir.Name,
    every: Sequence[ir.Rule],
    rules: list[tuple[int, list[str]]],
    out: list[Diagnostic],
) -> int | None:
    """The index of dimension ``name`` among the rules' tensor dimensions (SS118 when it
    is none of them, or at several indices)."""
    where: dict[int, int] = {}  # dimension index -> the first rule with it there
    for rule, dims in rules:
        if name.text in dims:
            where.setdefault(dims.index(name.text), rule)
    if len(where) == 1:
        return next(iter(where))
    if not where:
        names = sorted({d for _, dims in rules for d in dims})
        out.append(
            diag(
                "SS118",
                f"pad: {name.text!r} is no dimension of the rules that place this line's target",
                name.span,
                did_you_mean(name.text, names)
                if names
                else "name a dimension of the target's rule, or give its index (`pad 0 to 64`)",
            )
        )
        return None
    lines = ", ".join(f"{d} (line {every[r].span.line})" for d, r in sorted(where.items()))
    out.append(
        diag(
            "SS118",
            f"pad: dimension {name.text!r} is at several indices in the rules that may place "
            f"this line's target: {lines}",
            name.span,
            f"give the index instead (`pad {min(where)} to ...`)",
        )
    )
    return None
