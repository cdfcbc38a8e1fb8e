"""Checks on the checkpoint key layout (`checkpoint keys NAME`): SS130, SS131."""

from __future__ import annotations

from shardspec.checks.layouts import _first_split_unit, _groups, _who
from shardspec.core import keylayouts
from shardspec.core.layout import sampled_table, storage_units
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
        split = keylayouts.split_of(name, fqns[0])
        if split is not None and len(split) != len(comps):
            leaves = ", ".join(split)
            out.append(
                diag(
                    "SS131",
                    f"{_who(fqns)}: `checkpoint keys {name}` stores this fused parameter's "
                    f"components as {leaves} (as the trainer's state-dict hooks present them), "
                    f"but the `fuse` item declares {len(comps)} ({', '.join(comps)})",
                    fuse.span,
                    f"declare {len(split)} components in the hooks' order ({leaves}), e.g. "
                    f"`fuse {fuse.dim.text} as q .., k .., v ..`",
                )
            )
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


def component_key(
    res: Resolved, name: str, fqn: str, comps: list[str], comp: str
) -> tuple[str, bool]:
    """Where a checkpoint of ``res`` stores component ``comp`` of parameter ``fqn``
    (stored as ``name``, its global name), as save does: ``(key, True)`` under its own key
    (``<name>.<comp>``, or the key a trainer's hook writes where the spec's key layout
    splits it), or ``(name, False)`` inside the fused tensor stored whole (`stored fused`,
    or a trainer's key layout that stores it so)."""
    layout = spec_key_layout(res.spec)
    split = keylayouts.split_of(layout, fqn)
    if split is not None and len(split) == len(comps):
        module, _, leaf_param = name.rpartition(".")
        parent = module.rpartition(".")[0]
        return (f"{parent}." if parent else "") + f"{split[comps.index(comp)]}.{leaf_param}", True
    if layout != keylayouts.OWN or stored_fused(res, fqn):
        return name, False
    return f"{name}.{comp}", True
