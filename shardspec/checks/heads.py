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
