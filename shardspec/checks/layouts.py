"""Checks on the computed layouts (need a manifest and a mesh).

Parameters that share a rule and a layout are checked once, and a finding names the first
parameter and how many more share it, so a 60-layer model does not print 60 copies.
"""

from __future__ import annotations

from collections import defaultdict

from shardspec.checks.registry import diag
from shardspec.diagnostics import Diagnostic
from shardspec.layout import (
    Mesh,
    ParamLayout,
    component_indices,
    rank_table,
    representable,
    storage_units,
)
from shardspec.resolve import Resolved


def _groups(res: Resolved) -> dict[tuple[int, ParamLayout], list[str]]:
    out: dict[tuple[int, ParamLayout], list[str]] = defaultdict(list)
    for fqn, m in res.params:
        if m.layout is not None:
            out[(m.winner, m.layout)].append(fqn)  # type: ignore[index]
    return out


def _who(fqns: list[str]) -> str:
    return fqns[0] + (f" (and {len(fqns) - 1} more)" if len(fqns) > 1 else "")


def _ranks(ranks: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" ... ({len(ranks)} ranks)" if len(ranks) > limit else "")


def check_layout_errors(res: Resolved) -> list[Diagnostic]:
    """Rank, fusion sizes and divisibility problems found while building layouts."""
    seen: dict[tuple[int, str, str], list[str]] = defaultdict(list)
    hints: dict[tuple[int, str, str], str] = {}
    for fqn, m in sorted(res.matches.items()):
        if m.layout_error is not None and m.winner is not None:
            key = (m.winner, m.layout_error.code, str(m.layout_error))
            seen[key].append(fqn)
            hints[key] = m.layout_error.hint
    out = []
    for (index, code, message), fqns in sorted(seen.items()):
        rule = res.spec.rules[index]
        span = rule.span if code != "SS021" else rule.pattern.span
        if code == "SS021":
            span = _dims_span(rule) or span
        out.append(diag(code, f"{_who(fqns)}: {message}", span, hints[(index, code, message)]))
    return out


def _dims_span(rule):
    if not rule.dims:
        return None
    from shardspec.diagnostics import Span

    a, b = rule.dims[0].span, rule.dims[-1].span
    return Span(a.file, a.line, a.col, b.end_line, b.end_col)


def check_local_sizes(res: Resolved) -> list[Diagnostic]:
    """Local axes must have the size the manifest's model was built with."""
    if res.manifest is None or res.mesh is None:
        return []
    out = []
    args = res.manifest.factory_args
    for rule in res.spec.rules:
        for a in rule.local:
            if a.text in args and a.text in res.mesh.names:
                built = args[a.text]
                size = res.mesh.size(a.text)
                if built != size:
                    out.append(
                        diag(
                            "SS013",
                            f"local axis {a.text!r} has size {size}, but the "
                            f"manifest's model was built with {a.text}={built}",
                            a.span,
                            f"regenerate the manifest with `--arg {a.text}={size}`, or "
                            f"set the mesh's {a.text} to {built}",
                        )
                    )
    return out


def check_shards(res: Resolved) -> list[Diagnostic]:
    """Uneven, empty, non-contiguous and unrepresentable shards."""
    mesh = res.mesh
    if mesh is None:
        return []
    out = []
    for (index, layout), fqns in sorted(_groups(res).items(), key=lambda kv: (kv[0][0], kv[1])):
        rule = res.spec.rules[index]
        out.extend(_check_one(rule, layout, mesh, fqns))
    return out


def _check_one(rule, layout: ParamLayout, mesh: Mesh, fqns: list[str]) -> list[Diagnostic]:
    out = []
    table = rank_table(layout, mesh)
    span = rule.span
    for s in rule.shards:
        span = s.span
        break
    # Uneven: a dimension whose local sizes differ between ranks.
    for d, dim in enumerate(layout.dims):
        if not dim.axes:
            continue
        sizes = {t.shape[d] for t in table}
        if len(sizes) > 1 and dim.fusion is None:
            axes = " x ".join(f"{a}={mesh.size(a)}" for a in dim.axes)
            out.append(
                diag(
                    "SS023",
                    f"{_who(fqns)}: dimension {dim.name!r} of size {dim.size} "
                    f"does not divide over {axes}; local sizes {sorted(sizes)}",
                    span,
                    "fine for DTensor (torch.chunk sizes), but check it is intended",
                )
            )
    empty = [t.rank for t in table if t.empty]
    if empty:
        out.append(
            diag(
                "SS024",
                f"{_who(fqns)}: ranks {_ranks(empty)} hold an empty local shard",
                span,
                "use fewer ranks on the sharded dimension, or accept "
                "empty shards (save/load handle them)",
            )
        )
    # Storage: each stored unit must be one box per rank.
    units = [(None, None)] if rule_stored_fused(rule) else storage_units(layout)
    found = _first_split_unit(layout, table, units)
    if found is not None:
        rank, comp, dim_name, pieces = found
        what = f"component {comp!r} of " if comp else ""
        out.append(
            diag(
                "SS030",
                f"{_who(fqns)}: rank {rank} holds {what}dimension {dim_name!r} "
                f"as {pieces} separate pieces, which a checkpoint cannot store as one "
                "chunk",
                span,
                "store fused dimensions per component (drop `stored fused`)",
            )
        )
    bad = representable(layout, mesh)
    if bad is not None:
        rank = mesh.rank_of(bad)
        out.append(
            diag(
                "SS031",
                f"{_who(fqns)}: no DTensor placements describe this layout "
                f"(rank {rank} at {dict(zip(mesh.names, bad, strict=True))} would hold "
                "other indices)",
                span,
                _representable_hint(layout),
            )
        )
    return out


def _first_split_unit(layout, table, units):
    """(rank, component, dim name, pieces) of the first stored unit that is not one box."""
    for comp, d in units:
        for t in table:
            idx = list(t.indices)
            if comp is not None and d is not None:
                fusion = layout.dims[d].fusion
                assert fusion is not None
                idx[d] = component_indices(fusion, idx[d], comp)
            for i, r in enumerate(idx):
                if len(r) > 1:
                    return t.rank, comp, layout.dims[i].name, len(r)
    return None


def rule_stored_fused(rule) -> bool:
    return any(f.stored_fused for f in rule.fusions)


def _representable_hint(layout: ParamLayout) -> str:
    for dim in layout.dims:
        if dim.fusion is not None and len(dim.axes) > 1:
            return (
                f"dimension {dim.name!r} is split per component over {dim.axes[0]!r}; "
                f"shard a different dimension over {dim.axes[1]!r}"
            )
        if (
            dim.fusion is not None
            and dim.fusion.groups == 1
            and dim.axes
            and len({s for _, s in dim.fusion.components}) > 1
        ):
            return (
                f"components of {dim.name!r} differ in size; use the grouped layout "
                "(`fuse qkv as N groups of ...`) or make the axis local"
            )
    return "uneven strided sharding: make the dimension divisible by its axes"


LAYOUT_CHECKS = (check_layout_errors, check_local_sizes, check_shards)
