"""Block-scaled FP8 tensors (DeepSeek-V3's ``weight_scale_inv`` format, declared by an
``hf`` block's :class:`~shardspec.core.hfmap.BlockQuant`): the block arithmetic of
``load_hf`` and ``export_hf``, in torch only.

The format: an FP8 tensor ``q`` of shape ``(..., rows, cols)`` and a tensor ``scale``
(float32; bfloat16 or float16 in Qwen3's FP8 releases) of shape
``(..., ceil(rows / R), ceil(cols / C))``; the value is
``w[..., r, c] = float32(q[..., r, c]) * scale[..., r // R, c // C]``.

Load (:class:`DequantSlice`): a rank reads the FP8 bytes of its own box and only the scale
blocks that cover it, and dequantizes them in the Hugging Face layout; the reader's
transforms and splits then apply as to any tensor.

Export (:func:`quantize`): per block, ``scale = amax / FP8_MAX[dtype]`` (``amax`` the
largest ``|w|`` of the block, in float32), ``q = clamp(w / scale)`` cast to the FP8 dtype
(round to nearest even); a scale that would underflow its dtype's normal range is raised
to the smallest normal, and a block whose ``q`` is all zero (a block of zeros, or of
values below the FP8 type's smallest subnormal times the scale) gets scale 1.0.
``ue8m0``: the scale rounded up to a power of two. The scales are written in the line's
scale dtype (float32; bfloat16 or float16 rounded to nearest, and ``q`` divided by the
scale as stored, so a reader dequantizes what this rule inverts; ue8m0 as float32).
With float32 scales, dequantizing in float32 and quantizing again gives back the same
bytes and scales (``fl(fl(448 * s) / 448) == s`` for every ``s = fl(a / 448)``; with
bfloat16 or float16 scales the block's largest ``|q|`` is 448 again and ``448 * s`` is exact
in float32, so the same holds); with
``ue8m0`` scales, the same values, not always the same bytes (a block's amax can move it
to the next power of two).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from shardspec.core.hfmap import FP8_MAX, SCALE_ITEMSIZE, BlockQuant

# BlockQuant.dtype -> the torch dtype and the safetensors dtype name of the FP8 tensor
FP8_TORCH = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
# The torch dtype of each safetensors dtype a scale is written in (BlockQuant.scale_dtypes[0])
SCALE_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# transformers' ``quantization_config.fmt`` of each FP8 dtype
FP8_FMT = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def bad_scales(
    scale: torch.Tensor, bq: BlockQuant, origin: Sequence[tuple[int, int]] = ()
) -> str | None:
    """Why the scale values ``scale`` (float32) cannot dequantize, or None: each must be
    finite and positive, and a power of two for ``ue8m0``. ``scale`` may be a part of the
    whole scale tensor: ``origin`` gives, per dimension, (start, step) of the part, so that
    the block named is the whole tensor's."""

    def where(mask: torch.Tensor) -> tuple[float, list[int]]:
        at = [int(i) for i in mask.nonzero()[0]]
        value = float(scale[tuple(at)])
        starts = list(origin) or [(0, 1)] * len(at)
        return value, [a + i * step for i, (a, step) in zip(at, starts, strict=True)]

    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        value, at = where(bad)
        return f"scale {value} at block {at} (scales must be finite and > 0)"
    if bq.scale_format == "ue8m0":
        mantissa, _ = torch.frexp(scale)
        off = mantissa != 0.5
        if bool(off.any()):
            value, at = where(off)
            return f"scale {value} at block {at} is not a power of two (ue8m0)"
    return None


class DequantSlice:
    """A safetensors slice of an FP8 tensor that reads as its dequantized values, cast to
    ``dtype`` (float32 by default): ``self[slices]`` (one ``slice(start, stop, step)`` per
    dimension, as load's reader asks) reads those FP8 elements and the scale blocks that
    cover them, and nothing else. ``bytes_read`` counts both; a damaged scale among those
    read is an error naming ``scale_key``. The scale blocks read are kept (per covering
    box), so the strided runs of one box that share blocks read and check them once.

    The values are the format's, ``dtype(float32(q) * scale)``, bit for bit, computed a
    chunk of rows at a time (:func:`_dequant_into`): no float32 copy of the whole box,
    and e4m3fn converted to float32 through float16 (:func:`_e4m3_as_f16`),
    which is exact and many times faster than torch's float8 cast on CPU.
    ``into``: where the next box read goes when it has that shape and dtype (a slot of
    the caller's buffer: no copy of the box afterwards); it is used once."""

    def __init__(
        self,
        data: Any,
        scale: Any,
        bq: BlockQuant,
        scale_key: str,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.data, self.scale, self.bq, self.scale_key = data, scale, bq, scale_key
        self.dtype = dtype
        self.bytes_read = 0
        self.into: torch.Tensor | None = None
        self._scales: dict[tuple[tuple[int, int, int], ...], torch.Tensor] = {}

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        into, self.into = self.into, None
        q = self.data[index]
        self.bytes_read += q.numel() * q.element_size()
        *lead, rows, cols = index
        if q.numel() == 0:
            return torch.empty(q.shape, dtype=self.dtype)
        blocks = [_covering(sl, n) for sl, n in zip((rows, cols), self.bq.block, strict=True)]
        s = self._covering_scales(lead, [(int(b[0]), int(b[-1]) + 1) for b in blocks])
        # per block row, one scale per column (few values): no scale tensor of the box's size
        s = s.index_select(-1, blocks[1] - blocks[1][0])
        at, counts = torch.unique_consecutive(blocks[0] - blocks[0][0], return_counts=True)
        fits = into is not None and into.shape == q.shape and into.dtype == self.dtype
        if into is None or not (fits and into.is_contiguous()):
            into = torch.empty(q.shape, dtype=self.dtype)
        _dequant_into(into, q, s, list(zip(at.tolist(), counts.tolist(), strict=True)))
        return into

    def _covering_scales(self, lead: Sequence[slice], cover: Sequence[tuple[int, int]]) -> Any:
        """The float32 scale blocks ``cover`` (block rows, block cols) of the matrices
        ``lead`` selects, read and checked once."""
        key = tuple((sl.start or 0, sl.stop, sl.step or 1) for sl in lead) + tuple(
            (a, b, 1) for a, b in cover
        )
        s = self._scales.get(key)
        if s is not None:
            return s
        s = self.scale[tuple(lead) + tuple(slice(a, b) for a, b in cover)]
        self.bytes_read += s.numel() * s.element_size()
        s = s.to(torch.float32)
        origin = [(sl.start or 0, sl.step or 1) for sl in lead] + [(a, 1) for a, _ in cover]
        why = bad_scales(s, self.bq, origin)
        if why is not None:
            raise ValueError(f"{self.scale_key}: {why}")
        self._scales[key] = s
        return s


def _covering(sl: slice, block: int) -> torch.Tensor:
    """For each index of the (non-empty) slice ``sl``, the index of its block."""
    return torch.arange(sl.start, sl.stop, sl.step or 1) // block


# Elements per chunk of :func:`_dequant_into` (its float32 scratch: 4 MiB, reused): fewer,
# larger passes cost less per element than cache-sized ones here (measured: bench/RESULTS.md)
CHUNK_ELEMENTS = 1 << 20
# float16(_e4m3_as_f16(q)) is float32(q) * 2**-8 for every e4m3fn q but NaN (0x7f, 0xff,
# which it maps to +-1.875: above 448 * 2**-8, the largest finite value's image)
_E4M3_SHIFT, _E4M3_FINITE_MAX = 256.0, 448.0 / 256.0


def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of the 256 codes of the FP8 ``dtype``, by torch's own cast
    (NaN codes included, with torch's bits): ``fp8_table(d)[code]`` is
    ``float32(code.view(d))``, exactly."""
    table = _TABLES.get(dtype)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32)
        _TABLES[dtype] = table
    return table


_TABLES: dict[torch.dtype, torch.Tensor] = {}
_SCRATCH = threading.local()


def _scratch(dtype: torch.dtype, n: int) -> torch.Tensor:
    """This thread's buffer of ``dtype``, at least ``n`` elements, kept from call to call
    (a fresh buffer of megabytes is fresh pages from the system on every box)."""
    kept: dict[torch.dtype, torch.Tensor] = _SCRATCH.__dict__.setdefault("kept", {})
    have = kept.get(dtype)
    if have is None or have.numel() < n:
        have = kept[dtype] = torch.empty(n, dtype=dtype)
    return have[:n]


def _dequant_into(
    out: torch.Tensor, q: torch.Tensor, s: torch.Tensor, runs: list[tuple[int, int]]
) -> None:
    """``out[..., r, c] = float32(q[..., r, c]) * s[..., b(r), c]`` cast to ``out``'s
    dtype, where the rows come in ``runs`` of ``(b, n)``: ``n`` rows of scale row ``b``
    (``s`` float32 ``(..., block rows, cols)``).

    Chunks of rows of at most :data:`CHUNK_ELEMENTS` (across block rows): the FP8 bytes
    converted to float32 in a reused scratch buffer (straight in ``out`` when it is float32
    and the chunk contiguous), each block row's part multiplied in place by its scales,
    and the chunk cast into ``out``. For e4m3fn the conversion goes through float16
    (:func:`_e4m3_as_f16`, exact: ``q * 2**-8``) and the scale is taken times 2**8 (exact
    while it stays finite): the product is the same real number, so the same float32. A
    chunk holding a NaN code, scales too large for the shift, and other FP8 dtypes are
    converted by :func:`fp8_table`, torch's own cast of each code."""
    *lead, rows, cols = q.shape
    per_row = max(1, math.prod(lead) * cols)
    step = max(1, CHUNK_ELEMENTS // per_row)
    fast = q.dtype == torch.float8_e4m3fn and bool(s.max() < 2.0**119)
    shifted = s * _E4M3_SHIFT if fast else s
    starts = list(itertools.accumulate((n for _, n in runs), initial=0))
    k = 0  # the run holding row a
    for a in range(0, rows, step):
        z = min(step, rows - a)
        chunk = q[..., a : a + z, :]
        dest = out[..., a : a + z, :]
        direct = out.dtype == torch.float32 and dest.is_contiguous()
        f = dest if direct else _scratch(torch.float32, chunk.numel()).view(chunk.shape)
        scale = shifted
        if not (fast and _e4m3_scaled(chunk, f)):
            codes = chunk.view(torch.uint8)
            wide = _scratch(torch.int32, chunk.numel())
            wide.view(chunk.shape).copy_(codes)
            torch.index_select(fp8_table(q.dtype), 0, wide, out=f.view(-1))
            scale = s
        while starts[k] < a + z:  # each block row's rows of the chunk times its scales
            b, lo, hi = runs[k][0], max(starts[k], a), min(starts[k + 1], a + z)
            f[..., lo - a : hi - a, :].mul_(scale[..., b : b + 1, :])
            if starts[k + 1] > a + z:
                break
            k += 1
        if not direct:
            dest.copy_(f)


def _e4m3_scaled(q: torch.Tensor, out: torch.Tensor) -> bool:
    """``out`` (float32) = ``float32(q) * 2**-8`` for the e4m3fn ``q``, through float16;
    False (``out`` unspecified) when ``q`` holds a NaN code."""
    h = _scratch(torch.int16, q.numel()).view(q.shape)
    _e4m3_as_f16(q, h)
    out.copy_(h.view(torch.float16))
    lo, hi = torch.aminmax(out)
    return float(hi) <= _E4M3_FINITE_MAX and float(lo) >= -_E4M3_FINITE_MAX


def _e4m3_as_f16(q: torch.Tensor, out: torch.Tensor) -> None:
    """The float16 bits of ``q * 2**-8`` (e4m3fn ``q``; its NaN codes give +-1.875) into
    ``out`` (int16): ``s eeee mmm`` -> ``s 0eeee mmm0000000``. The exponent bias 7 against
    float16's 15 is the factor 2**-8, for normal and subnormal values alike. Sign-extended
    to int16 and shifted left by 7, bit 15 and bit 14 both hold the sign; clearing bit 14
    leaves the float16."""
    out.copy_(q.view(torch.int8))
    out.bitwise_left_shift_(7).bitwise_and_(-16385)  # 0xbfff


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """The float32 values of the whole FP8 tensor ``q`` with its scales ``scale``."""
    full = _expand(scale.to(torch.float32), q.shape, block)
    return q.to(torch.float32) * full


def _expand(scale: torch.Tensor, shape: Sequence[int], block: Sequence[int]) -> torch.Tensor:
    """``scale`` with each block's value repeated over the block, cut to ``shape``."""
    rows, cols = shape[-2:]
    out = scale.repeat_interleave(block[0], dim=-2).narrow(-2, 0, rows)
    return out.repeat_interleave(block[1], dim=-1).narrow(-1, 0, cols)


def _block_amax(x: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """The largest ``|x|`` of each block of ``x``'s last two dimensions (float32)."""
    *lead, rows, cols = x.shape
    r, c = block
    nr, nc = -(-rows // r), -(-cols // c)
    padded = torch.zeros((*lead, nr * r, nc * c), dtype=torch.float32)
    padded[..., :rows, :cols] = x.abs()
    return padded.unflatten(-1, (nc, c)).unflatten(-3, (nr, r)).amax(dim=(-3, -1))


def quantize(w: torch.Tensor, bq: BlockQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``w`` (2-D, or stacked 3-D: a scale per matrix) under ``bq``:
    the module's rule, ``scale`` in the dtype it is written in (:data:`SCALE_TORCH`) and
    ``q`` quantized with that scale as stored, so that a reader's dequantization is the
    one this rule inverts; a block whose ``q`` is all zero gets scale 1.0 (what its
    values, zeros, quantize to again). Raises ValueError for a non-finite value (no
    scale can hold it) or a block whose scale overflows the scale's dtype (float16)."""
    w = w.to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("it holds NaN or infinite values, which FP8 blocks cannot scale")
    amax = _block_amax(w, bq.block)
    fmax = FP8_MAX[bq.dtype]
    stored = SCALE_TORCH[bq.scale_dtypes[0]]
    scale = (amax / fmax).clamp(min=torch.finfo(stored).tiny)
    if bq.scale_format == "ue8m0":
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent))
    scale = scale.to(stored)  # round to nearest: |w| / scale stays within fmax (1 + 2^-8)
    if not bool(torch.isfinite(scale).all()):
        big = float(amax.max())
        raise ValueError(
            f"a block's largest value {big:g} needs a scale above {bq.scale_format}'s largest value"
        )
    full = _expand(scale.to(torch.float32), w.shape, bq.block)
    q = (w / full).clamp(-fmax, fmax).to(FP8_TORCH[bq.dtype])
    zero = _block_amax(q.to(torch.float32), bq.block) == 0
    return q, torch.where(zero, torch.ones_like(scale), scale)


def quantization_config(bq: BlockQuant) -> dict[str, Any]:
    """transformers' ``quantization_config`` (``FineGrainedFP8Config``) of ``bq``."""
    out: dict[str, Any] = {
        "activation_scheme": "dynamic",
        "fmt": FP8_FMT[bq.dtype],
        "quant_method": "fp8",
        "weight_block_size": list(bq.block),
    }
    if bq.scale_format == "ue8m0":
        out["scale_fmt"] = "ue8m0"
    return out


def quantized_nbytes(bq: BlockQuant, shape: Sequence[int]) -> int:
    """The bytes of an FP8 tensor of ``shape`` and its scales, as export writes them."""
    n = 1
    for s in shape:
        n *= s
    m = 1
    for s in bq.scale_shape(shape):
        m *= s
    return n * FP8_TORCH[bq.dtype].itemsize + m * SCALE_ITEMSIZE[bq.scale_dtypes[0]]
