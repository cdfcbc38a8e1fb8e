"""Odd and hostile input found by fuzzing (issue 11): each gives a finding or an error with
a code, never a traceback, a hang or unbounded memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardspec.cli import main
from shardspec.frontend.textfile import read_text
from shardspec.runtime import hf as hfmod
from shardspec.runtime.hf import HFError

RULES = "mesh over 8 ranks { dp: * }\nparam ** [a] {}\n"


def lint(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(["lint", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out + err


@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "folder"])
def test_a_manifest_that_is_no_regular_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    """`manifest "/dev/zero"` read until memory ran out; a FIFO would block forever."""
    if target == "fifo":
        os.mkfifo(tmp_path / "fifo")
    elif target == "folder":
        (tmp_path / "folder").mkdir()
    spec = tmp_path / "s.shard"
    spec.write_text(f'manifest "{target}"\n' + RULES)
    status, out = lint(capsys, str(spec))
    assert status == 2
    assert "SS002" in out and ("not a regular file" in out or "Is a directory" in out), out


def test_a_spec_that_is_no_regular_file(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = lint(capsys, "/dev/zero")
    assert status == 2 and "SS002" in out and "not a regular file" in out


def test_read_text_bounds(tmp_path: Path) -> None:
    f = tmp_path / "big.json"
    f.write_bytes(b"\xef\xbb\xbf" + b"x" * 100)
    assert read_text(f) == "x" * 100  # the byte order mark dropped
    with pytest.raises(OSError, match="more than the 50"):
        read_text(f, limit=50)
    with pytest.raises(OSError, match="not a regular file"):
        read_text("/dev/null")
    with pytest.raises(OSError, match="NUL"):  # os.stat raised ValueError: a traceback
        read_text("a\x00b")


def test_a_manifest_path_with_a_nul_is_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "s.shard"
    spec.write_text('manifest "m\x00.json"\n' + RULES)
    status, out = lint(capsys, str(spec))
    assert status == 2 and "SS002" in out and "NUL" in out, out


def _safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(path))


@pytest.mark.parametrize("name", [hfmod.SINGLE, hfmod.INDEX])
def test_checkpoint_files_linked_from_elsewhere_are_refused(tmp_path: Path, name: str) -> None:
    """One rule for the index, the single file and index entries (core/paths.py): a file
    may link out of the folder only as Hugging Face's cache links (snapshots/<rev>/* ->
    ../../blobs/*, tests/test_paths.py), and a name may not leave the folder through a
    linked folder. (Session 8's rule read any file linked anywhere, /etc/passwd included.)"""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if name == hfmod.SINGLE:
        _safetensors(outside / "weights.safetensors")
        (ckpt / name).symlink_to(outside / "weights.safetensors")
        with pytest.raises(HFError, match="link to a file outside the directory"):
            hfmod.common.weight_map_of(str(ckpt), {})
        return
    (outside / "index.json").write_text('{"weight_map": {"w": "model-1.safetensors"}}')
    (ckpt / name).symlink_to(outside / "index.json")
    with pytest.raises(HFError, match="link to a file outside the directory"):
        hfmod.common.weight_map_of(str(ckpt), {})
    # An index in the folder whose entries leave it, by a link or through a linked folder.
    (ckpt / name).unlink()
    _safetensors(outside / "model-1.safetensors")
    (ckpt / "model-1.safetensors").symlink_to(outside / "model-1.safetensors")
    (ckpt / "out").symlink_to(outside)
    index = '{"weight_map": {"w": "model-1.safetensors", "v": "out/model-1.safetensors"}}'
    (ckpt / name).write_text(index)
    _wm, problems = hfmod.common.weight_map_of(str(ckpt), {})
    assert len(problems) == 2, problems
    assert all("outside" in p for p in problems), problems


def _compile(capsys: pytest.CaptureFixture[str], spec: Path, out: Path) -> tuple[int, str]:
    status = main(["compile", str(spec), "-o", str(out)])
    text = "".join(capsys.readouterr())
    assert "Traceback" not in text
    return status, text


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_factory_arguments_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """They compiled (exit 0) to a module that failed to import (`name 'inf' is not
    defined`)."""
    head = '{"format": "shardspec-manifest/1", "factory_args": {"n": '
    (tmp_path / "m.json").write_text(head + value + '}, "entries": [{"fqn": "w", "shape": [4]}]}')
    spec = tmp_path / "s.shard"
    spec.write_text('manifest "m.json"\nmesh over 2 ranks { dp: * }\nparam ** replicate\n')
    status, out = _compile(capsys, spec, tmp_path / "out")
    assert status == 2 and "SS003" in out and "must be finite" in out, out
    assert not (tmp_path / "out" / "s.py").exists()


def test_a_spec_path_with_control_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newline in the spec's path was copied raw into the generated module's comments,
    putting text on code lines (compile exited 0, the module did not import)."""
    import importlib.util

    folder = tmp_path / "odd\nname\t\x1b"
    folder.mkdir()
    spec = folder / "s.shard"
    spec.write_text("mesh over 2 ranks { dp: * }\nparam ** replicate\n")
    status, _ = _compile(capsys, spec, tmp_path / "out")
    assert status == 0
    module = tmp_path / "out" / "s.py"
    text = module.read_text()
    assert "odd\\nname\\t\\x1b" in text.splitlines()[0]  # escaped in the header comment
    loaded = importlib.util.spec_from_file_location("s_odd", module)
    assert loaded is not None and loaded.loader is not None
    mod = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(mod)
    assert mod.SPEC_PATH == str(spec)  # the real path, as a value


@pytest.mark.parametrize(
    ("mesh", "define"),
    [
        ("mesh over 4611686018427387904 ranks", []),
        ("mesh over 8 ranks", ["-D", "world=1099511627776"]),
    ],
)
def test_worlds_too_large_to_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mesh: str, define: list[str]
) -> None:
    """With a manifest, lint walked every rank: an OverflowError traceback at 2**64 (over
    2**63 - 1 a number is SS006 now, before any check), a MemoryError at 2**40."""
    import shutil

    shutil.copy(Path(__file__).parents[1] / "specs" / "llama.manifest.json", tmp_path / "m.json")
    spec = tmp_path / "s.shard"
    spec.write_text(
        f'manifest "m.json"\n{mesh} {{ dp_shard: *  tp: 2 }}\nfsdp dp_shard\n'
        "param **.weight [a, b] { shard a over tp }\nparam **.*norm.weight [a] {}\n"
    )
    status, out = lint(capsys, *define, str(spec))
    assert status == 1 and "SS010" in out and "meshes of up to 1048576 ranks" in out, out


@pytest.mark.parametrize(
    "names", [("fsdp", "tp"), ("tp", "dp_shard"), ("dp_shard",), None], ids=str
)
def test_a_mesh_named_otherwise_than_the_spec_is_refused(names) -> None:
    """The spec's axis names are the run-time mesh's ``mesh_dim_names``, in order: a mesh
    named as another trainer names it (torchtitan's newer ``fsdp``), in another order, or
    without names is a SpecError naming both, in every entry point (they all go through
    ``mesh_and_rank`` / ``layout_mesh``)."""
    import generated.llama as layout
    from shardspec.runtime.spec import SpecError
    from shardspec.runtime.units import mesh_and_rank

    class FakeDeviceMesh:
        mesh_dim_names = names
        shape = (2, 2)[: len(names or ("a", "b"))]

    with pytest.raises(SpecError) as e:
        mesh_and_rank(layout.SPEC, FakeDeviceMesh())
    if names is None:
        assert "no mesh_dim_names" in str(e.value)
    else:
        assert str(names) in str(e.value) and "('dp_shard', 'tp')" in str(e.value)
        assert "build_mesh()" in str(e.value)


@pytest.mark.parametrize("fn", ["load_hf", "export_hf"])
def test_hf_without_a_mesh_names_its_own_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fn: str
) -> None:
    """With no mesh given and none built, load_hf said "pass mesh=... to the planner" (the
    checkpoint planner's words): it names its own argument now."""
    import generated.llama as layout
    from examples.models import llama

    monkeypatch.setattr(layout.SPEC, "last_mesh", None)
    with pytest.raises(HFError) as info:
        getattr(layout, fn)(llama.tiny(), tmp_path / "hf")
    assert str(info.value) == (
        f"{fn}: no mesh: pass mesh=... to {fn}, or build the model's mesh with "
        "build_mesh()/distribute() first"
    )
    assert not (tmp_path / "hf").exists()


def test_a_head_cut_no_size_can_mend_is_reported_not_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SS034's hint lists the sizes of the cutting axis that keep heads whole; when the
    other axes on the dimension cut the heads whatever that size, there are none, and the
    hint raised IndexError (found by tests/test_heads.py's fuzz)."""
    (tmp_path / "m.json").write_text(
        '{"format": "shardspec-manifest/1", "entries": '
        '[{"fqn": "w", "kind": "param", "shape": [1, 2, 8], "dtype": "float32"}]}'
    )
    spec = tmp_path / "s.shard"
    spec.write_text(
        'manifest "m.json"\nmesh over 1 ranks { dp: *  tp: 2  cp: 1 }\nfsdp dp\n'
        "param w [e, d, h] {\n    heads d 2\n    shard d over (tp, cp)\n}\n"
    )
    status, out = lint(capsys, "-D", "cp=2", "-D", "world=84", str(spec))
    assert status == 1 and "SS034" in out, out
    assert "no size of tp keeps them whole while the other axes cut as they do" in out, out
