"""Checks on an hf block's ``fp8`` lines: Hugging Face tensors stored block-scaled in FP8
(DeepSeek-V3's ``weight`` + ``weight_scale_inv``).

* :func:`check_fp8_items` needs nothing but the spec (SS110 malformed lines);
* :func:`check_fp8_keys` needs the HF manifest (no model manifest): FP8 keys no line
  declares (SS111), scales (SS112), covered keys not stored as FP8 (SS113), lines that
  match nothing (SS114).

No block-boundary check: export_hf gathers every HF tensor whole to one writing rank
(``runtime/hf/export.py``: ``_assemble``; a split tensor's parts are bundled to one writer)
and quantizes there, in the HF layout after the transforms' inverses, so every block has
exactly one writer whatever the shards; load_hf dequantizes in the HF layout before any
transform, reading the scale blocks that cover its box. See README, "fp8".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from shardspec.checks.hf import (
    MAX_GROUPS,
    _first,
    _group_key,
    _key_span,
    _more_n,
    rest_of_groups,
)
from shardspec.core.hfmap import FP8_SAFETENSORS, BlockQuant, HFMap, scale_format_hint
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic
from shardspec.frontend import ir
from shardspec.inputs.hfmanifest import HFManifest
from shardspec.resolve import hf as resolve_hf
from shardspec.resolve.hf import (
    block_quant,
    build_hfmap,
    fp8_settings,
    glob_problem,
    scale_template_problem,
)

_FP8_WORDS = {
    "scale_format": "the scale format (`float32`, `bfloat16`, `float16` or `ue8m0`)",
    "dtype": "`e4m3` or `e5m2`",
}
_FP8_FORM = (
    "write `fp8 GLOB [scale {key}_scale_inv] [block 128 x 128] "
    "[float32 | bfloat16 | float16 | ue8m0] [e4m3 | e5m2]`, each option once"
)


# ---------------------------------------------------------------------- SS110: the lines


def fp8_line_problems(item: ir.HFFp8) -> list[tuple[ir.Node, str]]:
    """What is wrong with an ``fp8`` line on its own: (the node to point at, why)."""
    out: list[tuple[ir.Node, str]] = []
    why = glob_problem(item.glob.text)
    if why:
        out.append((item.glob, f"fp8 {item.glob.text!r}: {why.replace('drop and keep', 'fp8')}"))
    for field, opts in fp8_settings(item).items():
        for o in opts[1:]:
            what = _FP8_WORDS.get(field, f"`{field}`")
            out.append((o, f"{what} is given twice (first at column {opts[0].span.col})"))
        o = opts[0]
        if o.kind == "scale":
            why = scale_template_problem(o.text)
            if why:
                out.append((o, f"scale {o.text!r}: {why}"))
        elif o.kind == "block" and o.block is not None and 0 in o.block:
            rows, cols = o.block
            out.append((o, f"block {rows} x {cols}: a block has a row and a column at least"))
    return out


def check_fp8_items(spec: ir.Spec) -> list[Diagnostic]:
    """SS110 for each malformed ``fp8`` line, and for a glob written on two lines (the
    first line wins, so the second would never apply)."""
    hf = spec.hf
    if hf is None:
        return []
    out: list[Diagnostic] = []
    for item in hf.fp8:
        for node, why in fp8_line_problems(item):
            out.append(diag("SS110", why, node.span, _FP8_FORM))
    seen: dict[str, ir.HFFp8] = {}
    for item in hf.fp8:
        first = seen.setdefault(item.glob.text, item)
        if first is not item:
            out.append(
                diag(
                    "SS110",
                    f"fp8 {item.glob.text!r} is declared on line {first.span.line} too",
                    item.glob.span,
                    "the first line that matches a key applies: keep one",
                )
            )
    return out


# ------------------------------------------------------------------- with the HF manifest


def _good_quants(hf: ir.HFBlock) -> list[tuple[BlockQuant, ir.HFFp8]]:
    """The fp8 lines without SS110 problems (the first of a glob), each with its
    declaration."""
    seen: set[str] = set()
    out = []
    for item in hf.fp8:
        if item.glob.text in seen or fp8_line_problems(item):
            continue
        seen.add(item.glob.text)
        out.append((block_quant(item), item))
    return out


def check_fp8_keys(
    spec: ir.Spec, hfm: HFManifest, stray: Mapping[str, str] | None = None
) -> list[Diagnostic]:
    """SS111-SS114: the HF manifest's FP8 tensors against the hf block's fp8 lines. Each
    line is tracked by its position among the sound lines (two lines may share a spec
    line)."""
    hf = spec.hf
    assert hf is not None
    full = build_hfmap(hf)
    good = _good_quants(hf)
    quants = [q for q, _ in good]
    hfmap = HFMap(full.rules, full.drops, full.ties, full.keeps, tuple(quants))
    index = {id(q): i for i, q in enumerate(quants)}
    tensors = hfm.tensors
    if stray is None:
        stray = resolve_hf.stray_scales(hf, hfm)
    undeclared: dict[str, list[str]] = {}  # name shape -> FP8 keys no line declares
    # (kind, line index (map line for "read"), details) -> [first key, shown, count], as
    # checks/hf.py counts
    scales: dict[tuple[str, int, Any, Any], list[Any]] = {}
    dtypes: dict[tuple[str, int, str], list[Any]] = {}
    used: set[int] = set()
    shadowed: dict[int, int] = {}  # a line that matches keys an earlier line takes -> it
    for key in sorted(tensors):
        t = tensors[key]
        q = hfmap.quant_of(key) if quants else None
        if quants and hfmap.is_scale(key):
            if q is not None:
                _first(scales, ("glob", index[id(q)], None, None), key, key)
            else:
                read = next(iter(hfmap.consumers(key)), None)
                if read is not None:
                    _first(scales, ("read", read[0], None, None), key, key)
            continue
        if q is None:
            # (a key that a malformed line covers: SS110 is the cause)
            # (a tie alias no line reads is never read: its source is, under its own name)
            # (a scale under another name than its line's template: SS112 names it)
            alias = hfmap.tie_of(key) is not None and not any(hfmap.consumers(key))
            if (
                t.dtype.startswith("F8_")
                and not hfmap.dropped(key)
                and not full.quant_of(key)
                and not alias
                and key not in stray
            ):
                undeclared.setdefault(_group_key(key), []).append(key)
            continue
        at = index[id(q)]
        used.add(at)
        for later, (other, _) in enumerate(good[at + 1 :], at + 1):
            if other.regex.match(key):
                shadowed.setdefault(later, at)
        want = FP8_SAFETENSORS.get(q.dtype, q.dtype)
        if t.dtype != want:
            _first(dtypes, ("dtype", at, t.dtype), key, key)
            continue
        if len(t.shape) < 2:
            _first(dtypes, ("ndim", at, str(list(t.shape))), key, key)
            continue
        sk = q.scale_key(key)
        s = tensors.get(sk)
        if s is None:
            _first(scales, ("missing", at, None, None), key, sk)
        elif s.dtype not in q.scale_dtypes:
            _first(scales, ("scale dtype", at, s.dtype, None), key, sk)
        elif s.shape != q.scale_shape(t.shape):
            expect = (tuple(t.shape), q.scale_shape(t.shape))
            _first(scales, ("shape", at, tuple(s.shape), expect), key, sk)
    out = _undeclared(undeclared, hfm)
    order = sorted(scales.items(), key=lambda kv: _order(kv, hf, good))
    found_as = {w: k for k, w in sorted(stray.items(), reverse=True)}  # (each first)
    out += [_scale_finding(k, v, hf, good, found_as) for k, v in order]
    out += [_dtype_finding(k, v, good[k[1]][1]) for k, v in sorted(dtypes.items())]
    for at, (q, item) in enumerate(good):
        if at not in used:
            out.append(_unused(q, item, good[shadowed[at]] if at in shadowed else None))
    return out


def _unused(
    q: BlockQuant, item: ir.HFFp8, winner: tuple[BlockQuant, ir.HFFp8] | None
) -> Diagnostic:
    """SS114 for a line that declares nothing: its glob matches no FP8 weight, or every
    one it matches is an earlier line's (``winner``, the first such line)."""
    if winner is not None:
        first, first_item = winner
        return diag(
            "SS114",
            f"fp8 {q.glob!r} declares no FP8 weight: every key it matches is declared by "
            f"line {first_item.span.line} (`{first.glob}`) first, and the first line that "
            "matches a key applies",
            item.glob.span,
            f"to give these keys this line's options, move it above line "
            f"{first_item.span.line} (or narrow that line's glob); else delete it",
        )
    return diag(
        "SS114",
        f"fp8 {q.glob!r} matches no FP8 weight of the HF manifest",
        item.glob.span,
        "check the glob against the HF manifest's keys (`*` is one segment or "
        "part of one, `**` any number); delete the line if the checkpoint has "
        "no such tensors",
    )


def _order(
    kv: tuple[tuple[str, int, Any, Any], list[Any]],
    hf: ir.HFBlock,
    good: list[tuple[BlockQuant, ir.HFFp8]],
) -> tuple[int, int, str, str]:
    (kind, at, _, _), (first, _, _) = kv
    node = hf.maps[at] if kind == "read" else good[at][1]
    return node.span.line, node.span.col, kind, first


def _undeclared(groups: dict[str, list[str]], hfm: HFManifest) -> list[Diagnostic]:
    """SS111: one finding per name shape (``model.layers.N.mlp.up_proj.weight``), the
    first :data:`MAX_GROUPS`, then one for the rest."""
    ordered = sorted(groups.values(), key=lambda ks: ks[0])
    out = []
    for keys in ordered[:MAX_GROUPS]:
        key = keys[0]
        t = hfm.tensors[key]
        hint = (
            f"declare how it is stored: `fp8 {_glob_of(key)}` (scales in "
            "`{key}_scale_inv`, 128 x 128 blocks), or `drop` it"
            if len(t.shape) >= 2
            else f"it has shape {list(t.shape)}, which block scales cannot tile: `drop` it "
            "(and `keep` its parameter), or convert the checkpoint's tensor to a float dtype"
        )
        out.append(
            diag(
                "SS111",
                f"HF key {_more_n(key, len(keys))} is {t.dtype}, and no fp8 line declares it",
                _key_span(hfm, key),
                hint,
            )
        )
    what = "FP8 HF keys no fp8 line declares"
    return out + rest_of_groups(
        "SS111", ordered[MAX_GROUPS:], hfm, what, "declare them with `fp8 GLOB` lines"
    )


_NUMBER_SEGMENT = re.compile(r"(?<![^.])[0-9]+(?![^.])")


def _glob_of(key: str) -> str:
    """``key`` with its number segments as ``*`` (``model.layers.*.mlp.up_proj.weight``)."""
    return _NUMBER_SEGMENT.sub("*", key)


def _scale_finding(
    kind: tuple[str, int, Any, Any],
    found: list[Any],
    hf: ir.HFBlock,
    good: list[tuple[BlockQuant, ir.HFFp8]],
    found_as: dict[str, str],
) -> Diagnostic:
    what, at, got, expect = kind
    first, shown, n = found
    if what == "read":
        m = hf.maps[at]
        return diag(
            "SS112",
            f"scale {_more_n(first, n)} of an FP8 weight is read by map line {m.span.line} too",
            m.hf.span,
            f"the fp8 line consumes its weights' scales: narrow `{m.hf.text}` so it leaves "
            "them out",
        )
    q, item = good[at]
    line = item.span.line
    span = next((o.span for o in item.options if o.kind == "scale"), item.glob.span)
    if what == "glob":
        return diag(
            "SS112",
            f"fp8 {q.glob!r} matches scale key {_more_n(first, n)} as a weight",
            item.glob.span,
            "narrow the glob to the weights (`...*_proj.weight`), so the scales are not "
            "dequantized themselves",
        )
    if what == "missing":
        other = found_as.get(first)
        if other is not None and other.startswith(first):
            template = "{key}" + other[len(first) :]
            return diag(
                "SS112",
                f"FP8 key {_more_n(first, n)} has no scale {shown!r} in the HF manifest, "
                f"which holds {other!r}",
                span,
                f"name the scale keys the checkpoint has: `scale {template}`",
            )
        held = f", which holds {other!r}" if other is not None else ""
        return diag(
            "SS112",
            f"FP8 key {_more_n(first, n)} has no scale {shown!r} in the HF manifest{held}",
            span,
            "name the scale keys the checkpoint has: `scale {key}_scale_inv` (DeepSeek), "
            "`scale {key}_scale`, ...",
        )
    if what == "scale dtype":
        allowed = " or ".join(q.scale_dtypes)
        return diag(
            "SS112",
            f"scale {shown!r} (of {_more_n(first, n)}) is {got}; line {line}'s "
            f"{q.scale_format} scales are {allowed}",
            span,
            f"the line's scale format says the scales' dtype{scale_format_hint(got)} "
            "(power-of-two scales stored as F8_E8M0: `ue8m0`); rebuild the HF manifest with "
            "`shardspec hf-manifest` if it does not describe the checkpoint",
        )
    weight, scale = expect
    r, c = q.block
    return diag(
        "SS112",
        f"scale {shown!r} (of {_more_n(first, n)}) has shape {list(got)}; a {r} x {c} block "
        f"scale of a {list(weight)} weight is {list(scale)}",
        span,
        "one scale per block of the last two dimensions, ceil(rows / R) x ceil(cols / C) "
        "(per expert for a stacked weight): check `block R x C` against the checkpoint's "
        "weight_block_size",
    )


def _dtype_finding(kind: tuple[str, int, str], found: list[Any], item: ir.HFFp8) -> Diagnostic:
    what, _, got = kind
    line = item.span.line
    first, _, n = found
    q = block_quant(item)
    if what == "ndim":
        return diag(
            "SS113",
            f"FP8 key {_more_n(first, n)} has shape {got}: a block-scaled tensor has two "
            "dimensions at least (the blocks tile its last two), so load_hf cannot "
            "dequantize it",
            item.glob.span,
            f"if line {line} covers it by mistake, narrow the glob to the 2-D (or stacked "
            "3-D) linear weights; if the checkpoint stores it in FP8 without block "
            "scales, it is not in this format: `drop` it and `keep` its parameter, or "
            "convert the checkpoint's tensor to a float dtype first",
        )
    want = FP8_SAFETENSORS.get(q.dtype, q.dtype)
    if got.startswith("F8_"):
        hint = f"write `{'e5m2' if got == 'F8_E5M2' else 'e4m3'}` on the line"
    else:
        hint = (
            "narrow the glob to the tensors stored in FP8 (DeepSeek ships embeddings, "
            "norms, the router and e_score_correction_bias in BF16/F32): write one fp8 "
            "line per group of FP8 weights"
        )
    return diag(
        "SS113",
        f"HF key {_more_n(first, n)} is {got} in the HF manifest, and line {line} declares "
        f"it {want}",
        item.glob.span,
        hint,
    )
