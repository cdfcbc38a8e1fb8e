"""``heads`` items: what they say, checked and resolved to head sizes.

``heads kv 128`` says that dimension ``kv`` comes in heads of 128 indices (``heads qkv 16``
gives every component of a fused ``qkv`` heads of 16; ``heads q 16, k 16`` some of them).
A size may be a name: a whole-number factory argument of the manifest, or a config.json
key of the hf block's HF manifest, so that it follows the model's config.

The structural check (SS020, SS027, SS035) needs only the spec; :func:`rule_heads` resolves
names (SS035) once the manifest is read. Divisibility and whether a shard cuts a head
(SS034) depend on the layout and are checked with it (:mod:`shardspec.checks.layouts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardspec.core.patterns import PatternError, compile_glob
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic
from shardspec.findings.suggest import did_you_mean
from shardspec.frontend import ir
from shardspec.frontend.ir import rules_to_check
from shardspec.resolve.params import Resolved
from shardspec.resolve.views import captures_key


def _targets(rule: ir.Rule, item: ir.HeadSize) -> tuple[str, str | None] | None:
    """``(dimension, component)`` that ``item`` gives heads to (component ``None``: the
    dimension, or all its components); ``None`` when it names neither."""
    name = item.target.text
    if any(d.text == name for d in rule.dims):
        return name, None
    for f in rule.fusions:
        if any(c.name.text == name for c in f.components):
            return f.dim.text, name
    return None


def check_heads_items(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS020: a ``heads`` item names no dimension or component; SS027: it names a
    dimension indexed by a name capture; SS035: a size of 0, or heads given twice."""
    out: list[Diagnostic] = []
    finds = lambda r: bool(_sorted_items(r)[1])  # noqa: E731
    for rule in rules_to_check(spec.rules, finds, captures_key):
        out.extend(_sorted_items(rule)[1])
    return out


def _sorted_items(
    rule: ir.Rule,
) -> tuple[list[tuple[ir.HeadSize, tuple[str, str | None]]], list[Diagnostic]]:
    """A rule's sound ``heads`` items with their (dimension, component), and what is wrong
    with the others."""
    good: list[tuple[ir.HeadSize, tuple[str, str | None]]] = []
    out: list[Diagnostic] = []
    for item in rule.heads:
        target = _targets(rule, item)
        if target is None:
            names = [d.text for d in rule.dims]
            names += [c.name.text for f in rule.fusions for c in f.components]
            out.append(
                diag(
                    "SS020",
                    f"heads: {item.target.text!r} is no dimension of the rule, nor a "
                    "component of its fused dimension",
                    item.target.span,
                    did_you_mean(item.target.text, names),
                )
            )
            continue
        if _captured(rule, target[0]):
            out.append(
                diag(
                    "SS027",
                    f"heads: dimension {target[0]!r} is indexed by module name, "
                    "not a dimension of the tensor",
                    item.target.span,
                    "give heads to a dimension of the tensor (its rows or columns)",
                )
            )
            continue
        zero = item.size == 0
        if zero:
            out.append(
                diag(
                    "SS035",
                    f"heads of {item.target.text!r} have size 0",
                    item.span,
                    "the size is one head's size in indices (head_dim), at least 1",
                )
            )
        dim, comp = target
        twice = [
            other for other, (d, c) in good if d == dim and (c is None or comp is None or c == comp)
        ]
        if twice:
            first = twice[0]
            out.append(
                diag(
                    "SS035",
                    f"heads of {item.target.text!r} are given twice (line "
                    f"{first.span.line}: `heads {first.target.text} {first.size_text}`)",
                    item.span,
                    "give each dimension, or each component of a fused one, one head size",
                )
            )
        elif not zero:
            good.append((item, target))
    return good, out


def _captured(rule: ir.Rule, dim: str) -> bool:
    try:
        return dim in compile_glob(rule.pattern.text).captures
    except PatternError:
        return False


@dataclass
class RuleHeads:
    """A rule's head sizes: per dimension, per component (``None``: the dimension, or
    every component), the size and the item that gives it."""

    sizes: dict[str, dict[str | None, tuple[int, ir.HeadSize]]] = field(default_factory=dict)

    def of(self, dim: str) -> dict[str | None, int]:
        """The head sizes of ``dim``, as :func:`shardspec.core.layout.head_cut` takes them."""
        return {c: size for c, (size, _) in self.sizes.get(dim, {}).items()}


def rule_heads(res: Resolved) -> tuple[dict[int, RuleHeads], list[Diagnostic]]:
    """Per rule with ``heads`` items, its head sizes, with names resolved; SS035 for a
    name that resolves to no whole number. Items the structural check rejects are left
    out, as are names that only a missing HF manifest could resolve (SS079 says so)."""
    out: dict[int, RuleHeads] = {}
    diags: list[Diagnostic] = []
    args = res.manifest.factory_args if res.manifest is not None else {}
    hfm = res.hf_manifest
    config = getattr(hfm, "config", None) or {}
    unknowable = res.spec.hf is not None and hfm is None
    for rule in rules_to_check(res.spec.rules, lambda r: bool(r.heads)):
        heads = RuleHeads()
        for item, (dim, comp) in _sorted_items(rule)[0]:
            size = item.size
            if item.size_name is not None:
                size, problem = _lookup(item.size_name.text, args, config, unknowable)
                if problem:
                    diags.append(diag("SS035", problem[0], item.size_name.span, problem[1]))
            if size is not None:
                heads.sizes.setdefault(dim, {})[comp] = (size, item)
        if heads.sizes:
            out[rule.index] = heads
    return out, diags


def _lookup(
    name: str, args: dict, config: dict, unknowable: bool
) -> tuple[int | None, tuple[str, str] | None]:
    """The value of a head-size name: a factory argument, else a config.json key."""
    for where, table in (("factory argument", args), ("config.json key", config)):
        if name not in table:
            continue
        v = table[name]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return None, (
                f"head size {name!r}: the {where} is {v!r}, not a whole number of at least 1",
                "write the size (`heads kv 128`), or name a whole-number value",
            )
        return v, None
    if unknowable:
        return None, None
    return None, (
        f"head size {name!r} resolves to nothing: the manifest has no factory argument "
        "and the hf block's HF manifest no config.json key of that name",
        "write the size (`heads kv 128`), name a config.json key (`heads kv head_dim`), "
        "or build the manifest with the argument (`--arg head_dim=128`)",
    )


# ------------------------------------------------------------------ replicated heads


def check_replicated_items(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS117: a ``heads ... replicated`` item the layout cannot hold: on a dimension that
    is not fused (or in a fused dimension of groups), with a size that is a name, or on a
    dimension not split over exactly one axis that the module holds locally (the engine's
    module is built with its shard, which no DTensor placement describes)."""
    out: list[Diagnostic] = []
    for rule in rules_to_check(spec.rules, _says_replicated):
        for item in rule.heads:
            if item.replicated:
                problem = _replicated_problem(rule, item)
                if problem is not None:
                    out.append(diag("SS117", problem[0], item.span, problem[1]))
    return out


def _says_replicated(rule: ir.Rule) -> bool:
    """Whether ``rule`` has a ``heads ... replicated`` item (one answer per rule shape)."""
    return any(h.replicated for h in rule.heads)


def _replicated_problem(rule: ir.Rule, item: ir.HeadSize) -> tuple[str, str] | None:
    target = _targets(rule, item)
    what = f"heads {item.target.text} {item.size_text} replicated"
    if target is None:
        return None  # SS020 says so
    fusion = next((f for f in rule.fusions if f.dim.text == target[0]), None)
    if fusion is None:
        return (
            f"`{what}`: {target[0]!r} is not a fused dimension; replicated heads are a "
            "component's (vLLM's QKVParallelLinear holds [q_r; k_r; v_r])",
            f"fuse the dimension (`fuse {target[0]} as q 64, k 32, v 32`) and give the "
            "replicated component its heads (`heads k 16 replicated`)",
        )
    if fusion.groups:
        return (
            f"`{what}`: {target[0]!r} is fused in groups, whose split over tp keeps whole "
            "groups; heads replicate only in a dimension of components one after another",
            f"write `fuse {target[0]} as q .., k .., v ..` without groups",
        )
    if item.size_name is not None:
        return (
            f"`{what}`: the head size of replicated heads must be a number, the layout "
            "needs it before any manifest is read",
            f"write the head size ({item.size_name.text}'s value) as a number",
        )
    axes = [a.text for s in rule.shards if s.dim.text == target[0] for a in s.axes]
    local = {a.text for a in rule.local}
    if len(axes) != 1 or axes[0] not in local:
        said = ", ".join(axes) if axes else "no axis"
        return (
            f"`{what}`: {target[0]!r} is split over {said}; replicated heads need one axis "
            "that the module holds locally (several ranks hold the same head, which no "
            "DTensor placement describes)",
            f"write `shard {target[0]} over tp` and `local tp`: the engine builds each "
            "rank's module with its shard, as vLLM does",
        )
    return None


def check_replicated_sizes(res: Resolved) -> list[Diagnostic]:
    """SS116: a component with replicated heads whose axis size neither divides its head
    count nor is a multiple of it (vLLM: ``tp % num_kv_heads == 0`` or
    ``num_kv_heads % tp == 0``), with the sizes that work."""
    out: list[Diagnostic] = []
    seen: set[int] = set()
    wanted = {r.index for r in rules_to_check(res.spec.rules, _says_replicated)}
    if res.mesh is None or not wanted:
        return out
    for fqn, m in res.params:
        if m.layout is None or m.winner not in wanted or m.winner in seen:
            continue
        assert m.winner is not None
        seen.add(m.winner)
        mesh = res.mesh_of_rule(m.winner)
        rule = res.spec.rules[m.winner]
        for dim in m.layout.dims:
            f = dim.fusion
            if f is None or not f.replicated or len(dim.axes) != 1 or mesh is None:
                continue
            n = mesh.size(dim.axes[0])
            for comp, head in f.replicated:
                size = dict(f.components)[comp]
                heads = size // head if size % head == 0 else 0
                if heads and (heads % n == 0 or n % heads == 0):
                    continue
                item = next(
                    h for h in rule.heads if h.replicated and h.target.text in (comp, dim.name)
                )
                out.append(_sizes_diag(fqn, dim.name, comp, size, head, dim.axes[0], n, item))
    return out


def _sizes_diag(
    fqn: str, dim: str, comp: str, size: int, head: int, axis: str, n: int, item: ir.HeadSize
) -> Diagnostic:
    heads = size // head
    if not heads or size % head:
        return diag(
            "SS116",
            f"{fqn}: component {comp!r} of {dim!r} has {size} indices, not whole heads of {head}",
            item.span,
            "the size is one head's size in indices (head_dim)",
        )
    fit = [k for k in range(1, heads + 1) if heads % k == 0]
    fit += [heads * k for k in (2, 3, 4, 8)]
    return diag(
        "SS116",
        f"{fqn}: {axis}={n} neither divides the {heads} heads of component {comp!r} of "
        f"{dim!r} nor is a multiple of them: some rank would hold part of a head, or "
        "heads unevenly",
        item.span,
        f"{axis} sizes that work: {', '.join(map(str, fit))}, ... (a divisor of {heads} "
        f"splits the heads; a multiple replicates each head on {axis}/{heads} ranks)",
    )
