"""The hf block's ``fp8`` lines (issue 22, the compiler's side): the syntax and its errors,
the declaration they resolve to, the generated module's table, HF manifests of FP8
checkpoints, and the lint of a DeepSeek-format mixed checkpoint (FP8 linear layers, BF16
embeddings, norms and router, F32 e_score_correction_bias). The per-code cases are in
tests/checks/SS110.py-SS114.py."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from shardspec import cli
from shardspec.core.hfmap import BlockQuant
from shardspec.frontend.parse import parse
from shardspec.inputs.hfmanifest import load_hf_manifest
from shardspec.inputs.manifest import dump_manifest
from shardspec.resolve.hf import block_quant, build_hfmap

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "specs" / "deepseek_v3_fp8.shard"


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def _lint(spec: Path) -> tuple[int, list[dict[str, Any]]]:
    rc, stdout, _ = _cli(["lint", "--format", "json", str(spec)])
    return rc, json.loads(stdout) if stdout.strip() else []


def _quants(text: str) -> tuple[BlockQuant, ...]:
    for fast in (True, False):
        spec, diags = parse(text, "s.shard", fast=fast)
        assert spec is not None and spec.hf is not None and not diags, diags
    return build_hfmap(spec.hf).quants


# ------------------------------------------------------------------------- the language


def test_an_fp8_line_with_its_defaults() -> None:
    (q,) = _quants("hf {\n    fp8 model.layers.*.mlp.*_proj.weight\n}\n")
    assert q == BlockQuant("model.layers.*.mlp.*_proj.weight", line=2)
    assert (q.scale, q.block, q.scale_format, q.dtype) == (
        "{key}_scale_inv",
        (128, 128),
        "float32",
        "float8_e4m3fn",
    )


def test_every_option_in_any_order() -> None:
    text = (
        "hf {\n"
        "    fp8 a.*.weight e5m2 ue8m0 block 64 x 32 scale {key}.scale\n"
        "    fp8 b.**   scale {key}_s  block 16x8 float32 e4m3\n"
        "    model.norm.weight -> norm.weight\n"
        "}\n"
    )
    a, b = _quants(text)
    assert a == BlockQuant("a.*.weight", "{key}.scale", (64, 32), "ue8m0", "float8_e5m2", 2)
    assert b == BlockQuant("b.**", "{key}_s", (16, 8), "float32", "float8_e4m3fn", 3)
    assert a.scale_key("a.0.weight") == "a.0.weight.scale"
    assert a.scale_shape((3, 130, 33)) == (3, 3, 2)  # per expert, ceil on both


def test_an_option_given_twice_resolves_to_its_first() -> None:
    spec, _ = parse("hf {\n    fp8 a.w e5m2 e4m3 block 1 x 2 block 3 x 4\n}\n", "s.shard")
    assert spec is not None and spec.hf is not None
    q = block_quant(spec.hf.fp8[0])
    assert (q.dtype, q.block) == ("float8_e5m2", (1, 2))  # (and SS110 reports the repeats)


def test_the_words_stay_names_elsewhere() -> None:
    """`fp8`, `scale`, `block`, `x` and the format words are keywords only inside an fp8
    line: HF keys, parameters, dimensions and axes may still be named so."""
    text = (
        "mesh over 4 ranks { x: 2  scale: * }\n"
        "param fp8.block.x [x, block] { shard x over scale }\n"
        "param e4m3 [scale, ue8m0] { shard ue8m0 over x }\n"
        "hf {\n"
        "    scale.weight -> fp8.block.x\n"
        "    fp8.weight -> e4m3\n"
        "    fp8 scale.** block 1 x 2 e5m2\n"
        "    x.y -> fp8\n"
        "}\n"
    )
    (q,) = _quants(text)
    assert q.glob == "scale.**" and q.block == (1, 2)
    spec, _ = parse(text, "s.shard")
    assert spec is not None and spec.hf is not None
    assert [m.hf.text for m in spec.hf.maps] == ["scale.weight", "fp8.weight", "x.y"]


SYNTAX = [
    ("fp8 a.weight scale\n", 3, "write `scale {key}_scale_inv`, without quotes"),
    ('fp8 a.weight scale "{key}_scale_inv"\n', 2, "write `scale {key}_scale_inv`, without quotes"),
    ("fp8 a.weight block 128\n", 3, "write the block size as `block R x C`"),
    ("fp8 a.weight block 128 128\n", 2, "write the block size as `block R x C`"),
    ("fp8 a.weight block 128, 128\n", 2, "write the block size as `block R x C`"),
    ("fp8 a.weight block 128 by 128\n", 2, "write the block size as `block R x C`"),
    ("fp8\n", 3, "write `fp8 GLOB`, the HF keys stored in FP8"),
    (
        "fp8 a.weight e4m3fn\n    model.norm.weight -> norm.weight\n",
        3,
        "`e4m3fn` is no option of an fp8 line: did you mean `e4m3`?",
    ),
    (
        "fp8 a.weight ue8m0 float8_e5m2\n",
        3,
        "`float8_e5m2` is no option of an fp8 line: did you mean `e5m2`?",
    ),
    ("fp8 a.weight scales {key}_s\n", 2, "`scales` is no option of an fp8 line: did you mean"),
    ("fp8s a.weight\n", 2, "did you mean `fp8`?"),
    # (issue 22's leftovers: a block size cut short, or without `block`)
    ("fp8 a.weight block 128 x\n", 3, "write the block size as `block R x C`"),
    ("fp8 a.weight block x 128\n", 2, "write the block size as `block R x C`"),
    ("fp8 a.weight x\n", 3, "the block size follows `block`: `block R x C`"),
    ("fp8 a.weight 128 x 128\n", 2, "the block size follows `block`: `block R x C`"),
    ("fp8 a.weight bf16\n", 3, "`bf16` is no option of an fp8 line: did you mean `bfloat16`?"),
]


@pytest.mark.parametrize(("line", "where", "hint"), SYNTAX, ids=[s[0] for s in SYNTAX])
def test_spelling_errors_are_located_with_a_hint(line: str, where: int, hint: str) -> None:
    text = "hf {\n    " + line + "}\n"
    for fast in (True, False):
        spec, diags = parse(text, "s.shard", fast=fast)
        assert spec is None and [d.code for d in diags] == ["SS001"]
        assert diags[0].span.line == where and hint in diags[0].hint, diags[0]


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("fp8 a.weight\n", "`fp8` goes inside an `hf { ... }` block"),
        ("param a [x] {\n    fp8 a\n}\n", "`fp8` goes inside an `hf { ... }` block"),
    ],
)
def test_an_fp8_line_outside_an_hf_block(text: str, hint: str) -> None:
    spec, diags = parse(text, "s.shard")
    assert spec is None and hint in diags[0].hint


# -------------------------------------------------------------- the generated module


def test_the_generated_module_holds_the_declarations() -> None:
    """generated/deepseek_v3_fp8.py's table is the spec's fp8 lines, and it imports
    BlockQuant from the runtime (the generated module imports nothing else of shardspec)."""
    mod = importlib.import_module("generated.deepseek_v3_fp8")
    spec, _ = parse(SPEC.read_text(encoding="utf-8"), str(SPEC))
    assert spec is not None and spec.hf is not None
    assert mod.HF.quants == build_hfmap(spec.hf).quants and len(mod.HF.quants) == 5
    text = (REPO / "generated" / "deepseek_v3_fp8.py").read_text(encoding="utf-8")
    assert "    BlockQuant,\n" in text and "from shardspec.core" not in text


def test_a_module_without_fp8_lines_is_unchanged() -> None:
    text = (REPO / "generated" / "deepseek_v3.py").read_text(encoding="utf-8")
    assert "BlockQuant" not in text and "quants=" not in text


# ------------------------------------------- the DeepSeek-format mixed checkpoint


def test_the_deepseek_v3_fp8_spec_lints_clean() -> None:
    assert _lint(SPEC) == (0, [])


def test_the_mixed_checkpoint_is_declared_as_deepseek_ships_it() -> None:
    """Point 5's lint side: the fp8 lines cover exactly the F8_E4M3 tensors (every
    attention and MLP projection, the experts' included), each scale is consumed, and
    the embeddings, norms, router and e_score_correction_bias (BF16/F32) are not FP8."""
    hfm = load_hf_manifest(REPO / "specs" / "deepseek_v3_fp8.hf.json")
    spec, _ = parse(SPEC.read_text(encoding="utf-8"), str(SPEC))
    assert spec is not None and spec.hf is not None
    hfmap = build_hfmap(spec.hf)
    fp8 = {k for k, t in hfm.tensors.items() if t.dtype == "F8_E4M3"}
    assert {k for k in hfm.tensors if hfmap.quant_of(k) and not hfmap.is_scale(k)} == fp8
    assert {k for k in hfm.tensors if hfmap.is_scale(k)} == {f"{k}_scale_inv" for k in fp8}
    rest = {k: t.dtype for k, t in hfm.tensors.items() if k not in fp8 and "_scale_inv" not in k}
    assert set(rest.values()) == {"BF16", "F32"}
    assert {k for k, d in rest.items() if d == "F32"} == {
        "model.layers.1.mlp.gate.e_score_correction_bias"
    }
    for kind in ("embed_tokens", "lm_head", "layernorm", "mlp.gate.weight", "model.norm"):
        assert any(kind in k for k in rest), kind
    for kind in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj", "experts.3.down_proj", "shared"):
        assert any(kind in k for k in fp8), kind
    assert hfm.config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }


def test_a_glob_over_the_whole_layers_covers_bf16_norms(tmp_path: Path) -> None:
    """The mistake SS113 exists for: one glob for every layer weight."""
    text = SPEC.read_text(encoding="utf-8")
    start = text.index("    fp8 model.layers.*.self_attn.*_proj.weight")
    end = text.index("\n", text.index("fp8 model.layers.*.mlp.experts"))
    spec = tmp_path / "s.shard"
    spec.write_text(text[:start] + "    fp8 model.layers.**.weight" + text[end:], encoding="utf-8")
    for name in ("deepseek_v3.manifest.json", "deepseek_v3_fp8.hf.json"):
        (tmp_path / name).write_text((REPO / "specs" / name).read_text(encoding="utf-8"))
    rc, found = _lint(spec)
    assert rc == 1 and {f["code"] for f in found} == {"SS113"}, found
    (f,) = found
    assert "is BF16 in the HF manifest" in f["message"] and "layernorm" in f["message"]


# ------------------------------------------------------ HF manifests of FP8 checkpoints


def _fp8_folder(root: Path, keys: list[str], scale_dtype: str = "float32") -> Path:
    """A Hugging Face folder with FP8 weights [4, 256] (2 blocks of 128 columns), their
    scales, and a BF16 norm: real safetensors bytes, written by safetensors."""
    import torch
    from safetensors.torch import save_file

    root.mkdir()
    tensors: dict[str, torch.Tensor] = {"model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}
    for k in keys:
        tensors[k] = torch.randn(4, 256).to(torch.float8_e4m3fn)
        tensors[f"{k}_scale_inv"] = torch.ones(1, 2, dtype=getattr(torch, scale_dtype))
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (root / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


FP8_SPEC = """\
manifest "m.json"
mesh over 2 ranks { tp: 2 }
param layers.*.w [out, in] { shard out over tp }
param norm.weight [dim] {}
hf "hf.json" {
    model.layers.{i}.w.weight -> layers.{i}.w
    model.norm.weight -> norm.weight
    fp8 model.layers.*.w.weight
}
"""
KEYS = ["model.layers.0.w.weight", "model.layers.1.w.weight"]


def _write_model(tmp_path: Path, dtype: str = "float32") -> None:
    entries = [
        {"fqn": f"layers.{i}.w", "kind": "param", "shape": [4, 256], "dtype": dtype}
        for i in range(2)
    ]
    entries.append({"fqn": "norm.weight", "kind": "param", "shape": [4], "dtype": "float32"})
    (tmp_path / "m.json").write_text(dump_manifest(entries, "tests:model"), encoding="utf-8")
    (tmp_path / "s.shard").write_text(FP8_SPEC, encoding="utf-8")


def test_hf_manifest_of_an_fp8_folder_and_its_lint(tmp_path: Path) -> None:
    folder = _fp8_folder(tmp_path / "ckpt", KEYS)
    rc, _, err = _cli(["hf-manifest", str(folder), "-o", str(tmp_path / "hf.json")])
    assert rc == 0, err
    hfm = load_hf_manifest(tmp_path / "hf.json")
    assert hfm.tensors[KEYS[0]].dtype == "F8_E4M3" and hfm.tensors[KEYS[0]].shape == (4, 256)
    assert hfm.tensors[f"{KEYS[0]}_scale_inv"].dtype == "F32"
    assert hfm.tensors[f"{KEYS[0]}_scale_inv"].shape == (1, 2)
    assert hfm.tensors["model.norm.weight"].dtype == "BF16"
    _write_model(tmp_path)
    assert _lint(tmp_path / "s.shard") == (0, [])


def test_an_fp8_checkpoint_with_bf16_scales_needs_bfloat16(tmp_path: Path) -> None:
    folder = _fp8_folder(tmp_path / "ckpt", KEYS, scale_dtype="bfloat16")
    assert _cli(["hf-manifest", str(folder), "-o", str(tmp_path / "hf.json")])[0] == 0
    _write_model(tmp_path)
    rc, found = _lint(tmp_path / "s.shard")
    assert rc == 1 and [f["code"] for f in found] == ["SS112"]
    assert "is BF16; line 8's float32 scales are F32" in found[0]["message"]
    assert "write `bfloat16` on the fp8 line for BF16 scales" in found[0]["hint"]
    spec = tmp_path / "s.shard"
    spec.write_text(FP8_SPEC.replace("w.weight\n}", "w.weight bfloat16\n}"), encoding="utf-8")
    assert _lint(spec) == (0, [])


def test_an_fp8_key_into_an_integer_parameter(tmp_path: Path) -> None:
    """FP8 dequantizes to floats: a map line that loads it into an integer parameter is
    SS084 (the dtype-kind check covers FP8 dtypes as floats)."""
    folder = _fp8_folder(tmp_path / "ckpt", KEYS)
    assert _cli(["hf-manifest", str(folder), "-o", str(tmp_path / "hf.json")])[0] == 0
    _write_model(tmp_path, dtype="int64")
    rc, found = _lint(tmp_path / "s.shard")
    assert rc == 1 and [f["code"] for f in found] == ["SS084"]
    assert "is F8_E4M3 (float values)" in found[0]["message"]
    assert "into a int64 parameter" in found[0]["message"]


def test_undeclared_fp8_keys_are_grouped_and_capped(tmp_path: Path) -> None:
    """SS111 reports one finding per name shape, the first 20, then one for the rest."""
    from shardspec.checks.hf import MAX_GROUPS

    names = [f"model.{chr(97 + j)}x.weight" for j in range(MAX_GROUPS + 3)]  # 23 shapes
    folder = _fp8_folder(tmp_path / "ckpt", KEYS + names)
    assert _cli(["hf-manifest", str(folder), "-o", str(tmp_path / "hf.json")])[0] == 0
    _write_model(tmp_path)
    spec = tmp_path / "s.shard"
    spec.write_text(FP8_SPEC.removesuffix("}\n") + "    drop model.*x.weight_scale_inv\n}\n")
    rc, found = _lint(spec)
    undeclared = [f for f in found if f["code"] == "SS111"]
    assert {f["code"] for f in found} == {"SS111", "SS073"}, found  # (the weights: unmapped)
    assert len(undeclared) == MAX_GROUPS + 1 and rc == 1
    assert undeclared[-1]["message"].startswith("3 more FP8 HF keys no fp8 line declares")


def test_a_declaration_prints_as_the_line_that_makes_it() -> None:
    from shardspec.core.hfmap import BlockQuant

    q = BlockQuant("model.layers.*.**.weight", block=(64, 32), scale_format="ue8m0")
    assert str(q) == "fp8 model.layers.*.**.weight scale {key}_scale_inv block 64 x 32 ue8m0"
    e5m2 = BlockQuant("w.*", dtype="float8_e5m2")
    assert str(e5m2) == "fp8 w.* scale {key}_scale_inv block 128 x 128 e5m2"


# ------------------------------------------- issue 22's leftovers: scale dtypes, is_scale


def test_the_scale_dtype_words() -> None:
    """``bfloat16`` and ``float16`` say the scale's dtype (Qwen3's FP8 releases store BF16
    scales), beside ``float32`` and ``ue8m0``; one scale format per line (SS110)."""
    text = (
        "hf {\n"
        "    fp8 a.* bfloat16\n"
        "    fp8 b.* float16 e5m2\n"
        "    fp8 c.* float32\n"
        "    fp8 d.* ue8m0\n"
        "}\n"
    )
    a, b, c, d = _quants(text)
    assert [q.scale_format for q in (a, b, c, d)] == ["bfloat16", "float16", "float32", "ue8m0"]
    assert [q.scale_dtypes for q in (a, b, c, d)] == [
        ("BF16",),
        ("F16",),
        ("F32",),
        ("F32", "F8_E8M0"),
    ]
    assert str(a) == "fp8 a.* scale {key}_scale_inv block 128 x 128 bfloat16"
    assert str(c) == "fp8 c.* scale {key}_scale_inv block 128 x 128"
    spec, diags = parse("hf {\n    fp8 a.* bfloat16 float32\n}\n", "s.shard")
    assert spec is not None and not diags
    from shardspec.checks.fp8 import check_fp8_items

    (found,) = check_fp8_items(spec)
    assert found.code == "SS110" and "the scale format" in found.message


def test_is_scale_is_the_scale_of_the_line_that_declares_the_weight() -> None:
    """A weight that an earlier line declares has that line's scale key: a later line's
    template does not make another key of it a scale (which load would then skip)."""
    from shardspec.core.hfmap import HFMap

    hfmap = HFMap(
        quants=(
            BlockQuant("m.*.w", scale="{key}_scale_inv"),
            BlockQuant("m.**", scale="{key}.scale"),
        )
    )
    assert hfmap.is_scale("m.0.w_scale_inv")
    assert not hfmap.is_scale("m.0.w.scale")  # line 1 declares m.0.w: its scale is _scale_inv
    assert hfmap.is_scale("m.a.b.scale")  # m.a.b is line 2's
    assert not hfmap.is_scale("m.a.b_scale_inv")


def test_one_lint_computes_the_stray_scales_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 checks (SS112) and the unexpected-key check (SS073) both need the HF
    manifest's stray scales: one lint of DeepSeek-V3's FP8 spec computes them once, and a
    second lint (another parse: other objects) once more; the findings are unchanged."""
    from shardspec.checks.run import check
    from shardspec.resolve import hf as resolve_hf

    def lint() -> list[str]:
        spec, _ = parse(SPEC.read_text(encoding="utf-8"), str(SPEC))
        assert spec is not None
        _, diags = check(spec)
        return [f"{d.code} {d.message}" for d in diags]

    before = lint()
    calls: list[int] = []
    real = resolve_hf.stray_scales

    def counted(*args: Any) -> dict[str, str]:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(resolve_hf, "stray_scales", counted)
    assert lint() == before
    assert len(calls) == 1
    assert lint() == before
    assert len(calls) == 2
