"""Checks on the computed layouts (need a manifest and a mesh).

Parameters that share a rule and a layout are checked once, and a finding names the first
parameter and how many more share it, so a 60-layer model does not print 60 copies.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import defaultdict

from shardspec.checks.heads import RuleHeads, rule_heads
from shardspec.core.layout import (
    SCATTER,
    Dim,
    HeadCut,
    LayoutError,
    LayoutProblem,
    Mesh,
    ParamLayout,
    component_indices,
    head_cut,
    representable,
    sampled_table,
    storage_units,
    torch_problem,
    torch_problem_text,
)
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span
from shardspec.frontend import ir
from shardspec.resolve.params import Resolved


def _groups(res: Resolved) -> dict[tuple[int, ParamLayout], list[str]]:
    # Resolution builds one layout object per (rule, shape): group by identity, which is
    # much cheaper than hashing the nested layout for every parameter.
    by_id: dict[tuple[int, int], tuple[ParamLayout, list[str]]] = {}
    for fqn, m in res.params:
        if m.layout is not None:
            entry = by_id.setdefault((m.winner, id(m.layout)), (m.layout, []))  # type: ignore[arg-type]
            entry[1].append(fqn)
    out: dict[tuple[int, ParamLayout], list[str]] = defaultdict(list)
    for (winner, _), (layout, fqns) in by_id.items():
        # Within its stage a parameter has the same layout on every stage: check it once,
        # over the mesh (replicated over the pipeline axis, which no dimension uses).
        if layout.stage_axis is not None:
            layout = dataclasses.replace(layout, stage_axis=None, stages=())
        out[(winner, layout)].extend(fqns)
    return out


def _who(fqns: list[str]) -> str:
    return fqns[0] + (f" (and {len(fqns) - 1} more)" if len(fqns) > 1 else "")


def _ranks(first: list[int], count: int) -> str:
    """``first``, the lowest ranks of ``count`` (at most 8 of them), as a message says them."""
    shown = ", ".join(str(r) for r in first[:8])
    return shown + (f" ... ({count} ranks)" if count > 8 else "")


# The check code each layout problem is reported under. Structure checks catch most of
# them before any layout is built; what reaches check_layout_errors is mostly SS021 (a rule
# that does not fit the tensor), SS050 and SS051 (fusions that do not fit).
LAYOUT_CODES: dict[LayoutProblem, str] = {
    LayoutProblem.MESH_SIZES: "SS010",
    LayoutProblem.DIM_COUNT: "SS021",
    LayoutProblem.UNKNOWN_DIM: "SS020",
    LayoutProblem.UNKNOWN_AXIS: "SS011",
    LayoutProblem.AXIS_REUSED: "SS012",
    LayoutProblem.LOCAL_AFTER_NONLOCAL: "SS026",
    LayoutProblem.NAME_INDEXED_NONLOCAL: "SS027",
    LayoutProblem.GROUP_COUNT: "SS052",
    LayoutProblem.COMPONENT_SIZES: "SS050",
    LayoutProblem.COMPONENT_SPLIT: "SS051",
}


def layout_code(e: LayoutError) -> str:
    """The check code a layout error is reported under (SS031 when it names no problem)."""
    return "SS031" if e.problem is None else LAYOUT_CODES[e.problem]


def check_layout_errors(res: Resolved) -> list[Diagnostic]:
    """SS021, SS050, SS051: rank and fusion sizes found wrong while building layouts."""
    seen: dict[tuple[int, str, str], list[str]] = defaultdict(list)
    hints: dict[tuple[int, str, str], str] = {}
    for fqn, m in sorted(res.matches.items()):
        if m.layout_error is not None and m.winner is not None:
            key = (m.winner, layout_code(m.layout_error), str(m.layout_error))
            seen[key].append(fqn)
            hints[key] = m.layout_error.hint
    out = []
    for (index, code, message), fqns in sorted(seen.items()):
        rule = res.spec.rules[index]
        if code == "SS021":
            span = _dims_span(rule) or rule.pattern.span
        elif rule.fusions:
            span = _fusion_of(rule, message).span
        else:
            span = rule.pattern.span
        out.append(diag(code, f"{_who(fqns)}: {message}", span, hints[(index, code, message)]))
    return out


def _fusion_of(rule: ir.Rule, message: str) -> ir.FuseItem:
    """The fusion a layout error is about: the one whose dimension the message names."""
    for f in rule.fusions:
        if repr(f.dim.text) in message:
            return f
    return rule.fusions[0]


def _dims_span(rule: ir.Rule) -> Span | None:
    """From the first to the last dimension name of a rule."""
    if not rule.dims:
        return None
    a, b = rule.dims[0].span, rule.dims[-1].span
    return Span(a.file, a.line, a.col, b.end_line, b.end_col)


def dim_span(rule: ir.Rule, dim: str) -> Span:
    """Where a rule places ``dim``: its ``shard`` statement, else its name in the list."""
    for s in rule.shards:
        if s.dim.text == dim:
            return s.span
    for d in rule.dims:
        if d.text == dim:
            return d.span
    return rule.pattern.span


def _default_axes(rule: ir.Rule, dim: Dim) -> list[str]:
    """The axes of ``dim`` that no ``shard`` statement names: the FSDP default."""
    named = {a.text for s in rule.shards if s.dim.text == dim.name for a in s.axes}
    return [a for a in dim.axes if a not in named]


def check_local_sizes(res: Resolved) -> list[Diagnostic]:
    """SS013: local axes have the size the manifest's model was built with."""
    if res.manifest is None or res.mesh is None:
        return []
    out = []
    args = res.manifest.factory_args
    for rule in res.spec.rules:
        mesh = res.mesh_of_rule(rule.index)
        for a in rule.local:
            built = args.get(a.text)
            # Only whole numbers record a size (a flag or a name says nothing about it).
            if (
                isinstance(built, int)
                and not isinstance(built, bool)
                and mesh is not None
                and a.text in mesh.names
            ):
                size = mesh.size(a.text)
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
    """SS023, SS024, SS030, SS031: uneven, empty, non-contiguous and unrepresentable shards;
    SS034, SS035: shards that cut heads, head sizes that do not fit."""
    heads, out = rule_heads(res)
    if res.mesh is None:
        return out
    for (index, layout), fqns in sorted(_groups(res).items(), key=lambda kv: (kv[0][0], kv[1])):
        rule = res.spec.rules[index]
        mesh, fsdp = res.mesh_of_rule(index), res.fsdp_of_rule(index)
        assert mesh is not None
        cuts, found = _check_heads(rule, layout, mesh, fqns, heads.get(index), fsdp)
        out.extend(found)
        out.extend(_check_one(rule, layout, mesh, fqns, cuts, fsdp))
    return out


def compute_axes(dim: Dim, fsdp: str | None) -> tuple[str, ...]:
    """The axes whose shards of ``dim`` the forward computes on: all but the FSDP axis,
    which FSDP2 gathers before the forward (local axes count: the module holds that shard)."""
    return tuple(a for a in dim.axes if a != fsdp)


def _check_heads(
    rule: ir.Rule,
    layout: ParamLayout,
    mesh: Mesh,
    fqns: list[str],
    heads: RuleHeads | None,
    fsdp: str | None,
) -> tuple[dict[str, HeadCut | None], list[Diagnostic]]:
    """SS035: a head size that does not divide its dimension (or component); SS034: a
    shard boundary inside a head. Returns, per dimension with heads, its cut (or None)."""
    cuts: dict[str, HeadCut | None] = {}
    out: list[Diagnostic] = []
    if heads is None:
        return cuts, out
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    for dim in layout.dims:
        given = heads.sizes.get(dim.name)
        if not given:
            continue
        bad = indivisible_heads(dim, given)
        if bad:
            head, item, what, size = bad
            out.append(
                diag(
                    "SS035",
                    f"{_who(fqns)}: heads of {head} do not divide {what} of size {size}",
                    item.span,
                    "the size is one head's size in indices (head_dim), not the number of heads",
                )
            )
            continue
        axes = compute_axes(dim, fsdp)
        cut = head_cut(dim, axes, sizes, heads.of(dim.name))
        cuts[dim.name] = cut
        if cut is not None:
            out.append(_head_cut_diag(rule, dim, mesh, fqns, heads, axes, cut))
    return cuts, out


def indivisible_heads(dim: Dim, given: dict) -> tuple[int, ir.HeadSize, str, int] | None:
    """(head size, item, what, size) of the first dimension or component a head size does
    not divide."""
    for comp, (head, item) in given.items():
        if dim.fusion is None:
            parts = [(f"dimension {dim.name!r}", dim.size)]
        else:
            parts = [
                (f"component {name!r} of {dim.name!r}", size)
                for name, size in dim.fusion.components
                if comp is None or name == comp
            ]
        for what, size in parts:
            if size % head:
                return head, item, what, size
    return None


def _head_cut_diag(
    rule: ir.Rule,
    dim: Dim,
    mesh: Mesh,
    fqns: list[str],
    heads: RuleHeads,
    axes: tuple[str, ...],
    cut: HeadCut,
) -> Diagnostic:
    """SS034 for ``cut``: the axis, the two ranks whose shards meet inside a head, the
    index, and in the hint the sizes of that axis (others as they are) that cut none."""
    n = mesh.size(cut.axis)
    what = f"{dim.name!r}"
    if cut.component is not None:
        what = f"component {cut.component!r} of {what}"
    if dim.fusion is None:
        what += f" ({dim.size // cut.head_size} heads of {cut.head_size})"
    else:
        what += f" (heads of {cut.head_size})"
    coord = [0] * len(mesh.names)
    for axis, c in cut.outer:
        coord[mesh.names.index(axis)] = c
    k = mesh.names.index(cut.axis)
    coord[k] = cut.coord - 1
    before = mesh.rank_of(coord)
    coord[k] = cut.coord
    after = mesh.rank_of(coord)
    within = ""
    if cut.outer:
        within = " of the block of " + ", ".join(f"{a}={c}" for a, c in cut.outer)
    message = (
        f"{_who(fqns)}: {cut.axis}={n} cuts a head of {what}: the shards of "
        f"{cut.axis}={cut.coord - 1} and {cut.axis}={cut.coord}{within} (ranks {before} and "
        f"{after}, among others) meet at index {cut.index}, inside head {cut.head} "
        f"(indices {cut.head_start}-{cut.head_start + cut.head_size - 1})"
    )
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    work = [
        m
        for m in range(1, min(max(n, dim.size // cut.head_size), 256) + 1)
        if head_cut(dim, axes, {**sizes, cut.axis: m}, heads.of(dim.name)) is None
    ]
    hint = (
        f"every {cut.axis} rank must hold whole heads: {_sizes_text(cut.axis, work)}; or "
        f"do not shard {dim.name!r} over {cut.axis} (replicate it there)"
    )
    return diag("SS034", message, dim_span(rule, dim.name), hint)


def _sizes_text(axis: str, sizes: list[int], limit: int = 6) -> str:
    """``tp=1 or 2 keep them whole``, ``only tp=1 keeps them whole``; with no sizes, that
    none does (the other axes on the dimension cut the heads already)."""
    if not sizes:
        return f"no size of {axis} keeps them whole while the other axes cut as they do"
    if len(sizes) == 1:
        return f"only {axis}={sizes[0]} keeps them whole"
    shown = [str(s) for s in sizes[:limit]]
    if len(sizes) > limit:
        listed = ", ".join(shown) + f" and {len(sizes) - limit} more up to {sizes[-1]}"
    else:
        listed = ", ".join(shown[:-1]) + f" or {shown[-1]}"
    return f"{axis}={listed} keep them whole"


def _axes_text(dim: Dim, mesh: Mesh, rule: ir.Rule) -> str:
    default = _default_axes(rule, dim)
    return " x ".join(
        f"{a}={mesh.size(a)}" + (" (FSDP default)" if a in default else "") for a in dim.axes
    )


def _check_one(
    rule: ir.Rule,
    layout: ParamLayout,
    mesh: Mesh,
    fqns: list[str],
    cuts: dict[str, HeadCut | None],
    fsdp: str | None,
) -> list[Diagnostic]:
    out = []
    # One shard per box of ranks that hold alike (layout.sample_boxes): the cost depends on
    # the layout's shape, not on the world size.
    sampled = sampled_table(layout, mesh)
    table = [t for t, _ in sampled]
    # Uneven: a dimension whose local sizes differ between ranks (and whose _StridedShard, if
    # any, torch's distribute_tensor cannot scatter: say so, and what works).
    scatter = torch_problem(layout, mesh, SCATTER) if representable(layout, mesh) is None else None
    for d, dim in enumerate(layout.dims):
        if not dim.axes or dim.fusion is not None:
            continue
        sizes = {t.shape[d] for t in table}
        if len(sizes) > 1:
            hint = _uneven_hint(dim, cuts, fsdp)
            if scatter is not None and layout.tensor_dims()[scatter.dim] is dim:
                hint += ". {}: {}".format(*torch_problem_text(layout, mesh, scatter))
            out.append(
                diag(
                    "SS023",
                    f"{_who(fqns)}: dimension {dim.name!r} of size {dim.size} "
                    f"does not divide over {_axes_text(dim, mesh, rule)}; "
                    f"local sizes {sorted(sizes)}",
                    dim_span(rule, dim.name),
                    hint,
                )
            )
    # Empty: name the ranks, and the first dimension that leaves them empty.
    boxes = [b for t, b in sampled if t.empty]
    if boxes:
        first = next(t for t, _ in sampled if t.empty)
        d = next(i for i, r in enumerate(first.indices) if not r)
        dim = layout.dims[d]
        count = sum(b.size for b in boxes)
        shown = list(itertools.islice(heapq.merge(*(b.ranks(mesh) for b in boxes)), 8))
        out.append(
            diag(
                "SS024",
                f"{_who(fqns)}: {'rank' if count == 1 else 'ranks'} {_ranks(shown, count)} "
                f"{'holds' if count == 1 else 'hold'} an empty local shard: "
                f"dimension {dim.name!r} of size {dim.size} over "
                f"{_axes_text(dim, mesh, rule)}",
                dim_span(rule, dim.name),
                "use fewer ranks on the sharded dimension, or accept "
                "empty shards (save/load handle them)",
            )
        )
    # Storage: each stored unit must be one box per rank.
    stored_fused = next((f for f in rule.fusions if f.stored_fused), None)
    units = [(None, None)] if stored_fused else storage_units(layout)
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
                stored_fused.span if stored_fused else dim_span(rule, dim_name),
                "store fused dimensions per component (drop `stored fused`)"
                if stored_fused
                else "shard the dimension over fewer axes",
            )
        )
    bad = representable(layout, mesh)
    if bad is not None:
        rank = mesh.rank_of(bad)
        dim_name, hint = _representable_hint(layout, rule, mesh)
        out.append(
            diag(
                "SS031",
                f"{_who(fqns)}: no DTensor placements describe this layout "
                f"(rank {rank} at {dict(zip(mesh.names, bad, strict=True))} would hold "
                "other indices)",
                dim_span(rule, dim_name) if dim_name else rule.pattern.span,
                hint,
            )
        )
    elif (problem := torch_problem(layout, mesh)) is not None:
        message, hint = torch_problem_text(layout, mesh, problem)
        dim_name = layout.tensor_dims()[problem.dim].name
        out.append(
            diag(
                "SS031",
                f"{_who(fqns)}: {message} (first at rank {mesh.rank_of(problem.coord)})",
                dim_span(rule, dim_name),
                hint,
            )
        )
    return out


def _uneven_hint(dim: Dim, cuts: dict[str, HeadCut | None], fsdp: str | None) -> str:
    """SS023's hint: uneven shards are fine for DTensor, but not if they cut heads."""
    if dim.name in cuts:
        if cuts[dim.name] is not None:
            return "torch.chunk sizes, which here cut heads (SS034)"
        return "fine for DTensor (torch.chunk sizes); the model-parallel shards hold whole heads"
    if compute_axes(dim, fsdp):
        return (
            "fine for DTensor (torch.chunk sizes), but check it is intended; if the "
            f"dimension comes in attention heads, declare them (`heads {dim.name} SIZE`) "
            "and lint checks that no shard cuts one"
        )
    return "fine for DTensor (torch.chunk sizes), but check it is intended"


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


def _representable_hint(layout: ParamLayout, rule: ir.Rule, mesh: Mesh) -> tuple[str | None, str]:
    """The dimension that most likely makes a layout unrepresentable, and what to do: the
    lines the rule holds, and changes tried on the layout that DTensor describes."""
    for dim in layout.dims:
        if dim.fusion is not None and len(dim.axes) > 1:
            return dim.name, _fused_twice_hint(layout, rule, mesh, dim)
        if (
            dim.fusion is not None
            and dim.fusion.groups == 1
            and dim.axes
            and len({s for _, s in dim.fusion.components}) > 1
        ):
            return dim.name, _unequal_components_hint(layout, rule, dim, mesh)
    for dim in layout.dims:
        if len(dim.axes) > 1:
            return dim.name, (
                f"uneven strided sharding of {dim.name!r}: make its size divisible by "
                f"{' x '.join(dim.axes)}"
            )
    return None, "uneven strided sharding: make the dimensions divisible by their axes"


def _statement(rule: ir.Rule, dim: str, axis: str) -> str | None:
    """The rule's `shard` line that cuts ``dim`` over ``axis``, as written; None where no
    line does (FSDP's default)."""
    for s in rule.shards:
        if s.dim.text == dim and any(a.text == axis for a in s.axes):
            axes = [a.text for a in s.axes]
            return f"shard {dim} over " + (axes[0] if len(axes) == 1 else f"({', '.join(axes)})")
    return None


def _describable(layout: ParamLayout, mesh: Mesh) -> bool:
    """Whether DTensor placements describe ``layout`` and torch's gather handles them."""
    try:
        return representable(layout, mesh) is None and torch_problem(layout, mesh) is None
    except (LayoutError, ValueError, ZeroDivisionError):
        return False


def _moves(layout: ParamLayout, mesh: Mesh, dim: Dim, axis: str) -> tuple[list[str], bool]:
    """Where ``axis`` can go instead of cutting ``dim``: (the other dimensions it can cut,
    evenly first, with the layout then describable; whether replicating ``axis`` is)."""
    i = layout.dims.index(dim)
    without = list(layout.dims)
    without[i] = dataclasses.replace(dim, axes=tuple(a for a in dim.axes if a != axis))
    other: list[tuple[bool, str]] = []
    for j, d in enumerate(layout.dims):
        if j == i or d.name_indexed:
            continue
        dims = list(without)
        dims[j] = dataclasses.replace(d, axes=(*d.axes, axis))
        if _describable(dataclasses.replace(layout, dims=tuple(dims)), mesh):
            uneven = d.size % (mesh.size(axis) * _product(mesh, d.axes)) != 0
            other.append((uneven, d.name))
    whole = _describable(dataclasses.replace(layout, dims=tuple(without)), mesh)
    return [name for _, name in sorted(other, key=lambda t: t[0])], whole


def _product(mesh: Mesh, axes: tuple[str, ...]) -> int:
    n = 1
    for a in axes:
        n *= mesh.size(a)
    return n


def _ways_out(layout: ParamLayout, rule: ir.Rule, mesh: Mesh, dim: Dim, axis: str) -> list[str]:
    """The edits of the rule (lines it holds, lines to add) that move ``axis`` off
    ``dim`` to a layout DTensor describes: another dimension, or none."""
    line = _statement(rule, dim.name, axis)
    moves, whole = _moves(layout, mesh, dim, axis)
    rest = [a for a in dim.axes if a != axis]
    if line is None:
        drop = ""
    elif rest:
        kept = rest[0] if len(rest) == 1 else f"({', '.join(rest)})"
        drop = f"`{line}` becomes `shard {dim.name} over {kept}` and "
    else:
        drop = f"drop `{line}` and "
    ways = [f"{drop}add `shard {moves[0]} over {axis}`"] if moves else []
    if whole:
        every = " (every rank then stores all of it)" if moves else ""
        ways.append(f"{drop}add `replicate {axis}`{every}")
    return ways


def _fused_twice_hint(layout: ParamLayout, rule: ir.Rule, mesh: Mesh, dim: Dim) -> str:
    """SS031's hint for a fused dimension that an axis cuts per component and another
    cuts again: move the inner axis where the layout is describable (computed)."""
    axis = dim.axes[1]
    line = _statement(rule, dim.name, axis)
    why = (
        f"FSDP shards the first dimension {dim.name!r} over {axis!r} by default"
        if line is None
        else f"`{line}` cuts {dim.name!r} over {axis!r}"
    )
    head = f"{why}, but {dim.axes[0]!r} already splits it per component"
    ways = _ways_out(layout, rule, mesh, dim, axis)
    if not ways:
        return f"{head}; shard it over {dim.axes[0]!r} alone"
    if len(layout.tensor_dims()) == 1:
        head += (
            f"; {dim.name!r} is the tensor's only dimension, so {axis!r} has no other to cut: "
            f"keep it whole over {axis!r}, cut per component over {dim.axes[0]!r} alone"
        )
    return f"{head}: " + "; or ".join(ways)


def _unequal_components_hint(layout: ParamLayout, rule: ir.Rule, dim: Dim, mesh: Mesh) -> str:
    """What to do when an axis cuts each of unequal components (q 64, k 32, v 32 over tp):
    the lines the rule holds, and edits tried on the layout that DTensor describes."""
    assert dim.fusion is not None
    axis = dim.axes[0]
    comps = dim.fusion.components
    sizes = ", ".join(f"{c} {n}" for c, n in comps)
    line = _statement(rule, dim.name, axis)
    if line is None:  # FSDP's default: storage only, any dimension will do
        ways = _ways_out(layout, rule, mesh, dim, axis)
        head = (
            f"components of {dim.name!r} differ in size ({sizes}) and FSDP shards the first "
            f"dimension {dim.name!r} over {axis!r} by default, cutting each separately, "
            "which no DTensor layout describes"
        )
        return f"{head}. Either " + "; or ".join(ways) if ways else head
    # A model-parallel cut the rule states: keep the dimension whole over it, or cut it as
    # the model's forward reads it.
    whole = f"`replicate {axis}` instead of `{line}`"
    if line != f"shard {dim.name} over {axis}":
        rest = [a for a in dim.axes if a != axis]
        kept = rest[0] if len(rest) == 1 else f"({', '.join(rest)})"
        whole = f"`{line}` becomes `shard {dim.name} over {kept}`, and add `replicate {axis}`"
    ways = [f"keep {dim.name!r} whole over {axis!r}: {whole}"]
    ways.append(
        f"build the module with its {axis} shard (Megatron style, each rank holding its "
        f"slice of each component): `local {axis}`"
    )
    n = mesh.size(axis)
    groups = next(
        (g for g in range(n, min(n for _, n in comps) + 1, n) if all(s % g == 0 for _, s in comps)),
        None,
    )
    if groups is not None:
        per = ", ".join(f"{c} {s // groups}" for c, s in comps)
        ways.append(
            f"if the model's forward reads the rows per group (Megatron's GQA layout), "
            f"`fuse {dim.name} as {groups} groups of {per}`"
        )
    return (
        f"components of {dim.name!r} differ in size ({sizes}) and {axis!r} cuts each "
        "separately, which no DTensor layout describes. Either " + "; or ".join(ways)
    )


def rule_styles(res: Resolved) -> dict[int, tuple[str, str, str | None, str | None]]:
    """Per rule, from its first parameter in the manifest: (fqn, the derived style or
    "?" or "", the module kind, the sharded dimension's name)."""
    from shardspec.core.styles import derive

    out: dict[int, tuple[str, str, str | None, str | None]] = {}
    for fqn, m in res.matches.items():
        if m.winner is None or m.layout is None or m.winner in out:
            continue
        if m.entry.kind != "param":
            continue
        fsdp = res.fsdp_of_rule(m.winner)
        dims = m.layout.tensor_dims()
        sharded = [
            i
            for i, d in enumerate(dims)
            if any(a != fsdp and a not in m.layout.local for a in d.axes)
        ]
        leaf = fqn.rpartition(".")[2]
        dim = sharded[0] if len(sharded) == 1 else None
        derived = derive(m.entry.module, leaf, dim) if sharded else None
        if len(sharded) > 1:
            derived = "?"
        out[m.winner] = (
            fqn,
            derived or "",
            m.entry.module,
            dims[dim].name if dim is not None else None,
        )
    return out


def check_module_styles(res: Resolved) -> list[Diagnostic]:
    """SS032: a stated style contradicts the module's kind and placements; SS033: no style
    derives for a module sharded over a model-parallel axis."""
    from shardspec.core.styles import why_not

    out = []
    rules = {r.index: r for r in res.spec.rules}
    for index, (fqn, derived, module, dim) in sorted(rule_styles(res).items()):
        if module is None:
            continue  # an older manifest, without module kinds: parallelize checks later
        rule = rules[index]
        st = rule.style
        stated = st.kind.text if st is not None else None
        if stated in ("colwise", "rowwise") and st is not None:
            if derived == "?":
                out.append(
                    diag(
                        "SS032",
                        f"style {stated}: no tensor-parallel style applies to {fqn} "
                        f"({why_not(module)})",
                        st.kind.span,
                        "use `style none` and let the module's forward handle its shards",
                    )
                )
            elif derived and derived != stated:
                out.append(
                    diag(
                        "SS032",
                        f"style {stated} contradicts the placements: {fqn} belongs to a "
                        f"{module} sharded on {dim!r}, which makes it {derived}",
                        st.kind.span,
                        f"state `style {derived}`, or shard the other dimension",
                    )
                )
        elif stated is None and derived == "?" and not _linear_pair(res, fqn):
            out.append(
                diag(
                    "SS033",
                    f"{fqn} is sharded over a model-parallel axis, but no tensor-parallel "
                    f"style derives for it ({why_not(module)})",
                    rule.pattern.span,
                    "state `style none` if the module's forward handles its shards; "
                    "parallelize refuses it otherwise",
                )
            )
    out.extend(check_linear_bias(res))
    return out


def _linear_pair(res: Resolved, fqn: str) -> bool:
    """Whether ``fqn`` is a Linear's (or transformers' Conv1D's) bias: its style comes from
    the weight."""
    m = res.matches.get(fqn)
    return m is not None and m.entry.module in _OUT_DIM and fqn.endswith(".bias")


# The weight's out dimension, per module kind with a bias: a Linear's [out, in], a Conv1D's
# [in, out]; and the kind in words.
_OUT_DIM = {"linear": (0, "Linear"), "conv1d": (1, "Conv1D")}


def check_linear_bias(res: Resolved) -> list[Diagnostic]:
    """SS032: a Linear's (or transformers' Conv1D's) bias must be cut as its weight's out
    dimension over the model-parallel axes (column-parallel), or not at all
    (row-parallel)."""
    rules = {r.index: r for r in res.spec.rules}

    def mp_axes(m, dim: int) -> tuple[str, ...]:
        fsdp = res.fsdp_of_rule(m.winner)
        d = m.layout.tensor_dims()[dim]
        return tuple(a for a in d.axes if a != fsdp and a not in m.layout.local)

    out = []
    reported: set[int] = set()
    for fqn, m in res.matches.items():
        if not fqn.endswith(".bias") or m.entry.module not in _OUT_DIM or m.layout is None:
            continue
        w = res.matches.get(fqn[: -len("bias")] + "weight")
        if w is None or w.layout is None or m.winner is None or m.winner in reported:
            continue
        out_dim, kind = _OUT_DIM[m.entry.module]
        if len(w.layout.tensor_dims()) <= out_dim:
            continue
        want = mp_axes(w, out_dim)
        got = mp_axes(m, 0) if m.layout.tensor_dims() else ()
        if want != got:
            reported.add(m.winner)
            what = (
                f"replicated over {', '.join(want)}"
                if not got
                else f"sharded over {', '.join(got)}"
            )
            need = f"`shard out over {', '.join(want)}`" if want else "no model-parallel shard"
            out.append(
                diag(
                    "SS032",
                    f"{fqn} is {what}, but its {kind}'s weight is cut on its out dimension "
                    f"over {', '.join(want) or 'no model-parallel axis'}: the bias must be "
                    "cut the same way",
                    rules[m.winner].pattern.span,
                    f"give the bias {need}",
                )
            )
    return out


LAYOUT_CHECKS = (check_layout_errors, check_local_sizes, check_shards, check_module_styles)
