"""HF manifests: the committed example files are what examples/make_hf_manifests.py
builds, and ``shardspec hf-manifest`` reads real and broken Hugging Face directories."""

from __future__ import annotations

import contextlib
import io
import json
import struct
from pathlib import Path

import pytest

from shardspec import cli
from shardspec.inputs.hfmanifest import (
    FORMAT,
    HFManifestError,
    build_hf_manifest,
    load_hf_manifest,
    read_safetensors_header,
)

REPO = Path(__file__).resolve().parents[1]


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_committed_hf_manifests_are_fresh(tmp_path: Path) -> None:
    """Rebuilding the four example HF manifests gives the committed bytes."""
    from examples import make_hf_manifests

    written = make_hf_manifests.build(tmp_path)
    assert sorted(p.name for p in written) == sorted(make_hf_manifests.MANIFESTS)
    for path in written:
        committed = REPO / "specs" / path.name
        assert path.read_text(encoding="utf-8") == committed.read_text(encoding="utf-8"), (
            f"{committed} is stale: run `python examples/make_hf_manifests.py`"
        )
    llama = load_hf_manifest(REPO / "specs" / "llama.hf.json")
    assert llama.config["hidden_size"] == 64 and "transformers_version" not in llama.config
    assert llama.tensors["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    moe = load_hf_manifest(REPO / "specs" / "deepseek_moe.hf.json")
    assert moe.tensors["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert llama.position("lm_head.weight") == (4, 5)


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = 4
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * offset)


def _hf_dir(root: Path, sharded: bool = False) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"hidden_size": 4}', encoding="utf-8")
    if sharded:
        _safetensors(root / "a.safetensors", {"x.weight": ("F32", [2, 4])})
        _safetensors(root / "b.safetensors", {"y.weight": ("BF16", [4])})
        index = {"weight_map": {"x.weight": "a.safetensors", "y.weight": "b.safetensors"}}
        (root / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    else:
        _safetensors(root / "model.safetensors", {"x.weight": ("F32", [2, 4])})
    return root


def test_header_reader_agrees_with_safetensors(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    path = tmp_path / "t.safetensors"
    save_file({"a": np.zeros((3, 5), np.float32), "b.c": np.zeros((2,), np.int64)}, str(path))
    assert read_safetensors_header(path) == {
        "a": {"dtype": "F32", "shape": [3, 5]},
        "b.c": {"dtype": "I64", "shape": [2]},
    }


def test_hf_manifest_of_single_and_sharded_directories(tmp_path: Path) -> None:
    single = build_hf_manifest(_hf_dir(tmp_path / "single"))
    assert single == {
        "format": FORMAT,
        "config": {"hidden_size": 4},
        "tensors": {"x.weight": {"dtype": "F32", "shape": [2, 4], "file": "model.safetensors"}},
    }
    out = tmp_path / "sharded.json"
    rc, stdout, _ = _cli(["hf-manifest", str(_hf_dir(tmp_path / "sharded", True)), "-o", str(out)])
    assert rc == 0 and "(2 tensors)" in stdout
    loaded = load_hf_manifest(out)
    assert loaded.tensors["y.weight"].file == "b.safetensors"
    assert loaded.tensors["y.weight"].dtype == "BF16"
    rc, stdout, _ = _cli(["hf-manifest", str(tmp_path / "single")])
    assert rc == 0 and json.loads(stdout)["tensors"]["x.weight"]["shape"] == [2, 4]


def _broken(tmp_path: Path, how: str) -> Path:
    root = _hf_dir(tmp_path / how, sharded=True)
    index = root / "model.safetensors.index.json"
    if how == "no_config":
        (root / "config.json").unlink()
    elif how == "bad_config":
        (root / "config.json").write_text("{", encoding="utf-8")
    elif how == "absolute":
        index.write_text('{"weight_map": {"x.weight": "/etc/passwd"}}', encoding="utf-8")
    elif how == "escapes":
        index.write_text('{"weight_map": {"x.weight": "../a.safetensors"}}', encoding="utf-8")
    elif how == "bad_header":
        (root / "a.safetensors").write_bytes(struct.pack("<Q", 3) + b"{x}")
    elif how == "short_file":
        (root / "a.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    elif how == "missing_shard":
        (root / "b.safetensors").unlink()
    elif how == "key_not_in_header":
        index.write_text('{"weight_map": {"z.weight": "a.safetensors"}}', encoding="utf-8")
    elif how == "no_weights":
        index.unlink()
    return root


@pytest.mark.parametrize(
    ("how", "code", "message"),
    [
        ("no_config", "SS002", "cannot read config.json"),
        ("bad_config", "SS003", "config.json is not valid JSON"),
        ("absolute", "SS003", "is an absolute path"),
        ("escapes", "SS003", "escapes the directory"),
        ("bad_header", "SS003", "header is not valid JSON"),
        ("short_file", "SS003", "runs past the end of the file"),
        ("missing_shard", "SS002", "cannot read"),
        ("key_not_in_header", "SS003", "whose header lacks it"),
        ("no_weights", "SS002", "neither model.safetensors.index.json nor model.safetensors"),
    ],
)
def test_bad_hf_directories_are_findings(tmp_path: Path, how: str, code: str, message: str) -> None:
    root = _broken(tmp_path, how)
    with pytest.raises(HFManifestError) as info:
        build_hf_manifest(root)
    assert info.value.code == code and message in str(info.value)
    out = tmp_path / "out.json"
    rc, _, stderr = _cli(["hf-manifest", str(root), "-o", str(out)])
    assert rc == 2 and "Traceback" not in stderr
    assert f"error {code} [" in stderr and message in stderr and "hint:" in stderr
    assert not out.exists()


def test_missing_directory_is_ss002(tmp_path: Path) -> None:
    rc, _, stderr = _cli(["hf-manifest", str(tmp_path / "nope")])
    assert rc == 2 and "error SS002 [unreadable-input]" in stderr and "is not a directory" in stderr


@pytest.mark.parametrize("size", [True, 4.0, "4"])
def test_hf_manifest_sizes_are_json_integers(tmp_path: Path, size: object) -> None:
    """A size that is a bool, a float or a text is refused by name (pydantic's lax mode
    would read ``true`` as 1 and ``"4"`` as 4)."""
    path = tmp_path / "hf.json"
    tensor = {"shape": [size, 8], "dtype": "F32", "file": "model.safetensors"}
    path.write_text(json.dumps({"format": FORMAT, "config": {}, "tensors": {"w": tensor}}))
    with pytest.raises(
        HFManifestError, match=r"tensors\.w\.shape\.0: Input should be a valid integer"
    ):
        load_hf_manifest(path)
    tensor["shape"] = [4, 8]
    path.write_text(json.dumps({"format": FORMAT, "config": {}, "tensors": {"w": tensor}}))
    assert load_hf_manifest(path).tensors["w"].shape == (4, 8)
