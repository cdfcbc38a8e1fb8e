"""The one rule for the files a Hugging Face checkpoint's index names
(:mod:`shardspec.core.paths`): ``load_hf`` (which reads them) and ``shardspec hf-manifest``
(which reads their headers) accept and refuse the same names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardspec.core.paths import Escape, escape, inside
from shardspec.inputs.hfmanifest import INDEX, SINGLE, HFManifestError, build_hf_manifest
from shardspec.runtime import hf as hfmod


def _safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(2)}, str(path))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A checkpoint folder with a file, a file in a subfolder, a link to each of them, and
    links out of the folder (to a file, which is read, and to a folder, which is not)."""
    root = tmp_path / "ckpt"
    _safetensors(root / "a.safetensors")
    _safetensors(root / "sub" / "b.safetensors")
    _safetensors(tmp_path / "elsewhere" / "secret.safetensors")
    (root / "link.safetensors").symlink_to("sub/b.safetensors")
    (root / "linkdir").symlink_to("sub")
    (root / "out.safetensors").symlink_to(tmp_path / "elsewhere" / "secret.safetensors")
    (root / "outdir").symlink_to(tmp_path / "elsewhere")
    (root / "config.json").write_text("{}")
    return root


CASES = [
    ("a.safetensors", None),
    ("sub/b.safetensors", None),
    ("link.safetensors", None),  # a link that stays inside
    ("linkdir/b.safetensors", None),
    ("out.safetensors", None),  # a linked file, anywhere (as Hugging Face's cache links)
    ("outdir/secret.safetensors", Escape.LINK_OUT),
    ("", Escape.NO_NAME),
    ("/etc/passwd", Escape.ABSOLUTE),
    ("\\etc\\passwd", Escape.ABSOLUTE),
    ("C:model.safetensors", Escape.ABSOLUTE),
    ("../elsewhere/secret.safetensors", Escape.PARENT),
    ("sub/../a.safetensors", Escape.PARENT),
    ("sub\\..\\a.safetensors", Escape.PARENT),
    ("./a.safetensors", Escape.NOT_PLAIN),
    ("sub//b.safetensors", Escape.NOT_PLAIN),
    ("sub\\b.safetensors", Escape.NOT_PLAIN),
]


@pytest.mark.parametrize(("name", "why"), CASES)
def test_the_rule(folder: Path, name: str, why: Escape | None) -> None:
    assert escape(folder, name) is why
    assert inside(str(folder), name) is (why is None)


def test_a_name_that_is_not_a_string(folder: Path) -> None:
    assert escape(folder, 3) is Escape.NO_NAME and escape(folder, None) is Escape.NO_NAME


@pytest.mark.parametrize(("name", "why"), CASES)
def test_load_hf_and_hf_manifest_agree(folder: Path, name: str, why: Escape | None) -> None:
    (folder / INDEX).write_text(json.dumps({"weight_map": {"w": name}}))
    weight_map, problems = hfmod.common.weight_map_of(str(folder), {})
    assert weight_map == {"w": name}
    if why is None:
        assert problems == []
        manifest = build_hf_manifest(folder)
        assert manifest["tensors"] == {"w": {"dtype": "F32", "shape": [2], "file": name}}
        return
    if not name:
        assert problems == [
            f"w: weight_map points to '', outside the checkpoint directory {folder}"
        ]
        with pytest.raises(HFManifestError, match="names a file that is not a string"):
            build_hf_manifest(folder)
        return
    assert problems == [
        f"w: weight_map points to {name!r}, outside the checkpoint directory {folder}"
    ]
    with pytest.raises(HFManifestError) as info:
        build_hf_manifest(folder)
    assert str(info.value) == f"{folder / INDEX}: weight_map file {name!r} {why.value}"
    assert info.value.code == "SS003"
    assert ("cp -rL" in info.value.hint) is (why is Escape.LINK_OUT)


@pytest.mark.parametrize("fixed", [SINGLE, INDEX])
def test_a_hugging_face_cache_snapshot_is_read_where_it_is(tmp_path: Path, fixed: str) -> None:
    """Hugging Face's cache keeps every file of a snapshot as a link into ../../blobs: the
    index or the single file, the shards and config.json. Both readers accept it."""
    repo = tmp_path / "models--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    _safetensors(blobs / "b1")
    (blobs / "c1").write_text("{}")
    (snap / "config.json").symlink_to("../../blobs/c1")
    if fixed == INDEX:
        (blobs / "i1").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
        (snap / INDEX).symlink_to("../../blobs/i1")
        (snap / "model-1.safetensors").symlink_to("../../blobs/b1")
        name = "model-1.safetensors"
    else:
        (snap / SINGLE).symlink_to("../../blobs/b1")
        name = SINGLE
    assert hfmod.common.weight_map_of(str(snap), {})[0] == {"w": name}
    manifest = build_hf_manifest(snap)
    assert manifest["tensors"] == {"w": {"dtype": "F32", "shape": [2], "file": name}}
