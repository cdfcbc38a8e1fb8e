"""IR ``hf { ... }`` block -> :class:`shardspec.core.hfmap.HFMap`, plus the small syntax checks
that the mapping model itself does not make (glob syntax where only captures belong).

The compiler builds the map here; the generated module writes the same map out as a table,
and the runtime reads that table. No torch, no lark.
"""

from __future__ import annotations

import bisect
import dataclasses
import re

from shardspec.core.hfmap import (
    SCALE_FORMATS,
    BlockQuant,
    HFMap,
    MapRule,
    Part,
    Transform,
    padded_size,
)
from shardspec.frontend import ir
from shardspec.inputs.hfmanifest import HFManifest

_CAPTURE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def build_hfmap(block: ir.HFBlock, hfm: HFManifest | None = None) -> HFMap:
    """The block as the pure-Python mapping model; ``rules[i]`` is ``block.maps[i]``. With
    the block's HF manifest, each ``pad`` records the HF size it pads (see
    :func:`with_pad_sizes`)."""
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
    hfmap = HFMap(
        rules=rules,
        drops=tuple(d.pattern.text for d in block.drops),
        ties=tuple((t.alias.text, t.source.text) for t in block.ties),
        keeps=tuple(k.pattern.text for k in block.keeps),
        quants=tuple(block_quant(q) for q in block.fp8),
    )
    return with_pad_sizes(hfmap, hfm)


def with_pad_sizes(hfmap: HFMap, hfm: HFManifest | None) -> HFMap:
    """``hfmap`` with each ``pad`` transform's ``size``: the HF size of the dimension it
    pads, from the first key (in the manifest's order) that its line reads; lint checks
    every other key against it (SS072, SS132). Without a manifest, or on a line that reads
    none of its keys, the size stays 0 (unknown; SS132 says so)."""
    if hfm is None or not any(t.kind == "pad" for r in hfmap.rules for t in r.transforms):
        return hfmap
    shapes: dict[int, tuple[int, ...]] = {}
    for key, tensor in hfm.tensors.items():
        for i, _, _ in hfmap.consumers(key):
            shapes.setdefault(i, tensor.shape)
    rules = list(hfmap.rules)
    for i, rule in enumerate(rules):
        if i in shapes and any(t.kind == "pad" for t in rule.transforms):
            chain, shape = [], list(shapes[i])
            for t in rule.transforms:
                if t.kind == "transpose":
                    shape.reverse()
                elif t.kind == "pad" and t.dim < len(shape):
                    t = dataclasses.replace(t, size=shape[t.dim])
                    shape[t.dim] = padded_size(t.size, t.multiple)
                chain.append(t)
            rules[i] = dataclasses.replace(rule, transforms=tuple(chain))
    return dataclasses.replace(hfmap, rules=tuple(rules))


# An fp8 line's words: the scale format and the FP8 dtype each word sets.
FP8_WORDS = {
    **{f: ("scale_format", f) for f in SCALE_FORMATS},
    "e4m3": ("dtype", "float8_e4m3fn"),
    "e5m2": ("dtype", "float8_e5m2"),
}


def fp8_settings(item: ir.HFFp8) -> dict[str, list[ir.HFFp8Option]]:
    """The options of an ``fp8`` line by the :class:`BlockQuant` field each sets (``scale``,
    ``block``, ``scale_format``, ``dtype``), in file order."""
    out: dict[str, list[ir.HFFp8Option]] = {}
    for o in item.options:
        field = FP8_WORDS[o.text][0] if o.kind == "word" else o.kind
        out.setdefault(field, []).append(o)
    return out


def block_quant(item: ir.HFFp8) -> BlockQuant:
    """The ``fp8`` line as the mapping model's declaration (an option given twice, which
    SS110 reports: its first)."""
    values: dict[str, object] = {}
    for field, opts in fp8_settings(item).items():
        o = opts[0]
        values[field] = (
            o.text if o.kind == "scale" else o.block if o.kind == "block" else FP8_WORDS[o.text][1]
        )
    return BlockQuant(item.glob.text, line=item.span.line, **values)  # type: ignore[arg-type]


def scale_template_problem(text: str) -> str | None:
    """Why ``text`` is not an fp8 line's scale key template (a key with ``{key}`` once,
    which the weight's key replaces), or ``None``."""
    if text.count("{key}") != 1:
        return "the scale template names the weight's key as `{key}`, once"
    if "*" in text or "{" in text.replace("{key}", "") or "}" in text.replace("{key}", ""):
        return "a scale template is one key with `{key}` in it: no `*` and no other `{...}`"
    if text == "{key}":
        return "the scale cannot be the weight itself: add a suffix, as in `{key}_scale_inv`"
    return _segments_problem(text.replace("{key}", "k"))


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


def stray_scales(hf: ir.HFBlock, hfm: HFManifest) -> dict[str, str]:
    """The HF manifest's keys that look like the scale of an FP8 weight that an fp8 line
    declares but whose scale, as the line's template names it, is absent (a template
    that names the scales otherwise, or a malformed one): key -> the weight. SS112 (or
    SS110) reports the template once; these keys are not also unexpected (SS073) or
    undeclared FP8 (SS111). A key looks like the scale of weight ``W`` when it is ``W``
    with a suffix (``W_scale``, ``W.scale``), or ``W``'s last segment replaced by one
    that says ``scale``."""
    full = build_hfmap(hf)
    if not full.quants:
        return {}
    sound = HFMap(quants=tuple(q for q in full.quants if scale_template_problem(q.scale) is None))
    tensors = hfm.tensors
    keys = sorted(tensors)
    free = [k for k in keys if full.quant_of(k) is None and not sound.is_scale(k)]
    by_parent: dict[str, list[str]] = {}
    for k in free:
        parent, _, last = k.rpartition(".")
        if "scale" in last:
            by_parent.setdefault(parent, []).append(k)
    out: dict[str, str] = {}
    for w in keys:
        q = full.quant_of(w)
        if q is None or sound.is_scale(w) or not tensors[w].dtype.startswith("F8_"):
            continue
        if q in sound.quants and q.scale_key(w) in tensors:
            continue
        i = bisect.bisect_right(free, w)
        while i < len(free) and free[i].startswith(w):
            if free[i][len(w)] in "_.":
                out.setdefault(free[i], w)
            i += 1
        for k in by_parent.get(w.rpartition(".")[0], ()):
            out.setdefault(k, w)
    return out


def _transforms(items: tuple[ir.HFTransform, ...]) -> tuple[Transform, ...]:
    return tuple(
        Transform("pad", dim=t.dim, multiple=t.multiple, axes=tuple(a.text for a in t.axes))
        if t.kind == "pad"
        else Transform(t.kind, t.head_dim)
        for t in items
    )


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
