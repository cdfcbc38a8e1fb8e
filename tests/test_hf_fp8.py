"""Block-scaled FP8 Hugging Face checkpoints (issue 22, the runtime): ``load_hf`` reads each
rank's FP8 bytes and the scale blocks that cover them and dequantizes, ``export_hf``
quantizes per block and says so in ``config.json``.

The reference is the format's definition, written in ``tests/hf_fp8_scenarios.py`` (block
by block, in loops), not the runtime's code. On 4 gloo ranks (one spawn): transformers'
tiny DeepSeek-V3 (MLA, MoE, the router's ``e_score_correction_bias``) from an FP8
checkpoint whose other tensors are bf16, as DeepSeek ships them, on dp_shard 2 x ep 2, on
dp_shard 2 x tp 2 (a variant of its spec compiled by the test) and,
with dimensions that are multiples of 128 and 128 x 128 blocks, on dp_shard 4; the example
Llama (rope rows, fused q|k|v and gate|up) on dp_shard 2 x tp 2 with blocks that its cuts
cut, float32 and UE8M0 scales. Each load equals the reference dequantization bitwise
(DeepSeek's through transformers' own state dict of the dequantized checkpoint), makes no
collective, and reads at most 1.05x the bytes it owns with 128 x 128 blocks; each export
gives back the FP8 checkpoint's bytes and scales bitwise, with a ``quantization_config``
that transformers reads. Damaged checkpoints and exports that cannot be quantized run in
one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.bench_checkpoint import FakeMesh
from shardspec.core.hfmap import SCALE_FORMATS, BlockQuant
from shardspec.runtime import hf as hfrt
from shardspec.runtime.hf import fp8
from shardspec.testing import run_ranks
from tests import hf_fp8_scenarios as sc
from tests.hf_fp8_scenarios import FP8Case
from tests.hf_scenarios import hf_state, same_bits

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------- the block arithmetic, alone


@st.composite
def _quantized(draw: Any) -> tuple[torch.Tensor, BlockQuant]:
    lead = draw(st.sampled_from([(), (2,)]))
    rows, cols = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    block = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    fmt = draw(st.sampled_from(SCALE_FORMATS))
    dtype = draw(st.sampled_from(sorted(sc.FP8)))
    seed = draw(st.integers(0, 2**16))
    w = torch.randn((*lead, rows, cols), generator=torch.Generator().manual_seed(seed))
    w = w * 10.0 ** draw(st.integers(-6, 4))
    if draw(st.booleans()):  # a block of zeros
        w[..., : block[0], : block[1]] = 0.0
    return w, BlockQuant("w", block=block, scale_format=fmt, dtype=dtype)


@settings(max_examples=150, deadline=None)
@given(_quantized())
def test_quantize_equals_the_reference(case: tuple[torch.Tensor, BlockQuant]) -> None:
    """The runtime's quantizer gives the reference's bytes and scales (zero blocks: 1.0)."""
    w, bq = case
    q, s = fp8.quantize(w, bq)
    rq, rs = sc.ref_quantize(w, bq.block, bq.scale_format, bq.dtype)
    assert same_bits(q, rq) and same_bits(s, rs)
    assert s.shape == bq.scale_shape(w.shape)


@settings(max_examples=150, deadline=None)
@given(_quantized())
def test_dequantize_then_quantize_is_bitwise(case: tuple[torch.Tensor, BlockQuant]) -> None:
    """FP8 -> float32 -> FP8 gives back the bytes and the scales (float32, bfloat16 and
    float16 scales: the quantizer divides by the scale as stored): the
    export of a model that holds the dequantized values in float32 is the checkpoint it
    loaded. UE8M0 gives back the values, not always the bytes: a block whose largest
    value rounded down to a power of two times 448 (224 x 2^-11) is requantized with the
    smaller scale (448 x 2^-12), the same value."""
    w, bq = case
    q, s = sc.ref_quantize(w, bq.block, bq.scale_format, bq.dtype)
    values = sc.ref_dequantize(q, s, bq.block)
    q2, s2 = fp8.quantize(values, bq)
    if bq.scale_format != "ue8m0":
        assert same_bits(q2, q) and same_bits(s2, s)
    assert same_bits(sc.ref_dequantize(q2, s2, bq.block), values)


def test_the_scale_round_trip_holds_over_whole_binades() -> None:
    """``fl(fl(448 * s) / 448) == s`` for every ``s = fl(a / 448)``, ``a`` every float32
    of five binades (the round trip's scales; e5m2's 57344 as well)."""
    for fmax in (448.0, 57344.0):
        for e in (-20, -3, 0, 5, 9):
            a = (((e + 127) << 23) | torch.arange(0, 1 << 23, dtype=torch.int32)).view(
                torch.float32
            )
            s = a / fmax
            assert torch.equal((s * fmax) / fmax, s)


@st.composite
def _boxes(draw: Any) -> tuple[torch.Tensor, torch.Tensor, BlockQuant, tuple[slice, ...]]:
    w, bq = draw(_quantized())
    q, s = sc.ref_quantize(w, bq.block, bq.scale_format, bq.dtype)
    index = []
    for n in w.shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        index.append(slice(a, b, draw(st.integers(1, 3))))
    return q, s, bq, tuple(index)


@settings(max_examples=200, deadline=None)
@given(_boxes())
def test_a_box_reads_only_its_covering_blocks(
    case: tuple[torch.Tensor, torch.Tensor, BlockQuant, tuple[slice, ...]],
) -> None:
    """A (strided) box of the FP8 tensor, dequantized from its own bytes and the scale
    blocks that cover it, equals the box of the whole reference dequantization; the
    bytes read are the box's and those blocks'."""
    q, s, bq, index = case
    sl = fp8.DequantSlice(q, s, bq, "w_scale_inv")
    got = sl[index]
    want = sc.ref_dequantize(q, s, bq.block)[index]
    assert same_bits(got, want.new_empty(want.shape).copy_(want))  # plain strides
    rows, cols = (range(x.start, x.stop, x.step) for x in index[-2:])
    spans = [(ix[-1] // n) - (ix[0] // n) + 1 for ix, n in zip((rows, cols), bq.block, strict=True)]
    lead = len(range(*index[0].indices(q.shape[0]))) if q.ndim == 3 else 1
    assert sl.bytes_read == got.numel() + s.element_size() * lead * spans[0] * spans[1]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (float("nan"), "scale nan"),
        (float("inf"), "scale inf"),
        (0.0, "scale 0.0"),
        (-1.0, "scale -1.0"),
        (3.0, "not a power of two"),
    ],
)
def test_damaged_scale_values(value: float, says: str) -> None:
    bq = BlockQuant("w", block=(2, 2), scale_format="ue8m0")
    s = torch.ones(2, 2)
    s[1, 0] = value
    assert says in (fp8.bad_scales(s, bq) or "")
    assert "at block [1, 0]" in (fp8.bad_scales(s, bq) or "")
    assert fp8.bad_scales(torch.ones(2, 2), bq) is None


def test_a_damaged_scale_is_named_at_its_place_in_the_whole_tensor() -> None:
    """A box away from the tensor's start reads a part of the scales: the block named is
    the whole scale tensor's, for the matrix's blocks and a stacked tensor's expert."""
    bq = BlockQuant("w", block=(2, 2))
    q = torch.ones(3, 8, 8).to(torch.float8_e4m3fn)
    scale = torch.ones(3, 4, 4)
    scale[2, 3, 2] = float("nan")
    box = fp8.DequantSlice(q, scale, bq, "w_scale_inv")
    with pytest.raises(ValueError, match=r"w_scale_inv: scale nan at block \[2, 3, 2\]"):
        box[slice(1, 3, 1), slice(6, 8, 1), slice(4, 8, 1)]
    assert box[slice(0, 2, 1), slice(6, 8, 1), slice(4, 8, 1)].shape == (2, 2, 4)


def test_quantize_refuses_non_finite_values() -> None:
    w = torch.ones(4, 4)
    w[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        fp8.quantize(w, BlockQuant("w", block=(2, 2)))


@pytest.mark.parametrize(
    "bq",
    [
        BlockQuant("w"),
        BlockQuant("w", scale_format="ue8m0", dtype="float8_e5m2"),
        BlockQuant("w", block=(64, 32), scale_format="bfloat16"),
    ],
)
def test_transformers_reads_the_quantization_config(bq: BlockQuant) -> None:
    from transformers.utils.quantization_config import FineGrainedFP8Config

    qc = FineGrainedFP8Config.from_dict(fp8.quantization_config(bq))
    assert qc.quant_method == "fp8" and list(qc.weight_block_size) == list(bq.block)
    assert qc.activation_scheme == "dynamic"
    assert qc.scale_fmt == ("ue8m0" if bq.scale_format == "ue8m0" else "float")
    # transformers 5.24's FineGrainedFP8Config keeps no `fmt` (its loader assumes e4m3);
    # the config states it all the same, as DeepSeek's does
    assert (
        fp8.quantization_config(bq)["fmt"]
        == {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}[bq.dtype]
    )


# ----------------------------------------------------- one process: damaged checkpoints

MESH = FakeMesh(("dp_shard", "tp"), (1, 1), (0, 0))
BLOCK = (8, 8)
KEY = "model.layers.0.self_attn.q_proj.weight"
SCALE = KEY + "_scale_inv"


@pytest.fixture(scope="module")
def llama_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The untied Llama checkpoint (transformers' own, several files), FP8 in 8 x 8
    blocks for its linear layers."""
    from tests.test_hf import write_checkpoints

    root = tmp_path_factory.mktemp("hf_fp8_one")
    write_checkpoints(root)
    sc.write_fp8(str(root / "llama"), str(root / "llama_fp8"), sc.quants(sc.LLAMA_GLOBS, BLOCK))
    return root / "llama_fp8"


def _layout_and_model() -> tuple[Any, Any, torch.nn.Module]:
    import generated.llama as layout
    from examples.models import llama

    model = llama.tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    hfmap = dataclasses.replace(layout.HF, quants=sc.quants(sc.LLAMA_GLOBS, BLOCK))
    return layout, hfmap, model


def _damaged(src: Path, dst: Path, change: Any) -> Path:
    """A copy of ``src`` whose file holding ``KEY`` has ``change(tensors)`` applied."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    name = wm[KEY]
    tensors = load_file(str(dst / name))
    change(tensors, wm)
    save_file(tensors, str(dst / name), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _set_scale(value: float) -> Any:
    def change(t: dict, wm: dict) -> None:
        t[SCALE] = t[SCALE].clone()
        t[SCALE][1, 2] = value

    return change


def _drop_scale(t: dict, wm: dict) -> None:
    del t[SCALE]
    del wm[SCALE]


DAMAGE = {
    "missing scale": (_drop_scale, f"{SCALE}: missing from the checkpoint"),
    "scale shape": (
        lambda t, wm: t.__setitem__(SCALE, t[SCALE][:-1].clone()),
        rf"{SCALE}: shape \[7, 8\], the scale of {KEY} \[64, 64\] in blocks of 8 x 8 has "
        r"shape \[8, 8\]",
    ),
    "scale dtype": (
        lambda t, wm: t.__setitem__(SCALE, t[SCALE].to(torch.bfloat16)),
        f"{SCALE}: the file stores BF16, a float32 scale is F32",
    ),
    "weight dtype": (
        lambda t, wm: t.__setitem__(KEY, t[KEY].to(torch.bfloat16)),
        f"{KEY}: the file stores BF16, the hf block declares it float8_e4m3fn",
    ),
    "NaN scale": (_set_scale(float("nan")), f"{SCALE}: scale nan at block \\[1, 2\\]"),
    "inf scale": (_set_scale(float("inf")), f"{SCALE}: scale inf"),
    "zero scale": (_set_scale(0.0), f"{SCALE}: scale 0.0"),
    "negative scale": (_set_scale(-0.5), f"{SCALE}: scale -0.5"),
}


def test_the_fp8_checkpoint_loads_in_one_process(llama_fp8: Path) -> None:
    """The undamaged checkpoint loads (the damaged ones below differ only in the damage)."""
    layout, hfmap, model = _layout_and_model()
    report = hfrt.load_hf(layout.SPEC, hfmap, model, str(llama_fp8), MESH)
    assert report.bytes_read == report.bytes_owned
    assert not any(bool((p == 7.0).all()) for p in model.parameters())


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_refused_and_the_model_unchanged(
    llama_fp8: Path, tmp_path: Path, damage: str
) -> None:
    change, says = DAMAGE[damage]
    folder = _damaged(llama_fp8, tmp_path / "ckpt", change)
    layout, hfmap, model = _layout_and_model()
    with pytest.raises(hfrt.HFError, match=says):
        hfrt.load_hf(layout.SPEC, hfmap, model, str(folder), MESH)
    assert all(bool((p == 7.0).all()) for p in model.parameters())


def test_ue8m0_scales_stored_as_e8m0_load_as_float32_ones(llama_fp8: Path, tmp_path: Path) -> None:
    """UE8M0 scales may be stored as F8_E8M0 (a byte of exponent): the same values as
    their float32 copy, the same load, bitwise; a float32 line refuses them."""
    qs = sc.quants(sc.LLAMA_GLOBS, BLOCK, "ue8m0")
    sc.write_fp8(str(llama_fp8.parent / "llama"), str(tmp_path / "f32"), qs)

    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tmp_path / "f32", tmp_path / "e8")
    for f in sorted((tmp_path / "e8").glob("*.safetensors")):
        tensors = load_file(str(f))
        for k in [k for k in tensors if k.endswith("_scale_inv")]:
            tensors[k] = tensors[k].to(torch.float8_e8m0fnu)
        save_file(tensors, str(f), metadata={"format": "pt"})
    assert any(t.dtype == torch.float8_e8m0fnu for t in hf_state(str(tmp_path / "e8")).values())
    layout, float32, model = _layout_and_model()  # float32: the same lines, float32 scales
    hfmap = dataclasses.replace(layout.HF, quants=qs)
    states = []
    for name in ("f32", "e8"):
        _, _, model = _layout_and_model()
        report = hfrt.load_hf(layout.SPEC, hfmap, model, str(tmp_path / name), MESH)
        states.append(model.state_dict())
        # one process reads whole blocks: what it owns is what it reads, 1-byte scales too
        assert report.bytes_read == report.bytes_owned, name
    assert all(same_bits(states[0][k], states[1][k]) for k in states[0])
    with pytest.raises(hfrt.HFError, match="the file stores F8_E8M0, a float32 scale is F32"):
        hfrt.load_hf(layout.SPEC, float32, model, str(tmp_path / "e8"), MESH)


def test_a_scale_without_its_declaration_is_unexpected(llama_fp8: Path) -> None:
    """Without the FP8 lines the scales are keys nothing reads, and FP8 weights are
    refused whatever the options (their values need their scales): the load is refused,
    the model unchanged."""
    import generated.llama as layout

    _, _, model = _layout_and_model()
    with pytest.raises(hfrt.HFError, match=f"{SCALE}: unexpected key"):
        hfrt.load_hf(layout.SPEC, layout.HF, model, str(llama_fp8), MESH)
    # the scales dropped, the FP8 weights are still refused: never cast without scales
    dropped = dataclasses.replace(layout.HF, drops=(*layout.HF.drops, "**_scale_inv"))
    with pytest.raises(hfrt.HFError, match=f"{KEY}: the file stores F8_E4M3, which no fp8"):
        hfrt.load_hf(layout.SPEC, dropped, model, str(llama_fp8), MESH, other_dtypes=True)
    assert all(bool((p == 7.0).all()) for p in model.parameters())


def test_an_export_that_cannot_be_quantized_is_refused(tmp_path: Path) -> None:
    layout, hfmap, model = _layout_and_model()
    with torch.no_grad():
        model.layers["0"].attention.wo.weight[3, 4] = float("inf")
    with pytest.raises(hfrt.HFError, match=r"o_proj\.weight: it holds NaN or infinite values"):
        hfrt.export_hf(layout.SPEC, hfmap, model, str(tmp_path / "out"), MESH)
    assert os.listdir(tmp_path) == []


def test_fp8_lines_that_transformers_cannot_state_together_are_refused(tmp_path: Path) -> None:
    layout, hfmap, model = _layout_and_model()
    two = (BlockQuant("model.layers.*.mlp.*.weight", block=(4, 4)), *hfmap.quants)
    with pytest.raises(hfrt.HFError, match="differ in block size"):
        hfrt.export_hf(
            layout.SPEC, dataclasses.replace(hfmap, quants=two), model, str(tmp_path / "o"), MESH
        )
    assert os.listdir(tmp_path) == []


def test_an_export_keeps_unmatched_keys_and_writes_the_config(tmp_path: Path) -> None:
    """Keys no FP8 line matches keep their dtype (``dtype`` casts them); the config's
    ``quantization_config`` is what AutoConfig reads back."""
    from examples.models import hf as hfm

    layout, hfmap, model = _layout_and_model()
    out = tmp_path / "out"
    config = hfm.llama_config(tied=False).to_dict()
    hfrt.export_hf(layout.SPEC, hfmap, model, str(out), MESH, config=config, dtype=torch.bfloat16)
    state = hf_state(str(out))
    fp8_keys = {k for k, t in state.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8_keys == {k for k in state if hfmap.quant_of(k) is not None} and fp8_keys
    assert {str(state[k + "_scale_inv"].dtype) for k in fp8_keys} == {"torch.float32"}
    rest = set(state) - fp8_keys - {k + "_scale_inv" for k in fp8_keys}
    assert rest and {state[k].dtype for k in rest} == {torch.bfloat16}
    qc = transformers.AutoConfig.from_pretrained(out).quantization_config
    assert dict(qc) == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [8, 8],
    }
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )


def test_an_export_without_fp8_drops_a_copied_fp8_quantization_config(tmp_path: Path) -> None:
    """A config copied from an FP8 checkpoint, with an export that writes no FP8 tensor:
    its fp8 quantization_config goes (transformers would read the tensors as FP8); other
    keys stay."""
    import generated.llama as layout

    _, hfmap, model = _layout_and_model()
    config = {
        "model_type": "llama",
        "quantization_config": fp8.quantization_config(hfmap.quants[0]),
    }
    hfrt.export_hf(layout.SPEC, layout.HF, model, str(tmp_path / "out"), MESH, config=config)
    data = json.loads((tmp_path / "out" / "config.json").read_text())
    assert data == {"model_type": "llama"}


def test_a_tie_alias_not_written_takes_its_scale_along(tmp_path: Path) -> None:
    """lm_head.weight tied to the embedding, both declared FP8: the alias is left out, and
    so is its scale (the index names only what the files hold)."""
    layout, hfmap, model = _layout_and_model()
    with torch.no_grad():
        model.output.weight.copy_(model.tok_embeddings.weight)
    both = (
        BlockQuant("lm_head.weight", block=BLOCK),
        BlockQuant("model.embed_tokens.weight", block=BLOCK),
    )
    hfmap = dataclasses.replace(hfmap, quants=(*both, *hfmap.quants))
    out = tmp_path / "out"
    report = hfrt.export_hf(
        layout.SPEC, hfmap, model, str(out), MESH, config={"tie_word_embeddings": True}
    )
    assert report.aliases_not_written == ["lm_head.weight"]
    state = hf_state(str(out))
    assert "model.embed_tokens.weight_scale_inv" in state
    assert not {"lm_head.weight", "lm_head.weight_scale_inv"} & set(state)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)


# ------------------------------ issue 22's leftovers: BF16/F16 scales, the quantizer's edges


def test_the_quantizer_at_its_edges() -> None:
    """Per block, against the reference and the values the rule must give: values at
    +-FP8_MAX times the scale are exact; values below the FP8 type's smallest subnormal
    (2^-9 for e4m3) times the scale flush to zero; a ratio a hair above 448 (the scale
    rounded down to bfloat16) clamps to 448, not NaN; a zero block, or one whose every
    value flushes to zero, has scale 1.0; a block of float32 subnormals gets the smallest
    normal scale's zeros, so scale 1.0 too."""
    bq = BlockQuant("w", block=(2, 2))
    w = torch.zeros(6, 4)
    w[0:2, 0:2] = torch.tensor([[448.0, -448.0], [1.0, 2.0**-10]])  # scale 1: 2^-10 flushes
    w[2:4, 0:2] = torch.tensor([[1e-44, -1e-44], [0.0, 3e-45]])  # float32 subnormals
    w[4:6, 2:4] = torch.tensor([[7.0, -7.0], [7.0 * 2.0**-20, 0.0]])
    q, s = fp8.quantize(w, bq)
    rq, rs = sc.ref_quantize(w, bq.block)
    assert same_bits(q, rq) and same_bits(s, rs)
    assert q[0, 0].item() == 448.0 and q[0, 1].item() == -448.0 and s[0, 0].item() == 1.0
    assert q[1, 1].item() == 0.0  # below e4m3's 2^-9
    assert q[1, 0].item() == 1.0
    assert s[0, 1].item() == 1.0 and not q[0:2, 2:4].any()  # the zero block
    assert s[1, 0].item() == 1.0 and not q[2:4, 0:2].float().any()  # flushed subnormals
    assert q[4, 2].item() == 448.0 and q[5, 2].item() == 0.0  # 448 * 2^-20 < 2^-10
    assert s[2, 1].item() == 7.0 / 448.0
    # bfloat16 scales: 3 / 448 rounds down in bfloat16, so 3 / scale is a hair above
    # 448: clamped to 448 (the plain cast of 448.4 also rounds to 448, but the rule says so)
    b16 = BlockQuant("w", block=(1, 1), scale_format="bfloat16")
    x = torch.tensor([[3.0]])
    qb, sb = fp8.quantize(x, b16)
    assert sb.dtype == torch.bfloat16 and float(sb) < 3.0 / 448.0
    assert qb.item() == 448.0 and same_bits(qb, sc.ref_quantize(x, (1, 1), "bfloat16")[0])
    # float16 scales overflow for a block whose amax / 448 passes 65504: refused
    with pytest.raises(ValueError, match="needs a scale above float16's largest value"):
        fp8.quantize(torch.full((1, 1), 3e7), BlockQuant("w", scale_format="float16"))


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_bf16_and_f16_scales_load_and_export_bitwise(
    llama_fp8: Path, tmp_path: Path, fmt: str
) -> None:
    """Qwen3's FP8 releases store weight_scale_inv in BF16: a ``bfloat16`` (``float16``)
    line loads them, dequantizing in float32 (``float32(q) * float32(scale)``), into the
    reference's values bitwise, and counts 2 bytes per scale as owned; the export writes
    the scales in that dtype and gives back the checkpoint's FP8 bytes and scales bitwise;
    a float32 line refuses them, naming the word to write."""
    qs = sc.quants(sc.LLAMA_GLOBS, BLOCK, fmt)
    src = tmp_path / "fp8"
    sc.write_fp8(str(llama_fp8.parent / "llama"), str(src), qs)
    sc.write_dequantized(str(src), str(tmp_path / "deq"), qs)
    state = hf_state(str(src))
    scales = {k: t.dtype for k, t in state.items() if k.endswith("_scale_inv")}
    assert scales and set(scales.values()) == {getattr(torch, fmt)}
    layout, float32, model = _layout_and_model()
    hfmap = dataclasses.replace(layout.HF, quants=qs)
    report = hfrt.load_hf(layout.SPEC, hfmap, model, str(src), MESH)
    assert report.bytes_read == report.bytes_owned
    _, _, truth = _layout_and_model()
    hfrt.load_hf(layout.SPEC, layout.HF, truth, str(tmp_path / "deq"), MESH)
    want = truth.state_dict()
    assert all(same_bits(t, want[k]) for k, t in model.state_dict().items())
    hfrt.export_hf(layout.SPEC, hfmap, model, str(tmp_path / "out"), MESH)
    out = hf_state(str(tmp_path / "out"))
    assert out.keys() == state.keys()
    assert all(same_bits(out[k], state[k]) for k in state), [
        k for k in state if not same_bits(out[k], state[k])
    ]
    _, _, fresh = _layout_and_model()
    stored = {"bfloat16": "BF16", "float16": "F16"}[fmt]
    with pytest.raises(hfrt.HFError, match=f"write `{fmt}` on the fp8 line for {stored}"):
        hfrt.load_hf(layout.SPEC, float32, fresh, str(src), MESH)
    assert all(bool((p == 7.0).all()) for p in fresh.parameters())


def test_keep_dtype_on_an_fp8_key_is_refused(tmp_path: Path) -> None:
    """``keep_dtype`` naming a key an fp8 line declares would be ignored (the line writes
    it in FP8): refused before anything is written, naming the key and the line."""
    layout, hfmap, model = _layout_and_model()
    with pytest.raises(
        hfrt.HFError,
        match=r"keep_dtype: '\*.self_attn.q_proj.weight' matches model.layers.0.self_attn"
        r".q_proj.weight, which the hf block writes block-scaled in FP8",
    ):
        hfrt.export_hf(
            layout.SPEC,
            hfmap,
            model,
            str(tmp_path / "out"),
            MESH,
            dtype=torch.bfloat16,
            keep_dtype="*.self_attn.q_proj.weight",
        )
    assert os.listdir(tmp_path) == []
    # a pattern over keys no fp8 line covers is kept, as before
    hfrt.export_hf(
        layout.SPEC,
        hfmap,
        model,
        str(tmp_path / "ok"),
        MESH,
        dtype=torch.bfloat16,
        keep_dtype="*norm.weight",
    )
    state = hf_state(str(tmp_path / "ok"))
    assert state["model.norm.weight"].dtype == torch.float32


LEFTOVERS = [sc.LeftoverCase("stacked"), sc.LeftoverCase("pp")]


def _write_leftovers(root: Path) -> None:
    """gpt_oss's checkpoint (stacked experts) and the 4-layer Llama's (three files, the
    pipeline tests' writer) in FP8 by the reference quantizer, each with its reference
    dequantization; ``llama_pp_hf`` compiled as tests/test_hf_pipeline.py does."""
    from examples.models import llama
    from tests.hf_pipeline_scenarios import N_LAYERS
    from tests.test_hf_grouped import checkpoint
    from tests.test_hf_pipeline import compile_specs, to_hf, write_hf

    checkpoint(root, "gpt_oss", 5)
    sc.write_fp8(str(root / "gpt_oss"), str(root / "gpt_oss_fp8"), sc.GPT_OSS_QUANTS)
    sc.write_dequantized(str(root / "gpt_oss_fp8"), str(root / "gpt_oss_deq"), sc.GPT_OSS_QUANTS)
    cfg = llama.LlamaConfig(n_layers=N_LAYERS)
    model = llama.tiny(n_layers=N_LAYERS)
    llama.init_weights(model, seed=7)
    write_hf(root / "hf", to_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg), cfg)
    shutil.rmtree(root / "gen")
    compile_specs(root / "gen", root / "hf")
    sc.write_fp8(str(root / "hf"), str(root / "pp_fp8"), sc.PP_QUANTS)
    sc.write_dequantized(str(root / "pp_fp8"), str(root / "pp_deq"), sc.PP_QUANTS)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One spawn of 4 ranks for every multi-rank case of this file (sc.run_both): CASES
    and DAMAGED on ``results``'s checkpoints (``_write_all``), then LEFTOVERS on
    ``_write_leftovers``'s; each root keeps its own ``gen`` folder (no module name in
    both)."""
    root = tmp_path_factory.mktemp("hf_fp8")
    _write_all(root)
    _compile_128(root / "gen", root / "ds32_128")
    _compile_tp(root / "gen")
    left = tmp_path_factory.mktemp("hf_fp8_leftovers")
    _write_leftovers(left)
    cases = [*CASES, DAMAGED]
    ranks = run_ranks(sc.run_both, 4, str(root), cases, str(left), LEFTOVERS, timeout=900)
    return {
        "results": {"root": root, "ranks": [r["main"] for r in ranks]},
        "leftovers": {"root": left, "ranks": [r["leftovers"] for r in ranks]},
    }


@pytest.fixture(scope="module")
def leftovers(spawned: dict) -> dict:
    """LEFTOVERS' part of the spawn: ``root`` and each rank's Items."""
    result: dict = spawned["leftovers"]
    return result


@pytest.mark.parametrize("case", LEFTOVERS, ids=lambda c: c.label)
def test_stacked_and_pipeline_fp8_load_and_export_on_4_ranks(leftovers: dict, case: Any) -> None:
    """A stacked ``[E, R, C]`` FP8 key with per-expert scales ``[E, ceil(R/5), ceil(C/7)]``
    (gpt_oss, BF16 scales on down_proj) on ranks that hold 2 of its 4 experts and half of
    down_proj's rows, and a pipeline stage module (pp 2 x tp 2): each load equals the
    reference dequantization bitwise with no collective, and each export gives back the
    FP8 checkpoint's bytes and scales bitwise."""
    items = [r[case.label] for r in leftovers["ranks"]]
    fails = [f for it in items for f in it.fail]
    assert not fails, "\n".join(fails)
    assert all(it.checked > 0 for it in items)
    assert items[0].extra["fp8 keys"]
    if case.label == "stacked":
        state = hf_state(str(leftovers["root"] / "gpt_oss_fp8"))
        key = "model.layers.0.mlp.experts.down_proj"
        assert state[key].shape == (4, 32, 64) and state[key].dtype == torch.float8_e4m3fn
        assert state[key + "_scale_inv"].shape == (4, 7, 10)
        assert state[key + "_scale_inv"].dtype == torch.bfloat16
        for it in items:  # part of the experts, part of the rows
            assert it.extra["local shapes"][key] == [2, 16, 64], it.extra


# -------------------------------------------------------------- 4 gloo ranks, one spawn

DS128 = (
    ("hidden_size", 128),
    ("intermediate_size", 256),
    ("moe_intermediate_size", 128),
    ("q_lora_rank", 128),
    ("kv_lora_rank", 128),
    ("qk_nope_head_dim", 32),
    ("qk_rope_head_dim", 32),
    ("v_head_dim", 32),
)
LLAMA = "generated.llama"
DEEPSEEK = "generated.deepseek_v3"
REPO = Path(__file__).resolve().parents[1]
CASES = [
    FP8Case(LLAMA, (("dp_shard", 2), ("tp", 2)), "llama", "llama_5x7", "llama_5x7_deq", (5, 7)),
    FP8Case(
        LLAMA, (("dp_shard", 2), ("tp", 2)), "llama", "llama_u", "llama_u_deq", (6, 10), "ue8m0"
    ),
    FP8Case(
        DEEPSEEK, (("dp_shard", 2), ("ep", 2)), "deepseek", "ds", "ds_deq", (8, 8), rest="bfloat16"
    ),
    FP8Case(
        "deepseek_v3_tp",  # compiled by _compile_tp
        (("dp_shard", 2), ("tp", 2)),
        "deepseek",
        "ds",
        "ds_deq",
        (8, 8),
        rest="bfloat16",
    ),
    FP8Case(
        "deepseek_v3_128",  # compiled by _compile_128
        (("dp_shard", 4), ("ep", 1)),
        "deepseek",
        "ds128",
        "ds128_deq",
        (128, 128),
        config=DS128,
        rest="bfloat16",
    ),
]


# A NaN in the first scale block of layer 0's o_proj, which tp cuts by columns: the ranks
# holding its first columns read the block, the others do not.
DAMAGED = sc.DamagedCase(CASES[0], "llama_5x7_nan", "model.layers.0.self_attn.o_proj.weight")


def _write_all(root: Path) -> None:
    from examples.models import hf as hfm
    from tests.test_hf import _randomize
    from tests.test_hf_buffers import write_checkpoint

    m = transformers.LlamaForCausalLM(hfm.llama_config(tied=False))
    _randomize(m, 1)
    m.save_pretrained(root / "llama32", max_shard_size="100KB")
    write_checkpoint(root / "ds32")
    write_checkpoint(root / "ds32_128", **dict(DS128))
    src = {"llama": "llama32", "ds": "ds32", "ds128": "ds32_128"}
    for case in {c.hf: c for c in CASES}.values():  # each checkpoint once
        qs = sc.quants(case.globs, case.block, case.fmt)
        rest = getattr(torch, case.rest) if case.rest else None
        base = case.hf.split("_")[0] if case.model == "llama" else case.hf
        sc.write_fp8(str(root / src[base]), str(root / case.hf), qs, rest=rest)
        sc.write_dequantized(str(root / case.hf), str(root / case.truth), qs)
    _nan_scale(root / CASES[0].hf, root / DAMAGED.hf, DAMAGED.key + "_scale_inv")


def _nan_scale(src: Path, dst: Path, scale: str) -> None:
    """A copy of checkpoint ``src`` whose ``scale`` holds a NaN in block (0, 0)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    wm = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = load_file(str(dst / wm[scale]))
    tensors[scale][0, 0] = float("nan")
    save_file(tensors, str(dst / wm[scale]), metadata={"format": "pt"})


def _compile_128(gen: Path, hf_dir: Path) -> None:
    """specs/deepseek_v3.shard over the DeepSeek-V3 of ``DS128`` (its own model and HF
    manifests), compiled with the real CLI to ``gen/deepseek_v3_128.py``."""
    from tests.test_hf import shardspec

    text = (REPO / "specs" / "deepseek_v3.shard").read_text(encoding="utf-8")
    for old in ("deepseek_v3.manifest.json", "deepseek_v3.hf.json"):
        assert text.count(old) == 1, f"specs/deepseek_v3.shard changed: {old!r}"
        text = text.replace(old, old.replace("deepseek_v3", "deepseek_v3_128"))
    gen.mkdir(parents=True, exist_ok=True)
    (gen / "deepseek_v3_128.shard").write_text(text, encoding="utf-8")
    args = [a for k, v in DS128 for a in ("--arg", f"{k}={v}")]
    out = str(gen / "deepseek_v3_128.manifest.json")
    shardspec("manifest", "examples.models.hf:deepseek_v3_tiny", *args, "-o", out)
    shardspec("hf-manifest", str(hf_dir), "-o", str(gen / "deepseek_v3_128.hf.json"))
    shardspec("compile", str(gen / "deepseek_v3_128.shard"), "-o", str(gen))


# specs/deepseek_v3.shard on dp_shard x tp: the experts' ffn, and every other 2-D weight's
# rows but the embeddings', lm_head's and the router's, over tp (placements only: `style
# none`, as a load needs no forward).
TP_EDITS = (
    ("    dp_shard: *\n    ep: 2\n", "    dp_shard: *\n    tp: 2\n"),
    (
        "    shard experts over ep\n    style none\n}\nparam model.layers.*.mlp.experts.down_proj",
        "    shard ffn over tp\n    style none\n}\nparam model.layers.*.mlp.experts.down_proj",
    ),
    (
        "[experts, hidden, ffn] {\n    shard experts over ep\n",
        "[experts, hidden, ffn] {\n    shard ffn over tp\n",
    ),
    (
        "param **.weight [out, in] {}\n",
        "param model.layers.*.mlp.gate.weight [out, in] {}\n"
        "param model.embed_tokens.weight [out, in] {}\nparam lm_head.weight [out, in] {}\n"
        "param **.weight [out, in] {\n    shard out over tp\n    style none\n}\n",
    ),
)


def _compile_tp(gen: Path) -> None:
    """specs/deepseek_v3.shard with ``TP_EDITS``, compiled to ``gen/deepseek_v3_tp.py``."""
    from tests.test_hf import shardspec

    text = (REPO / "specs" / "deepseek_v3.shard").read_text(encoding="utf-8")
    for old, new in TP_EDITS:
        assert text.count(old) == 1, f"specs/deepseek_v3.shard changed: {old!r}"
        text = text.replace(old, new)
    gen.mkdir(parents=True, exist_ok=True)
    for name in ("deepseek_v3.manifest.json", "deepseek_v3.hf.json"):
        (gen / name).write_bytes((REPO / "specs" / name).read_bytes())
    (gen / "deepseek_v3_tp.shard").write_text(text, encoding="utf-8")
    shardspec("lint", str(gen / "deepseek_v3_tp.shard"))
    shardspec("compile", str(gen / "deepseek_v3_tp.shard"), "-o", str(gen))


@pytest.fixture(scope="module")
def results(spawned: dict) -> dict:
    """CASES' and DAMAGED's part of the spawn (``spawned``): ``root`` and each rank's Items."""
    result: dict = spawned["results"]
    return result


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_fp8_load_and_export_on_4_ranks(results: dict, case: FP8Case) -> None:
    """Bitwise against the reference dequantization on every rank, no collective; the
    export gives back the FP8 checkpoint bitwise, with a config transformers reads."""
    items = [r[case.label] for r in results["ranks"]]
    fails = [f for it in items for f in it.fail]
    assert not fails, "\n".join(fails)
    assert all(it.checked > 0 for it in items)
    lead = items[0]
    assert lead.extra["export fp8 keys"] > 0
    assert lead.extra["quantization_config"]["weight_block_size"] == list(case.block)


def test_the_checkpoints_are_fp8_and_mixed(results: dict) -> None:
    """The DeepSeek checkpoint is what DeepSeek ships: FP8 linear layers with F32 scales;
    bf16 embeddings, norms, router and e_score_correction_bias."""
    state = hf_state(str(results["root"] / "ds"))
    dtypes = {k: t.dtype for k, t in state.items()}
    assert dtypes["model.layers.1.mlp.experts.3.down_proj.weight"] == torch.float8_e4m3fn
    assert dtypes["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"] == torch.float32
    assert dtypes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == torch.float8_e4m3fn
    for key in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
    ):
        assert dtypes[key] == torch.bfloat16, key
    # 128 x 128 blocks: MLA's kv_a_proj_with_mqa has 160 rows, a partial block, as the real
    # model's 576 rows have
    big = hf_state(str(results["root"] / "ds128"))
    kv = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert big[kv].shape == (160, 128) and big[kv + "_scale_inv"].shape == (2, 1)


def test_cuts_cut_blocks(results: dict) -> None:
    """The small-block cases are cut through blocks (a rank reads scale blocks it shares),
    so the boxes' arithmetic is exercised; with 128 x 128 blocks a rank reads at most
    1.05x the bytes it owns (its FP8 bytes and its share of the scales)."""
    by = {c.label: c for c in CASES}
    for label, case in by.items():
        ratios = [r[label].extra["read/owned"] for r in results["ranks"]]
        if case.block == (128, 128):
            assert max(ratios) <= 1.05, ratios
        else:
            assert max(ratios) > 1.0, (label, ratios)


def test_the_reference_differs_from_a_plain_cast(results: dict) -> None:
    """The dequantization is not the identity: the checkpoint's FP8 bytes cast to float32
    (without the scales) differ from the reference, so a load that forgot the scales
    would fail the bitwise comparison."""
    root = results["root"]
    q = hf_state(str(root / "ds"))["model.layers.0.mlp.up_proj.weight"]
    ref = hf_state(str(root / "ds_deq"))["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(q.to(torch.float32), ref)


def test_a_damaged_scale_fails_the_ranks_that_read_it(results: dict) -> None:
    """No collective: a NaN scale block fails exactly the ranks whose boxes it covers,
    each naming the scale key and the block, each with its model unchanged; the ranks
    that do not read it load (README: treat any rank's HFError as a failed load)."""
    items = [r[DAMAGED.label] for r in results["ranks"]]
    assert not [f for it in items for f in it.fail]
    raised = [it.extra["raised"] for it in items]
    failed = [r for r, e in enumerate(raised) if e is not None]
    assert failed and len(failed) < len(items), raised
    for r in failed:
        assert f"{DAMAGED.key}_scale_inv: scale nan at block [0, 0]" in raised[r]
        assert items[r].extra["unchanged"]


# ---------------------------------------------------------------- fuzz: damaged FP8 data

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu, torch.int32)
_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.uint8)


@st.composite
def _damage(draw: Any) -> dict[str, Any]:
    """Each kind of damage, or none (so that some checkpoints stay loadable)."""

    def maybe(strategy: Any) -> Any:
        return draw(st.one_of(st.none(), strategy))

    finite = st.floats(1e-30, 1e30).map(
        lambda x: int(torch.tensor([x]).view(torch.int32)[0]) & 0xFFFFFFFF
    )
    return {
        "bits": draw(st.one_of(finite, st.integers(0, 2**32 - 1))),  # one block's scale
        "block": (draw(st.integers(0, 7)), draw(st.integers(0, 7))),
        "scale_dtype": maybe(st.sampled_from(_SCALE_DTYPES)),
        "weight_dtype": maybe(st.sampled_from(_WEIGHT_DTYPES)),
        "grow": maybe(st.tuples(st.integers(-1, 1), st.integers(-1, 1))),  # the scale's shape
    }


def _apply(damage: dict) -> Any:
    def change(t: dict, wm: dict) -> None:
        s = t[SCALE].clone()
        bits = torch.tensor([damage["bits"]], dtype=torch.int64).to(torch.int32)
        s[damage["block"]] = bits.view(torch.float32)[0]
        if damage["grow"] is not None:
            rows, cols = (n + g for n, g in zip(s.shape, damage["grow"], strict=True))
            s = torch.nn.functional.pad(s, (0, 1, 0, 1))[:rows, :cols].contiguous()
        t[SCALE] = s if damage["scale_dtype"] is None else s.to(damage["scale_dtype"])
        if damage["weight_dtype"] is not None:
            t[KEY] = t[KEY].to(torch.float32).to(damage["weight_dtype"])

    return change


def test_fuzzed_fp8_tensors_load_or_refuse_cleanly(llama_fp8: Path) -> None:
    """One FP8 weight and its scale damaged at random (a scale block's bits, the scale's
    dtype and shape, the weight's dtype), 40 cases: load_hf loads exactly when the result
    is defined, and then equals the reference dequantization bitwise (through the hand
    conversion); otherwise it raises an HFError with the model unchanged; never another
    exception. Both outcomes occur."""
    seen = {"loaded": 0, "refused": 0}

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(damage=_damage())
    def one(damage: dict) -> None:
        seen[_load_damaged(llama_fp8, damage)] += 1

    one()
    assert seen["refused"] > 0 and seen["loaded"] > 0, seen


def _load_damaged(llama_fp8: Path, damage: dict) -> str:
    """``"refused"`` (an HFError, the model unchanged) or ``"loaded"`` (checked)."""
    import tempfile

    from examples.models import hf as hfm
    from examples.models import llama

    with tempfile.TemporaryDirectory() as tmp:
        folder = _damaged(llama_fp8, Path(tmp) / "ckpt", _apply(damage))
        stored = hf_state(str(folder))
        layout, hfmap, model = _layout_and_model()
        try:
            hfrt.load_hf(layout.SPEC, hfmap, model, str(folder), MESH)
        except hfrt.HFError as e:
            assert all(bool((p == 7.0).all()) for p in model.parameters()), (damage, str(e))
            return "refused"
    q, s = stored[KEY], stored[SCALE]
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32, damage
    assert s.shape == (8, 8) and bool((torch.isfinite(s) & (s > 0)).all()), damage
    deq = {}
    for k, t in stored.items():
        bq = hfmap.quant_of(k)
        if bq is not None:
            deq[k] = sc.ref_dequantize(t, stored[bq.scale_key(k)], BLOCK)
        elif not hfmap.is_scale(k):
            deq[k] = t
    want = hfm.llama_from_hf(deq, llama.LlamaConfig())
    for fqn, p in model.state_dict().items():
        assert same_bits(p, want[fqn].float()), (fqn, damage)
    return "loaded"


def test_the_reference_is_transformers_own_dequantization(results: dict) -> None:
    """The owner agrees with the test's reference: transformers' own FP8 dequantization
    (``Fp8Dequantize``, what ``from_pretrained`` runs on an FP8 checkpoint) gives the
    reference's values bitwise for every FP8 tensor of the DeepSeek checkpoint (whole 8 x 8
    blocks: transformers derives the block from the scale grid, so it reads only shapes
    that are whole blocks)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    state = hf_state(str(results["root"] / "ds"))
    deq = Fp8Dequantize(None)._dequantize_one
    checked = 0
    for key, q in state.items():
        if q.dtype != torch.float8_e4m3fn:
            continue
        s = state[key + "_scale_inv"]
        assert same_bits(deq(q, s, torch.float32), sc.ref_dequantize(q, s, (8, 8))), key
        checked += 1
    assert checked == 28


def test_the_fp8_spec_loads_deepseeks_fp8_release_end_to_end(tmp_path: Path) -> None:
    """The language and the runtime together: specs/deepseek_v3_fp8.shard (its `fp8`
    lines, compiled into generated/deepseek_v3_fp8.py) loads a checkpoint written as
    DeepSeek-V3's FP8 release is (examples/make_hf_manifests.py: FP8 projections with a
    float32 `weight_scale_inv` per 128 x 128 block, the rest BF16, the router's bias F32)
    into transformers' own model, which then equals, parameters and buffers bitwise, what
    transformers itself loads from the same checkpoint dequantized by the format's
    definition (``ref_dequantize``; transformers stacks the per-expert keys itself)."""
    from safetensors.torch import load_file, save_file

    import generated.deepseek_v3_fp8 as layout
    from examples import make_hf_manifests
    from examples.models import hf as hf_models

    folder = tmp_path / "fp8"
    folder.mkdir()
    make_hf_manifests._save("deepseek_v3_fp8", folder)
    stored = load_file(folder / "model.safetensors")
    axes = layout.SPEC.axes
    one_rank = FakeMesh(axes, (1,) * len(axes), (0,) * len(axes))
    model = hf_models.deepseek_v3_tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    report = layout.load_hf(model, str(folder), one_rank, other_dtypes=True)
    # one rank owns everything: it reads every byte once (its owned share of a partial
    # block's scale is rounded down, hence at most the scales' bytes apart)
    scales = sum(v.numel() * v.element_size() for k, v in stored.items() if "_scale_inv" in k)
    assert report.bytes_owned <= report.bytes_read <= report.bytes_owned + scales
    fp8_keys = [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    assert len(fp8_keys) > 10
    # The owner: transformers loading the same checkpoint dequantized by the format's
    # definition (its own key conversion stacks the per-expert tensors).
    deq = {
        k: sc.ref_dequantize(v, stored[f"{k}_scale_inv"], (128, 128))
        if v.dtype == torch.float8_e4m3fn
        else v.float()
        for k, v in stored.items()
        if not k.endswith("_scale_inv")
    }
    ref_dir = tmp_path / "dequantized"
    ref_dir.mkdir()
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config")
    (ref_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    save_file(deq, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    owner = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    want = owner.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert same_bits(got[key], value), key


# ---------------------------------------------------------------- DequantSlice's scale cache


def test_runs_of_one_box_share_their_scale_blocks_and_get_their_own_rows() -> None:
    """The strided runs of one box read the scale blocks they share once (kept per
    covering box), and each run is dequantized with its own blocks' rows: runs at an
    offset spanning two block rows, one inside a single block row, and a run of the same
    block rows at other columns, each bitwise the reference's part."""
    bq = BlockQuant("w", block=(4, 4))
    w = torch.randn(16, 12, generator=torch.Generator().manual_seed(3))
    q, s = sc.ref_quantize(w, bq.block)
    s = s * torch.arange(1, s.numel() + 1, dtype=torch.float32).view(s.shape)  # rows differ
    want = sc.ref_dequantize(q, s, bq.block)
    box = fp8.DequantSlice(q, s, bq, "w_scale_inv")
    runs = [
        (slice(3, 7, 1), slice(2, 11, 1)),  # block rows 0-1 at an offset
        (slice(9, 11, 1), slice(2, 11, 1)),  # block row 2 only
        (slice(2, 8, 1), slice(1, 12, 1)),  # block rows 0-1 again, other blocks' cols
        (slice(3, 7, 1), slice(3, 12, 2)),  # the first run's blocks, strided columns
    ]
    for index in runs:
        assert same_bits(box[index], want[index].contiguous()), index
    read_q = sum(q[index].numel() for index in runs)
    # scale blocks: rows 0-1 x cols 0-2, row 2 x cols 0-2, rows 0-1 x cols 0-2 (kept), and
    # rows 0-1 x cols 0-2 (the strided run's cover, kept)
    assert box.bytes_read == read_q + 4 * (6 + 3)


# ---------------------------------------------------------------- the fast dequantization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_e4m3_code_dequantizes_bitwise_into_the_models_dtype(dtype: torch.dtype) -> None:
    """DequantSlice converts e4m3fn through float16 and writes the model's dtype in one
    pass: every one of the 256 codes (subnormals, the largest, both NaNs, both zeros) times
    scales across binades, in boxes at an offset spanning chunks and block rows, stacked
    3-D and with strided columns, is bitwise ``dtype(float32(q) * scale[block])``."""
    bq = BlockQuant("w", block=(4, 4))
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(5)
    q = codes[torch.randint(0, 256, (2, 40, 24), generator=g)]
    q[0, :8, :16] = codes[:128].view(8, 16)  # every finite positive code, no NaN in the block
    s = torch.exp2(torch.randint(-140, 110, (2, 10, 6), generator=g).float()) * (
        1 + torch.rand(2, 10, 6, generator=g)
    )
    want = sc.ref_dequantize(q, s, bq.block).to(dtype)
    old = fp8.CHUNK_ELEMENTS
    try:
        fp8.CHUNK_ELEMENTS = 40  # chunks of a few rows, inside and across block rows
        box = fp8.DequantSlice(q, s, bq, "w_scale_inv", dtype)
        for index in [
            (slice(0, 2, 1), slice(0, 40, 1), slice(0, 24, 1)),
            (slice(1, 2, 1), slice(3, 37, 1), slice(5, 23, 1)),
            (slice(0, 2, 1), slice(6, 9, 1), slice(1, 24, 3)),
        ]:
            got = box[index]
            assert got.dtype == dtype
            assert same_bits(got, want[index].contiguous()), index
    finally:
        fp8.CHUNK_ELEMENTS = old


# ------------------------------------------- the conversion's other paths, a tp box into its slot


@pytest.mark.parametrize(
    ("fp8_dtype", "big"),
    [("float8_e4m3fn", True), ("float8_e5m2", False), ("float8_e5m2", True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_dequantizes_bitwise_through_the_code_table(
    fp8_dtype: str, big: bool, dtype: torch.dtype
) -> None:
    """The paths the float16 shortcut leaves to :func:`fp8.fp8_table` (torch's own cast of
    each code): e5m2 data, and e4m3fn blocks whose scales are too large for the 2**8 shift
    (``big``: up to 2**126); every one of the 256 codes, rows and columns not multiples of
    the block, chunks across block rows, bitwise ``dtype(float32(q) * scale[block])``."""
    bq = BlockQuant("w", block=(4, 4), dtype=fp8_dtype)
    codes = torch.arange(256, dtype=torch.uint8).view(fp8.FP8_TORCH[fp8_dtype])
    g = torch.Generator().manual_seed(11)
    q = codes[torch.randint(0, 256, (37, 29), generator=g)]
    q[:16, :16] = codes.view(16, 16)
    low, high = (100, 127) if big else (-120, 100)
    s = torch.exp2(torch.randint(low, high, (10, 8), generator=g).float())
    s = s * (1 + torch.rand(10, 8, generator=g))
    want = sc.ref_dequantize(q, s, bq.block).to(dtype)
    old = fp8.CHUNK_ELEMENTS
    try:
        fp8.CHUNK_ELEMENTS = 150  # five rows a chunk: chunks cut block rows
        box = fp8.DequantSlice(q, s, bq, "w_scale_inv", dtype)
        for index in [(slice(0, 37, 1), slice(0, 29, 1)), (slice(3, 35, 1), slice(2, 27, 2))]:
            assert same_bits(box[index], want[index].contiguous()), index
    finally:
        fp8.CHUNK_ELEMENTS = old


def test_a_tp_box_that_cuts_blocks_reads_into_its_slot() -> None:
    """A tp rank's box of a 128 x 128-block weight whose sizes are not multiples of 128:
    rows 100..290 and columns 70..261 of a 333 x 301 matrix (cutting blocks on every side),
    read into its slot of a stacked buffer (``into``, no copy: the result is the slot),
    bitwise the reference; and a slot of the wrong shape is not written."""
    bq = BlockQuant("w")
    w = torch.randn(333, 301, generator=torch.Generator().manual_seed(7))
    q, s = sc.ref_quantize(w, bq.block)
    want = sc.ref_dequantize(q, s, bq.block).to(torch.bfloat16)
    index = (slice(100, 290, 1), slice(70, 261, 1))
    stack = torch.full((2, 190, 191), float("nan"), dtype=torch.bfloat16)
    box = fp8.DequantSlice(q, s, bq, "w_scale_inv", torch.bfloat16)
    slot = stack[1]
    box.into = slot
    got = box[index]
    assert got is slot
    assert same_bits(stack[1], want[index].contiguous())
    assert bool(stack[0].isnan().all())
    # bytes: the box's FP8 bytes and the 3 x 3 scale blocks covering it (rows 0-2, cols 0-2)
    assert box.bytes_read == 190 * 191 + 4 * 3 * 3
    box.into = stack[0][:, :100]  # another shape: a fresh tensor, the slot untouched
    assert box[index] is not stack[0] and bool(stack[0].isnan().all())
    assert box.into is None
