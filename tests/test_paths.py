"""The rules for the files a checkpoint folder names (:mod:`shardspec.core.paths`): for a
Hugging Face checkpoint, ``load_hf`` (which reads them) and ``shardspec hf-manifest`` (which
reads their headers) accept and refuse the same names, links out of the folder only as
Hugging Face's cache lays them out; for a DCP checkpoint, plain file names in the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardspec.core.paths import Escape, escape, file_escape, inside
from shardspec.inputs.hfmanifest import INDEX, SINGLE, HFManifestError, build_hf_manifest
from shardspec.runtime import hf as hfmod


def _safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(2)}, str(path))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A checkpoint folder with a file, a file in a subfolder, a link to each of them, and
    links out of the folder (to a file, to /etc/passwd, to a folder: none is read)."""
    root = tmp_path / "ckpt"
    _safetensors(root / "a.safetensors")
    _safetensors(root / "sub" / "b.safetensors")
    _safetensors(tmp_path / "elsewhere" / "secret.safetensors")
    (root / "link.safetensors").symlink_to("sub/b.safetensors")
    (root / "linkdir").symlink_to("sub")
    (root / "out.safetensors").symlink_to(tmp_path / "elsewhere" / "secret.safetensors")
    (root / "outdir").symlink_to(tmp_path / "elsewhere")
    (root / "passwd.safetensors").symlink_to("/etc/passwd")
    (root / "config.json").write_text("{}")
    return root


CASES = [
    ("a.safetensors", None),
    ("sub/b.safetensors", None),
    ("link.safetensors", None),  # a link that stays inside
    ("linkdir/b.safetensors", None),
    ("out.safetensors", Escape.FILE_LINK_OUT),  # a link out, not as Hugging Face's cache
    ("passwd.safetensors", Escape.FILE_LINK_OUT),
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
            f"w: weight_map points to '', outside the checkpoint directory {folder} "
            f"(the file {Escape.NO_NAME.value})"
        ]
        with pytest.raises(HFManifestError, match="names a file that is not a string"):
            build_hf_manifest(folder)
        return
    assert problems == [
        f"w: weight_map points to {name!r}, outside the checkpoint directory {folder} "
        f"(the file {why.value})"
    ]
    with pytest.raises(HFManifestError) as info:
        build_hf_manifest(folder)
    assert str(info.value) == f"{folder / INDEX}: weight_map file {name!r} {why.value}"
    assert info.value.code == "SS003"
    assert ("cp -rL" in info.value.hint) is (why in (Escape.LINK_OUT, Escape.FILE_LINK_OUT))


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


def _cache(tmp_path: Path) -> tuple[Path, Path]:
    """A Hugging Face cache repository: ``snapshots/abc123`` and ``blobs``."""
    repo = tmp_path / "models--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    return snap, blobs


def test_only_the_cache_layout_links_out(tmp_path: Path) -> None:
    """A snapshot's file (in a subfolder too) may link to a file directly in the repo's
    blobs; not to a file in a folder under blobs, nor out of a folder that is no snapshot."""
    snap, blobs = _cache(tmp_path)
    _safetensors(blobs / "b1")
    _safetensors(blobs / "deeper" / "b2")
    (snap / "sub").mkdir()
    (snap / "a.safetensors").symlink_to("../../blobs/b1")
    (snap / "sub" / "a.safetensors").symlink_to("../../../blobs/b1")
    (snap / "deep.safetensors").symlink_to("../../blobs/deeper/b2")
    assert escape(snap, "a.safetensors") is None
    assert escape(snap, "sub/a.safetensors") is None
    assert escape(snap, "deep.safetensors") is Escape.FILE_LINK_OUT
    # The same links from a folder that is not <repo>/snapshots/<revision>:
    other = tmp_path / "models--tiny" / "notsnapshots" / "abc123"
    other.mkdir(parents=True)
    (other / "a.safetensors").symlink_to("../../blobs/b1")
    assert escape(other, "a.safetensors") is Escape.FILE_LINK_OUT


@pytest.mark.parametrize("fixed", [SINGLE, INDEX, "config.json"])
def test_a_fixed_name_linking_out_is_never_opened(folder: Path, tmp_path: Path, fixed: str) -> None:
    """The index, the single file and config.json follow the same rule: a link to
    /etc/passwd (or any file outside) is refused by both readers before it is opened (the
    error is the rule's, not a parse error of its content)."""
    for name in (SINGLE, INDEX, "config.json"):
        (folder / name).unlink(missing_ok=True)
    (folder / "config.json").write_text("{}")
    if fixed != "config.json":
        (folder / fixed).symlink_to("/etc/passwd")
    else:
        (folder / "config.json").unlink()
        (folder / "config.json").symlink_to("/etc/passwd")
        _safetensors(folder / SINGLE)
    if fixed != "config.json":  # load_hf does not read config.json
        with pytest.raises(hfmod.HFError) as e:
            hfmod.common.weight_map_of(str(folder), {})
        assert str(e.value).startswith(f"{folder / fixed}: the file {Escape.FILE_LINK_OUT.value}")
    with pytest.raises(HFManifestError) as info:
        build_hf_manifest(folder)
    assert str(info.value) == f"{folder / fixed}: the file {Escape.FILE_LINK_OUT.value}"
    assert "cp -rL" in info.value.hint


def test_open_file_keeps_to_the_rule(folder: Path) -> None:
    """A reader that skips the index check still cannot open a file outside."""
    with pytest.raises(hfmod.HFError, match="link to a file outside"):
        hfmod.common.open_file(str(folder), "passwd.safetensors", {})
    assert hfmod.common.open_file(str(folder), "link.safetensors", {}).keys() == ["w"]


DATA_CASES = [
    ("__0_0.distcp", None),
    ("../outside/__0_0.distcp", Escape.PARENT),
    ("sub/__0_0.distcp", Escape.IN_FOLDER),
    ("/etc/passwd", Escape.ABSOLUTE),
    ("C:__0_0.distcp", Escape.ABSOLUTE),
    ("data:stream", Escape.NOT_PLAIN),
    (".", Escape.NOT_PLAIN),
    ("", Escape.NO_NAME),
    ("a\0b", Escape.NO_NAME),
    ("out.distcp", Escape.DATA_LINK_OUT),
    ("in.distcp", None),  # a link that stays in the folder
]


@pytest.mark.parametrize(("name", "why"), DATA_CASES)
def test_dcp_data_files_are_plain_names_in_the_folder(
    tmp_path: Path, name: str, why: Escape | None
) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    (root / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "elsewhere").write_bytes(b"x")
    (root / "out.distcp").symlink_to(tmp_path / "elsewhere")
    (root / "in.distcp").symlink_to("__0_0.distcp")
    assert file_escape(root, name) is why
