"""IR ``hf { ... }`` block -> :class:`shardspec.core.hfmap.HFMap`, plus the small syntax checks
that the mapping model itself does not make (glob syntax where only captures belong).

The compiler builds the map here; the generated module writes the same map out as a table,
and the runtime reads that table. No torch, no lark.
"""

from __future__ import annotations

import dataclasses
import re

from shardspec.core.hfmap import HFMap, MapRule, Part, Transform
from shardspec.frontend import ir
from shardspec.inputs.hfmanifest import HFManifest

_CAPTURE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def build_hfmap(block: ir.HFBlock) -> HFMap:
    """The block as the pure-Python mapping model; ``rules[i]`` is ``block.maps[i]``."""
    rules = tuple(
        MapRule(
            hf=m.hf.text,
            target=m.target.text,
            stack=m.stack.text if m.stack else None,
            transforms=_transforms(m.transforms),
            line=m.span.line,
            parts=None
            if m.parts is None
            else tuple(Part(p.name.text, _transforms(p.transforms)) for p in m.parts),
            grouped=m.grouped is not None,
        )
        for m in block.maps
    )
    return HFMap(
        rules=rules,
        drops=tuple(d.pattern.text for d in block.drops),
        ties=tuple((t.alias.text, t.source.text) for t in block.ties),
        keeps=tuple(k.pattern.text for k in block.keeps),
    )


def with_dtypes(hfmap: HFMap, hfm: HFManifest | None) -> HFMap:
    """``hfmap`` with each rule's ``dtypes``: the dtypes the HF manifest records for the
    keys the rule reads (a tie alias's key absent from it: its source's), sorted. A rule
    that reads no key of the manifest, or a map without one, records none."""
    if hfm is None:
        return hfmap
    found: list[set[str]] = [set() for _ in hfmap.rules]
    for key, t in hfm.tensors.items():
        for i, _, _ in hfmap.consumers(key):
            found[i].add(t.dtype)
    for alias, source in hfmap.ties:
        if alias not in hfm.tensors and source in hfm.tensors:
            for i, _, _ in hfmap.consumers(alias):
                found[i].add(hfm.tensors[source].dtype)
    rules = tuple(
        dataclasses.replace(r, dtypes=tuple(sorted(d)))
        for r, d in zip(hfmap.rules, found, strict=True)
    )
    return dataclasses.replace(hfmap, rules=rules)


def _transforms(items: tuple[ir.HFTransform, ...]) -> tuple[Transform, ...]:
    return tuple(Transform(t.kind, t.head_dim) for t in items)


def template_problem(text: str) -> str | None:
    """Why ``text`` is not a map-line template (dot-separated names and ``{name}``
    captures only), or ``None``."""
    rest = _CAPTURE.sub("x", text)
    if "**" in rest:
        return "`**` is a glob; a map line names tensors with `{name}` captures only"
    if "*" in rest:
        return "`*` is a glob; a map line names tensors with `{name}` captures only"
    if "{" in rest or "}" in rest:
        return (
            "`{a,b}` alternatives are globs; write one map line per alternative, or capture "
            "the segment as `{name}`"
        )
    return _segments_problem(text)


def glob_problem(text: str) -> str | None:
    """Why ``text`` is not a ``drop``/``keep`` glob (``*`` and ``**`` only), or ``None``."""
    if "{" in text or "}" in text:
        return "drop and keep globs take `*` and `**` only, no `{...}`"
    return _segments_problem(text)


def key_problem(text: str) -> str | None:
    """Why ``text`` is not a literal Hugging Face key (for ``tie``), or ``None``."""
    if any(c in text for c in "*{}"):
        return "a tie names two Hugging Face keys literally, without `*` or `{...}`"
    return _segments_problem(text)


def _segments_problem(text: str) -> str | None:
    if text.startswith(".") or text.endswith(".") or ".." in text:
        return "a name has an empty segment (a leading, trailing or doubled `.`)"
    return None
