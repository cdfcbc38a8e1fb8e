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
from typing import Any

from shardspec.checks.hf import (
    MAX_GROUPS,
    _first,
    _group_key,
    _key_span,
    _more_n,
    rest_of_groups,
)
from shardspec.core.hfmap import FP8_SAFETENSORS, SCALE_DTYPES, BlockQuant, HFMap
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic
from shardspec.frontend import ir
from shardspec.inputs.hfmanifest import HFManifest
from shardspec.resolve.hf import (
    block_quant,
    build_hfmap,
    fp8_settings,
    glob_problem,
    scale_template_problem,
)

_FP8_WORDS = {"scale_format": "`float32` or `ue8m0`", "dtype": "`e4m3` or `e5m2`"}
_FP8_FORM = (
    "write `fp8 GLOB [scale {key}_scale_inv] [block 128 x 128] [ue8m0] [e4m3 | e5m2]`, "
    "each option once"
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


def _good_quants(hf: ir.HFBlock) -> list[BlockQuant]:
    """The declarations of the fp8 lines without SS110 problems (the first of a glob)."""
    seen: set[str] = set()
    out = []
    for item in hf.fp8:
        if item.glob.text in seen or fp8_line_problems(item):
            continue
        seen.add(item.glob.text)
        out.append(block_quant(item))
    return out


def check_fp8_keys(spec: ir.Spec, hfm: HFManifest) -> list[Diagnostic]:
    """SS111-SS114: the HF manifest's FP8 tensors against the hf block's fp8 lines."""
    hf = spec.hf
    assert hf is not None
    full = build_hfmap(hf)
    quants = _good_quants(hf)
    hfmap = HFMap(full.rules, full.drops, full.ties, full.keeps, tuple(quants))
    item_of = {q.line: item for q, item in zip(full.quants, hf.fp8, strict=True)}
    tensors = hfm.tensors
    undeclared: dict[str, list[str]] = {}  # name shape -> FP8 keys no line declares
    # (kind, line, details) -> [first key, shown, count], as checks/hf.py counts
    scales: dict[tuple[str, int, Any, Any], list[Any]] = {}
    dtypes: dict[tuple[str, int, str], list[Any]] = {}
    used: set[int] = set()
    for key in sorted(tensors):
        t = tensors[key]
        q = hfmap.quant_of(key) if quants else None
        if quants and hfmap.is_scale(key):
            if q is not None:
                _first(scales, ("glob", q.line, None, None), key, key)
            else:
                read = next(iter(hfmap.consumers(key)), None)
                if read is not None:
                    _first(scales, ("read", hfmap.rules[read[0]].line, read[0], None), key, key)
            continue
        if q is None:
            # (a key that a malformed line covers: SS110 is the cause)
            # (a tie alias no line reads is never read: its source is, under its own name)
            alias = hfmap.tie_of(key) is not None and not any(hfmap.consumers(key))
            if (
                t.dtype.startswith("F8_")
                and not hfmap.dropped(key)
                and not full.quant_of(key)
                and not alias
            ):
                undeclared.setdefault(_group_key(key), []).append(key)
            continue
        used.add(q.line)
        want = FP8_SAFETENSORS.get(q.dtype, q.dtype)
        if t.dtype != want:
            _first(dtypes, ("dtype", q.line, t.dtype), key, key)
            continue
        if len(t.shape) < 2:
            _first(dtypes, ("ndim", q.line, str(list(t.shape))), key, key)
            continue
        sk = q.scale_key(key)
        s = tensors.get(sk)
        if s is None:
            _first(scales, ("missing", q.line, None, None), key, sk)
        elif s.dtype not in SCALE_DTYPES.get(q.scale_format, ("F32",)):
            _first(scales, ("scale dtype", q.line, s.dtype, None), key, sk)
        elif s.shape != q.scale_shape(t.shape):
            expect = (tuple(t.shape), q.scale_shape(t.shape))
            _first(scales, ("shape", q.line, tuple(s.shape), expect), key, sk)
    out = _undeclared(undeclared, hfm)
    out += [_scale_finding(k, v, hf, item_of) for k, v in sorted(scales.items(), key=_order)]
    out += [_dtype_finding(k, v, item_of[k[1]]) for k, v in sorted(dtypes.items())]
    for q in quants:
        if q.line not in used:
            item = item_of[q.line]
            out.append(
                diag(
                    "SS114",
                    f"fp8 {q.glob!r} matches no FP8 weight of the HF manifest",
                    item.glob.span,
                    "check the glob against the HF manifest's keys (`*` is one segment or "
                    "part of one, `**` any number); delete the line if the checkpoint has "
                    "no such tensors",
                )
            )
    return out


def _order(kv: tuple[tuple[str, int, Any, Any], list[Any]]) -> tuple[int, str, str]:
    (kind, line, _, _), (first, _, _) = kv
    return line, kind, first


def _undeclared(groups: dict[str, list[str]], hfm: HFManifest) -> list[Diagnostic]:
    """SS111: one finding per name shape (``model.layers.N.mlp.up_proj.weight``), the
    first :data:`MAX_GROUPS`, then one for the rest."""
    ordered = sorted(groups.values(), key=lambda ks: ks[0])
    out = []
    for keys in ordered[:MAX_GROUPS]:
        key = keys[0]
        dtype = hfm.tensors[key].dtype
        out.append(
            diag(
                "SS111",
                f"HF key {_more_n(key, len(keys))} is {dtype}, and no fp8 line declares it",
                _key_span(hfm, key),
                f"declare how it is stored: `fp8 {_glob_of(key)}` (scales in "
                "`{key}_scale_inv`, 128 x 128 blocks), or `drop` it",
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
    item_of: dict[int, ir.HFFp8],
) -> Diagnostic:
    what, line, got, expect = kind
    first, shown, n = found
    if what == "read":
        m = hf.maps[got]
        return diag(
            "SS112",
            f"scale {_more_n(first, n)} of an FP8 weight is read by map line {line} too",
            m.hf.span,
            f"the fp8 line consumes its weights' scales: narrow `{m.hf.text}` so it leaves "
            "them out",
        )
    item = item_of[line]
    span = next((o.span for o in item.options if o.kind == "scale"), item.glob.span)
    q = block_quant(item)
    if what == "glob":
        return diag(
            "SS112",
            f"fp8 {q.glob!r} matches scale key {_more_n(first, n)} as a weight",
            item.glob.span,
            "narrow the glob to the weights (`...*_proj.weight`), so the scales are not "
            "dequantized themselves",
        )
    if what == "missing":
        return diag(
            "SS112",
            f"FP8 key {_more_n(first, n)} has no scale {shown!r} in the HF manifest",
            span,
            "name the scale keys the checkpoint has: `scale {key}_scale_inv` (DeepSeek), "
            "`scale {key}_scale`, ...",
        )
    if what == "scale dtype":
        allowed = " or ".join(SCALE_DTYPES.get(q.scale_format, ("F32",)))
        return diag(
            "SS112",
            f"scale {shown!r} (of {_more_n(first, n)}) is {got}; line {line}'s "
            f"{q.scale_format} scales are {allowed}",
            span,
            "power-of-two scales stored as F8_E8M0 need `ue8m0`; rebuild the HF manifest with "
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
    what, line, got = kind
    first, _, n = found
    q = block_quant(item)
    if what == "ndim":
        return diag(
            "SS113",
            f"FP8 key {_more_n(first, n)} has shape {got}: blocks tile a weight's last two "
            "dimensions",
            item.glob.span,
            "narrow the glob to the 2-D (or stacked 3-D) linear weights",
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
