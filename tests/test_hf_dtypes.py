"""load_hf checks each file's dtype: against the dtype the spec's HF manifest recorded for
the map line (carried into the generated module, one tuple per line), and, with or
without an HF manifest, that integer or bool data never fills a floating parameter.

The relabelled checkpoints are transformers' own GptOss files with one header's dtype
field rewritten and the bytes left as they are: F32 bytes called I32 (issue 20: loaded
silently cast to float before), and BF16 bytes called F16 (a float that is no other
float's bit pattern either)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from shardspec.testing import run_ranks
from tests import hf_dtype_scenarios
from tests.test_hf_grouped import checkpoint, variant
from tests.test_hf_split import shardspec

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
NORM = "model.norm.weight"


def relabel(folder: Path, key: str, dtype: str) -> None:
    """Rewrite the safetensors header's dtype of ``key`` in ``folder``'s single file, the
    header padded with spaces to its old length, the tensor bytes untouched."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header[key]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text.ljust(n) + data[8 + n :])
    with open(path, "rb") as f:  # the bytes after the header are the old ones
        f.seek(8 + n)
        assert f.read() == data[8 + n :]


def _copy(root: Path, src: str, dst: str) -> Path:
    shutil.copytree(root / src, root / dst)
    return root / dst


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hf_dtypes")
    model = checkpoint(root, "f32", 7)
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    relabel(_copy(root, "f32", "f32_as_i32"), NORM, "I32")
    relabel(_copy(root, "bf16", "bf16_as_f16"), NORM, "F16")
    # The example spec with the bf16 checkpoint's HF manifest, and with none (SS079).
    gen = root / "gen"
    shardspec("hf-manifest", str(root / "bf16"), "-o", str(gen / "bf16.hf.json"))
    variant(gen, "gpt_oss_bf16", [('hf "gpt_oss.hf.json"', 'hf "bf16.hf.json"')])
    variant(gen, "gpt_oss_none", [('hf "gpt_oss.hf.json" {', "hf {")])
    cases = [
        ("f32", "generated.gpt_oss", "f32", "f32", {}),
        ("i32", "generated.gpt_oss", "f32_as_i32", None, {}),
        ("i32 other_dtypes", "generated.gpt_oss", "f32_as_i32", None, {"other_dtypes": True}),
        ("bf16", "generated.gpt_oss", "bf16", None, {}),
        ("bf16 other_dtypes", "generated.gpt_oss", "bf16", "bf16", {"other_dtypes": True}),
        ("bf16 manifest", "gpt_oss_bf16", "bf16", "bf16", {}),
        ("f16 relabelled", "gpt_oss_bf16", "bf16_as_f16", None, {}),
        ("none i32", "gpt_oss_none", "f32_as_i32", None, {}),
        ("none bf16", "gpt_oss_none", "bf16", "bf16", {}),
    ]
    (out,) = run_ranks(hf_dtype_scenarios.run_all, 1, str(root), cases, FUZZ, timeout=600)
    return out


def _line(name: str) -> int:
    text = (REPO / "specs" / "gpt_oss.shard").read_text(encoding="utf-8").splitlines()
    return next(n for n, t in enumerate(text, 1) if t.startswith(f"    {name} ->"))


def _refused(results: dict, label: str, *needles: str) -> None:
    got = results[label]
    assert "raised" not in got, got.get("raised")
    assert got["error"] is not None, f"{label}: loaded"
    for needle in needles:
        assert needle in got["error"], got["error"]
    assert got["unchanged"] is True


def _loaded(results: dict, label: str) -> None:
    got = results[label]
    assert "raised" not in got, got.get("raised")
    assert got["error"] is None, got["error"]
    assert got["differ"] == [], got["differ"]


def test_files_as_the_hf_manifest_says_load(results: dict) -> None:
    _loaded(results, "f32")
    _loaded(results, "bf16 manifest")  # BF16 files, BF16 manifest, into fp32: the normal cast


def test_integer_bytes_never_fill_a_float_parameter(results: dict) -> None:
    """F32 bytes relabelled I32: refused with the HF manifest, with other_dtypes, and
    without an HF manifest, the model left as it was."""
    for label in ("i32", "i32 other_dtypes", "none i32"):
        _refused(
            results,
            label,
            f"{NORM}: the file stores I32 (int values) for a float32 tensor",
            "never casts between integer, bool and floating data",
        )
    assert "(1 problem)" in results["i32"]["error"]  # the one relabelled key, nothing else


def test_another_float_dtype_than_the_manifest_s_is_declared(results: dict) -> None:
    """A bf16 copy of the fp32 checkpoint the HF manifest describes: refused unless
    other_dtypes says so (then cast, as transformers casts it); BF16 bytes called F16 are
    refused by the bf16 HF manifest."""
    emb = "model.embed_tokens.weight"
    _refused(
        results,
        "bf16",
        f"{emb}: the file stores BF16, the spec's HF manifest says F32 (line {_line(emb)})",
        "(37 problems)",  # every key
        "pass other_dtypes=True",
    )
    assert results["bf16"]["error"].count("other_dtypes") == 1  # the hint, once
    _loaded(results, "bf16 other_dtypes")
    _refused(
        results,
        "f16 relabelled",
        f"{NORM}: the file stores F16, the spec's HF manifest says BF16",
        "(1 problem)",
    )
    _loaded(results, "none bf16")  # no HF manifest: float to float is the normal cast


FUZZ = 40  # relabelled headers loaded in the fuzz test


def test_fuzzed_header_dtypes_load_or_refuse_cleanly(results: dict) -> None:
    """A random key's header dtype set to any safetensors dtype or to a string that is
    none, the bytes left: load_hf loads only the unchanged label and otherwise raises an
    HFError with the model as it was (no other exception, no silent cast)."""
    fuzz = results["fuzz"]
    assert fuzz["bad"] == [], "\n".join(fuzz["bad"])
    assert fuzz["loaded"] + fuzz["refused"] == FUZZ and fuzz["refused"] > FUZZ // 2, fuzz


def test_the_generated_module_carries_one_dtype_tuple_per_line() -> None:
    import generated.gpt_oss as mod

    assert {r.dtypes for r in mod.HF.rules} == {("F32",)}
    text = (REPO / "generated" / "gpt_oss.py").read_text(encoding="utf-8")
    assert text.count('dtypes=("F32",)') == len(mod.HF.rules)


def test_each_map_line_records_its_keys_dtypes() -> None:
    """with_dtypes: the sorted dtypes of the keys a line reads (two for a line whose keys
    differ), a tie alias absent from the checkpoint its source's, none for a line that
    reads no key of the HF manifest."""
    from shardspec.core.hfmap import HFMap, MapRule
    from shardspec.inputs.hfmanifest import HFManifest, HFTensor
    from shardspec.resolve.hf import with_dtypes

    def t(dtype: str) -> HFTensor:
        return HFTensor(shape=(2,), dtype=dtype, file="model.safetensors")

    tensors = {"emb": t("BF16"), "l.0.w": t("F32"), "l.1.w": t("BF16"), "pos": t("I64")}
    hfm = HFManifest("hf.json", {}, tensors)
    m = HFMap(
        (
            MapRule("emb", "embed"),
            MapRule("head", "out"),  # a tie alias the checkpoint lacks
            MapRule("l.{i}.w", "layers.{i}.w"),
            MapRule("pos", "position_ids"),
            MapRule("gone", "x"),
        ),
        ties=(("head", "emb"),),
    )
    got = [r.dtypes for r in with_dtypes(m, hfm).rules]
    assert got == [("BF16",), ("BF16",), ("BF16", "F32"), ("I64",), ()]
    assert with_dtypes(m, None) is m


def test_dtype_problems_both_ways_and_per_line() -> None:
    """Floats into an integer or bool buffer are refused like integers into a float;
    another float than the line's HF manifest dtype only without other_dtypes; a line
    without recorded dtypes (no HF manifest) checks kinds only."""
    from shardspec.core.hfmap import MapRule
    from shardspec.runtime.hf.load import _dtype_problem

    line = MapRule("a", "b", line=9, dtypes=("F32",))
    bare = MapRule("a", "b")
    for got, dtype in [("F32", torch.int64), ("BF16", torch.bool), ("I64", torch.float32)]:
        for rule in (line, bare):
            for other in (False, True):
                found = _dtype_problem(got, dtype, rule, other)
                assert found is not None and "never casts between" in found[1]
    found = _dtype_problem("BF16", torch.float32, line, False)
    assert found is not None and found[0].endswith("HF manifest says F32 (line 9)")
    assert _dtype_problem("BF16", torch.float32, line, True) is None
    assert _dtype_problem("BF16", torch.float32, bare, False) is None
    assert _dtype_problem("F32", torch.bfloat16, line, False) is None  # the model's cast
    assert _dtype_problem("I32", torch.int64, MapRule("a", "b", dtypes=("I32",)), False) is None
