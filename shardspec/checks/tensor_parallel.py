"""Checks of tensor parallelism across modules (need a manifest that records module kinds,
classes and ties):

* SS036: within a block, a colwise module's local columns reach no rowwise module, or a
  rowwise module reads columns no colwise module cut (``qkv_proj`` replicated over tp,
  ``o_proj`` sharded over it).
* SS037: a tied parameter (one tensor, two modules) sharded over a model-parallel axis of
  size > 1, which ``parallelize`` refuses.
* SS038: torch's colwise or rowwise style on a module whose class runs a forward of its own.

A *block* is the smallest module holding two or more Linear or Embedding modules (an
attention, an MLP; the model itself for the embedding and the head): the check reasons from
the manifest's module kinds and the placements, not from names, so it does not guess which
module feeds which. A block is right over an axis when its modules are all replicated over
it, or colwise modules feed rowwise ones. Modules that hold local shards over the axis
(Megatron style), run their own forward (``style none``) or are neither Linear nor
Embedding take part in ways lint cannot see: their block is not checked over that axis.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from shardspec.core.styles import (
    EMBEDDING,
    LINEAR,
    custom_module_hint,
    derive,
    runs_torch_forward,
    why_not_torch,
)
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic
from shardspec.frontend import ir
from shardspec.resolve.params import Match, Resolved

# What a module is to its block over one axis.
PRODUCER, CONSUMER, REPLICATED, EXEMPT = "producer", "consumer", "replicated", "exempt"
NEUTRAL = "neutral"  # cut, with whole activations in and out (`output replicate`)


@dataclass
class _Module:
    """A module holding placed parameters: its kind, its weight's rule and, per
    model-parallel axis, what it is to its block."""

    name: str
    kind: str | None
    rule: int
    fqn: str  # the parameter that speaks for it (its weight)
    roles: dict[str, str] = field(default_factory=dict)  # axis -> role (absent: replicated)
    dtensor: bool = False  # a producer whose output stays a DTensor


def _owner(fqn: str) -> tuple[str, str]:
    owner, _, leaf = fqn.rpartition(".")
    return owner, leaf


def _mp_axes(m: Match, fsdp: str | None) -> dict[str, int]:
    """Model-parallel axis -> the tensor dimension of ``m``'s parameter it shards (local
    axes and the fsdp axis left out)."""
    assert m.layout is not None
    return {
        a: i
        for i, d in enumerate(m.layout.tensor_dims())
        for a in d.axes
        if a != fsdp and a not in m.layout.local
    }


def _style(res: Resolved, m: Match, fsdp: str | None) -> tuple[str | None, str | None]:
    """(the colwise/rowwise style the module of parameter ``m`` gets, stated or derived,
    or None; the style the spec states, or None)."""
    assert m.winner is not None
    st = res.spec.rules[m.winner].style
    stated = st.kind.text if st is not None else None
    dims = set(_mp_axes(m, fsdp).values())
    derived = derive(m.entry.module, "weight", dims.pop()) if len(dims) == 1 else None
    if stated is not None and derived is not None and stated != derived:
        return None, stated  # a style the placements contradict (SS032)
    style = stated or derived
    return (style if style in ("colwise", "rowwise") else None), stated


def _modules(res: Resolved) -> dict[str, _Module]:
    """Every module holding a placed parameter, with its role per model-parallel axis."""
    fsdp = res.spec.fsdp.text if res.spec.fsdp else None
    params: dict[str, dict[str, Match]] = defaultdict(dict)
    for fqn, m in res.params:
        if m.layout is not None:
            owner, leaf = _owner(fqn)
            params[owner][leaf] = m
    out: dict[str, _Module] = {}
    for owner, leaves in params.items():
        weight = leaves.get("weight")
        kind = weight.entry.module if weight is not None else None
        first = weight or next(iter(leaves.values()))
        assert first.winner is not None
        mod = _Module(owner, kind, first.winner, first.entry.fqn)
        out[owner] = mod
        local = {a for m in leaves.values() if m.layout is not None for a in m.layout.local}
        sharded = {a for m in leaves.values() for a in _mp_axes(m, fsdp)}
        for a in local:
            mod.roles[a] = EXEMPT
        if weight is None or kind not in (LINEAR, EMBEDDING):
            for a in sharded - local:
                mod.roles[a] = EXEMPT
            continue
        style, _ = _style(res, weight, fsdp)
        st = res.spec.rules[weight.winner].style  # type: ignore[index]
        for a in sharded - local:
            if style is None or a not in _mp_axes(weight, fsdp):
                mod.roles[a] = EXEMPT  # its own forward, or a bias cut alone (SS032)
                continue
            default_in = "features" if style == "rowwise" and kind == LINEAR else "replicate"
            default_out = "features" if style == "colwise" else "replicate"
            inp = st.input.text if st is not None and st.input is not None else default_in
            outp = st.output.text if st is not None and st.output is not None else default_out
            if style == "colwise" and outp == "features":
                mod.roles[a] = PRODUCER
                mod.dtensor = st is not None and st.dtensor
            elif style == "rowwise" and inp == "features":
                mod.roles[a] = CONSUMER
            else:
                mod.roles[a] = NEUTRAL
    return out


def _blocks(modules: dict[str, _Module]) -> dict[str, list[_Module]]:
    """Block name -> its modules: each module's nearest enclosing module that holds two or
    more Linear or Embedding modules (modules of a model with fewer belong to none)."""
    count: dict[str, int] = defaultdict(int)
    for mod in modules.values():
        if mod.kind in (LINEAR, EMBEDDING):
            for prefix in _ancestors(mod.name):
                count[prefix] += 1
    out: dict[str, list[_Module]] = defaultdict(list)
    for mod in modules.values():
        block = next((p for p in _ancestors(mod.name) if count[p] >= 2), None)
        if block is not None:
            out[block].append(mod)
    return out


def _ancestors(name: str) -> list[str]:
    """The modules enclosing module ``name``, nearest first, the model (``""``) last."""
    parts = name.split(".") if name else []
    return [".".join(parts[:n]) for n in range(len(parts) - 1, -1, -1)]


def _names(block: str, mods: list[_Module], limit: int = 4) -> str:
    rel = [m.name[len(block) + 1 :] if block else m.name for m in mods]
    shown = ", ".join(rel[:limit])
    return shown + (f" and {len(rel) - limit} more" if len(rel) > limit else "")


def _are(mods: list[_Module]) -> str:
    return "is" if len(mods) == 1 else "are"


def check_unpaired_cuts(res: Resolved) -> list[Diagnostic]:
    """SS036: per block and model-parallel axis of size > 1, colwise modules whose
    output stays cut and rowwise modules that read cut input come together."""
    if res.mesh is None:
        return []
    mesh = res.mesh
    rules = res.spec.rules
    found: dict[tuple, tuple[str, list[_Module], list[_Module], list[_Module], str, int]] = {}
    counts: dict[tuple, int] = defaultdict(int)
    for block, mods in sorted(_blocks(_modules(res)).items()):
        axes = sorted({a for m in mods for a in m.roles if mesh.size(a) > 1})
        for axis in axes:
            roles = [(m, m.roles.get(axis, REPLICATED)) for m in mods]
            if any(r == EXEMPT for _, r in roles):
                continue
            producers = [m for m, r in roles if r == PRODUCER]
            consumers = [m for m, r in roles if r == CONSUMER]
            whole = [m for m, r in roles if r == REPLICATED and m.kind in (LINEAR, EMBEDDING)]
            if consumers and not producers:
                kind = CONSUMER
            elif any(not m.dtensor for m in producers) and not consumers:
                kind = PRODUCER
            else:
                continue
            key = (axis, kind, tuple(sorted((m.rule, m.roles.get(axis, "")) for m in mods)))
            counts[key] += 1
            if key not in found:
                found[key] = (block, producers, consumers, whole, axis, mesh.size(axis))
    out = []
    for key, (block, producers, consumers, whole, axis, n) in found.items():
        more = f" (and {counts[key] - 1} more like it)" if counts[key] > 1 else ""
        where = f"in {block or 'the model'}{more}"
        if key[1] == CONSUMER:
            rest = f": {_names(block, whole)} {_are(whole)} replicated over {axis}" if whole else ""
            message = (
                f"{where}, {_names(block, consumers)} "
                f"{'reads its' if len(consumers) == 1 else 'read their'} input as features cut "
                f"over {axis} (rowwise, size {n}), but no module there cuts its output that "
                f"way{rest}"
            )
            hint = (
                f"shard the out dimension of {_names(block, whole)} over {axis} too (colwise), "
                f"or keep {_names(block, consumers)} replicated over {axis}"
                if whole
                else f"keep {_names(block, consumers)} replicated over {axis}, or state "
                "`input replicate` where the input is whole"
            )
            span = rules[consumers[0].rule].pattern.span
        else:
            rest = (
                f": {_names(block, whole)} {_are(whole)} replicated over {axis} and would read "
                "a rank's columns as the whole"
                if whole
                else f": the output leaves {block or 'the model'} cut"
            )
            message = (
                f"{where}, {_names(block, producers)} "
                f"{'cuts its' if len(producers) == 1 else 'cut their'} output on the features "
                f"over {axis} (colwise, size {n}), but no module there reads features cut "
                f"that way{rest}"
            )
            rowwise = (
                f"shard the in dimension of {_names(block, whole)} over {axis} (rowwise), "
                if whole
                else ""
            )
            hint = (
                f"{rowwise}keep {_names(block, producers)} replicated over {axis}, or gather "
                "the output with `style colwise output replicate` (`dtensor` hands it on as a "
                "DTensor, for loss parallelism)"
            )
            span = rules[producers[0].rule].pattern.span
        out.append(diag("SS036", message, span, hint))
    return out


def check_tied_sharded(res: Resolved) -> list[Diagnostic]:
    """SS037: a tied parameter (the manifest's ``tied_to``) sharded over a model-parallel
    axis of size > 1, unless a pipeline puts its two names on different stages."""
    if res.mesh is None or res.manifest is None:
        return []
    mesh = res.mesh
    fsdp = res.spec.fsdp.text if res.spec.fsdp else None
    out = []
    reported: set[tuple[int | None, ...]] = set()
    for entry in res.manifest.params:
        if entry.tied_to is None:
            continue
        alias, source = entry.fqn, entry.tied_to
        stage = res.stages.stage if res.stages is not None else {}
        if alias in stage and source in stage and stage[alias] != stage[source]:
            continue  # two tensors, one per stage
        cut: list[tuple[Match, list[str]]] = []
        for name in (source, alias):
            m = res.matches.get(name)
            if m is None or m.layout is None or m.winner is None or m.ignored_by is not None:
                continue
            axes = sorted(a for a in _mp_axes(m, fsdp) if mesh.size(a) > 1)
            if axes:
                cut.append((m, axes))
        if not cut:
            continue
        key = tuple(res.matches[n].winner if n in res.matches else None for n in (source, alias))
        if key in reported:
            continue
        reported.add(key)
        m, axes = cut[0]
        sizes = ", ".join(f"{a} (size {mesh.size(a)})" for a in axes)
        assert m.winner is not None
        out.append(
            diag(
                "SS037",
                f"{alias} is tied to {source} (one tensor used by two modules), and "
                f"{m.entry.fqn} is sharded over {sizes}: torch's styles cut the weight for "
                "each module apart, which parts the tie, so parallelize refuses the model",
                res.spec.rules[m.winner].pattern.span,
                f"keep the tied weight replicated over {', '.join(axes)} (`replicate "
                f"{', '.join(axes)}`), untie the weights in the model, or put the two "
                "modules on different pipeline stages; distribute, load_hf and export_hf keep "
                "the tie (a spec for checkpoint conversion may suppress this warning)",
            )
        )
    return out


def check_custom_modules(res: Resolved) -> list[Diagnostic]:
    """SS038: torch's colwise/rowwise style (stated or derived) on a module whose class
    runs a forward of its own (manifests that record classes only)."""
    fsdp = res.spec.fsdp.text if res.spec.fsdp else None
    first: dict[int, tuple[Match, str, str | None]] = {}
    count: dict[int, int] = defaultdict(int)
    for fqn, m in res.params:
        forward = m.entry.forward_class
        if m.layout is None or forward is None or runs_torch_forward(forward):
            continue
        if _owner(fqn)[1] != "weight" or m.entry.module not in (LINEAR, EMBEDDING):
            continue
        style, stated = _style(res, m, fsdp)
        if style is None:
            continue
        assert m.winner is not None
        count[m.winner] += 1
        first.setdefault(m.winner, (m, style, stated))
    out = []
    for rule_index, (m, style, stated) in sorted(first.items()):
        rule: ir.Rule = res.spec.rules[rule_index]
        more = f" (and {count[rule_index] - 1} more like it)" if count[rule_index] > 1 else ""
        how = "stated" if stated else "derived from its placements"
        forward = m.entry.forward_class
        assert forward is not None
        span = rule.style.kind.span if stated and rule.style is not None else rule.pattern.span
        out.append(
            diag(
                "SS038",
                f"{m.entry.fqn}{more} gets torch's {style} style ({how}), but its module "
                + why_not_torch(m.entry.cls or forward, forward, style),
                span,
                custom_module_hint(lint=True),
            )
        )
    return out


TENSOR_PARALLEL_CHECKS = (check_unpaired_cuts, check_tied_sharded, check_custom_modules)
