"""Checks on the checkpoint key layout (`checkpoint keys NAME`): SS130, SS131."""

from __future__ import annotations

from shardspec.checks.layouts import _first_split_unit, _groups, _who
from shardspec.core import keylayouts
from shardspec.core.layout import ParamLayout, sampled_table, storage_units
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic
from shardspec.findings.suggest import did_you_mean
from shardspec.frontend import ir
from shardspec.resolve.params import Resolved


def check_key_layout_name(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS130: `checkpoint keys NAME` names a key layout the runtime knows."""
    stmt = spec.checkpoint_keys
    if stmt is None or stmt.layout.text in keylayouts.NAMES:
        return []
    return [
        diag(
            "SS130",
            f"`checkpoint keys {stmt.layout.text}`: no such checkpoint key layout",
            stmt.layout.span,
            did_you_mean(stmt.layout.text, keylayouts.NAMES, "key layouts"),
        )
    ]


def check_key_layout_units(res: Resolved) -> list[Diagnostic]:
    """SS131: every fused parameter fits a trainer's key layout: the components its hooks
    present it as (in number), and, stored whole (the optimizer state of every fused
    parameter is), one block on every rank."""
    stmt = res.spec.checkpoint_keys
    name = stmt.layout.text if stmt is not None else keylayouts.OWN
    if name not in keylayouts.SPLITS or res.mesh is None:
        return []
    out: list[Diagnostic] = []
    for (index, layout), fqns in sorted(_groups(res).items(), key=lambda kv: (kv[0][0], kv[1])):
        rule = res.spec.rules[index]
        comps = [c for c, _ in storage_units(layout) if c is not None]
        if not comps or not rule.fusions:
            continue
        fuse = rule.fusions[0]
        hooked = keylayouts.hook_keys(name, fqns[0], _ndim(layout))
        if hooked is not None and (len(hooked[0]) != len(comps) or hooked[1] != fuse.squeezed):
            out.append(_hook_mismatch(fqns, name, hooked, comps, fuse))
            continue
        mesh = res.mesh_of_rule(index)
        assert mesh is not None
        table = [t for t, _ in sampled_table(layout, mesh)]
        found = _first_split_unit(layout, table, [(None, None)])
        if found is not None:
            rank, _, dim_name, pieces = found
            out.append(
                diag(
                    "SS131",
                    f"{_who(fqns)}: `checkpoint keys {name}` stores this fused tensor whole "
                    f"(its optimizer state at least), but rank {rank} holds dimension "
                    f"{dim_name!r} as {pieces} separate pieces, which a checkpoint cannot "
                    "store as one chunk",
                    fuse.span,
                    f"shard `{fuse.dim.text}` by whole groups (`fuse {fuse.dim.text} as N "
                    "groups of ...`, the groups dividing over the axes) or not at all; or "
                    "save in shardspec's own key layout (drop `checkpoint keys`)",
                )
            )
    return out


def _ndim(layout: ParamLayout) -> int:
    """The dimension count of a parameter's module tensor (name-indexed dims are none)."""
    return sum(1 for d in layout.dims if not d.name_indexed)


def _hook_mismatch(
    fqns: list[str],
    name: str,
    hooked: tuple[tuple[str, ...], bool],
    comps: list[str],
    fuse: ir.FuseItem,
) -> Diagnostic:
    """SS131: a fused parameter whose `fuse` item does not declare what the trainer's
    state-dict hooks present it as (as many components; squeezed where they are)."""
    keys, squeezed = hooked
    module = fqns[0].rpartition(".")[0]  # the hooks' keys lie under it, or beside it
    module = module if squeezed else module.rpartition(".")[0]
    leaves = ", ".join(k[len(module) :].lstrip(".").partition(".")[0] for k in keys)
    declared = f"{len(comps)} ({', '.join(comps)})" + (" squeezed" if fuse.squeezed else "")
    if squeezed:
        what = "each one index of the fused dimension, squeezed"
        example = f"`fuse {fuse.dim.text} as {leaves} squeezed`"
    else:
        what = "as the trainer's state-dict hooks present them"
        example = f"`fuse {fuse.dim.text} as q .., k .., v ..`"
    return diag(
        "SS131",
        f"{_who(fqns)}: `checkpoint keys {name}` stores this fused parameter's components "
        f"as {leaves} ({what}), but the `fuse` item declares {declared}",
        fuse.span,
        f"declare {len(keys)} components in the hooks' order ({leaves})"
        + (", squeezed" if squeezed else "")
        + f", e.g. {example}",
    )


def spec_key_layout(spec: ir.Spec) -> str:
    """The checkpoint key layout a spec names (`checkpoint keys`; shardspec's own without)."""
    stmt = spec.checkpoint_keys
    return stmt.layout.text if stmt is not None else keylayouts.OWN


def stored_fused(res: Resolved, fqn: str) -> bool:
    """Whether ``fqn``'s winning rule says `stored fused`."""
    m = res.matches.get(fqn)
    if m is None or m.winner is None:
        return False
    return any(f.stored_fused for f in res.spec.rules[m.winner].fusions)


def squeezed(res: Resolved, fqn: str) -> bool:
    """Whether ``fqn``'s fused dimension is squeezed (`fuse ... squeezed`): a checkpoint
    stores each component without it."""
    m = res.matches.get(fqn)
    if m is None or m.layout is None:
        return False
    return any(d.fusion is not None and d.fusion.squeezed for d in m.layout.dims)


def component_key(
    res: Resolved, name: str, fqn: str, comps: list[str], comp: str
) -> tuple[str, bool]:
    """Where a checkpoint of ``res`` stores component ``comp`` of parameter ``fqn``
    (stored as ``name``, its global name), as save does: ``(key, True)`` under its own key
    (``<name>.<comp>``, or the key a trainer's hook writes where the spec's key layout
    splits it), or ``(name, False)`` inside the fused tensor stored whole (`stored fused`,
    or a trainer's key layout that stores it so)."""
    layout = spec_key_layout(res.spec)
    m = res.matches.get(fqn)
    ndim = _ndim(m.layout) if m is not None and m.layout is not None else 0
    hooked = keylayouts.hook_keys(layout, name, ndim)
    if hooked is not None and len(hooked[0]) == len(comps):
        return hooked[0][comps.index(comp)], True
    if layout != keylayouts.OWN or stored_fused(res, fqn):
        return name, False
    return f"{name}.{comp}", True
