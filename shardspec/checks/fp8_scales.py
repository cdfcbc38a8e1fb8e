"""The HF manifest's stray scales (:func:`shardspec.resolve.hf.stray_scales`), computed once
per lint: the FP8 checks (SS112) and the unexpected-key check (SS073) both ask, on the
same hf block and HF manifest."""

from __future__ import annotations

from shardspec.frontend import ir
from shardspec.inputs.hfmanifest import HFManifest
from shardspec.resolve import hf as resolve_hf

# The last (hf block, HF manifest, result): both are immutable, and a lint asks about one
# pair, so the pair's identity keys it (holding them keeps an id from being reused).
_LAST: list[tuple[ir.HFBlock, HFManifest, dict[str, str]]] = []


def stray_scales(hf: ir.HFBlock, hfm: HFManifest) -> dict[str, str]:
    """:func:`shardspec.resolve.hf.stray_scales` of ``hf`` and ``hfm``, computed once for
    the same two objects (a copy: callers may not share it)."""
    if _LAST and _LAST[0][0] is hf and _LAST[0][1] is hfm:
        return dict(_LAST[0][2])
    out = resolve_hf.stray_scales(hf, hfm)
    _LAST[:] = [(hf, hfm, out)]
    return dict(out)
