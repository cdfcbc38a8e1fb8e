"""export_hf's folder protocol in one process (world 1, the example llama through
``generated/llama.py``): what each kill point leaves and how the next export_hf recovers
it (and says so), that export_hf never deletes or replaces a folder it did not make (a
user's ``<path>.replaced`` or ``<path>.partial``, a copy of an export, a file, a folder it
did not export), how a link at ``path`` is followed, and the files' permissions.

A kill is simulated by the protocol's fault hook raising a ``BaseException`` that nothing
in export_hf catches: the folders are left as a killed rank 0 leaves them. The multi-rank
kill-point tests (survivors' errors, the dead rank named) are tests/test_hf_export_crash.py.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.bench_checkpoint import FakeMesh
from shardspec.runtime import hf as hfmod
from tests.hf_scenarios import hf_state
from tests.kill_harness import Killed, killed_at

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def layout() -> Any:
    import generated.llama as layout

    return layout


MESH = FakeMesh(("dp_shard", "tp"), (1, 1), (0, 0))


def _model(seed: int) -> torch.nn.Module:
    from examples.models import llama

    model = llama.tiny()
    llama.init_weights(model, seed)
    return model


def _export(layout: Any, path: Path | str, seed: int, **options: Any) -> hfmod.HFExportReport:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = layout.export_hf(_model(seed), str(path), MESH, **options)
    said = [str(w.message) for w in caught if issubclass(w.category, hfmod.ExportRecoveryWarning)]
    assert said == report.recovered
    return report


def _same(a: Path | str, b: Path | str) -> bool:
    ta, tb = hf_state(str(a)), hf_state(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(scope="module")
def refs(layout: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The export of the model at each seed, in a fresh folder."""
    root = tmp_path_factory.mktemp("refs")
    out = {}
    for seed in (1, 2, 3):
        _export(layout, root / str(seed), seed, config={"tie_word_embeddings": False})
        out[seed] = root / str(seed)
    return out


def _user_folder(path: Path, source: Path | None = None) -> None:
    """A user's folder (a copy of ``source``, markers and all, if given) with notes."""
    if source is not None:
        shutil.copytree(source, path)
    else:
        path.mkdir()
    (path / "notes.txt").write_text("mine: keep")


def _intact(path: Path) -> bool:
    return (path / "notes.txt").read_text() == "mine: keep"


def test_overwrite_never_deletes_a_users_replaced_folder(
    layout: Any, refs: dict, tmp_path: Path
) -> None:
    """Before: ``overwrite=True`` removed any ``<path>.replaced`` to make room."""
    out = tmp_path / "out"
    _export(layout, out, 1)
    for source in (None, refs[2]):  # a plain folder, and a copy of an export
        _user_folder(tmp_path / "out.replaced", source)
        with pytest.raises(
            hfmod.HFError, match=r"out\.replaced exists and no export_hf set it aside"
        ):
            _export(layout, out, 2, overwrite=True)
        assert _intact(tmp_path / "out.replaced") and _same(out, refs[1])
        assert not (tmp_path / "out.partial").exists()
        shutil.rmtree(tmp_path / "out.replaced")
    _export(layout, out, 2, overwrite=True)
    assert _same(out, refs[2]) and sorted(os.listdir(tmp_path)) == ["out"]


def _killed_at(layout: Any, path: Path, seed: int, point: str, **options: Any) -> None:
    with killed_at(point), pytest.raises(Killed):
        _export(layout, path, seed, **options)


def _states(path: Path) -> tuple[str, str, str]:
    p = str(path)
    return tuple(  # type: ignore[return-value]
        hfmod.folders.EXPORT.state(q) for q in (p, p + ".partial", p + ".replaced")
    )


# kill point -> (what it leaves: path, .partial, .replaced; what the next export reports)
KILLS = {
    "prepared": (("complete", "saving", "missing"), "an unfinished export_hf"),
    "exchanging": (("complete", "saving", "missing"), "an unfinished export_hf"),
    "exchanged": (("complete", "saving", "missing"), "an unfinished export_hf"),
    "writing": (("complete", "saving", "missing"), "an unfinished export_hf"),
    "written": (("complete", "saving", "missing"), "an unfinished export_hf"),
    "marked": (("complete", "complete", "missing"), "moved it to"),
    "renamed-old": (("missing", "complete", "complete"), "moved it to"),
    "renamed-new": (("complete", "missing", "complete"), "removed"),
}


@pytest.mark.parametrize("point", sorted(KILLS))
def test_each_kill_point_is_recovered_by_the_next_export(
    layout: Any, refs: dict, tmp_path: Path, point: str
) -> None:
    """Rank 0 stopped at each step of an overwrite: what the protocol says is left, and
    the next export_hf finishes or undoes it, says so, and writes its own export."""
    out = tmp_path / "out"
    _export(layout, out, 1)
    _killed_at(layout, out, 2, point, overwrite=True)
    left, said = KILLS[point]
    assert _states(out) == left
    report = _export(layout, out, 3, overwrite=True)
    assert len(report.recovered) == 1 and said in report.recovered[0], report.recovered
    assert _same(out, refs[3]) and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_first_export_killed_after_marking_is_finished_by_the_next(
    layout: Any, refs: dict, tmp_path: Path
) -> None:
    """A complete ``<path>.partial`` without its in-progress marker (rank 0 stopped after
    marking it, ``path`` never there): moved into place by the next export_hf, which then
    writes its own, without overwrite=True (what it replaces is its own unfinished work)."""
    out = tmp_path / "out"
    _killed_at(layout, out, 2, "marked")
    assert _states(out) == ("missing", "complete", "missing")
    report = _export(layout, out, 3)
    assert "moved it to" in report.recovered[0]
    assert _same(out, refs[3]) and sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("point", sorted(KILLS))
def test_users_folders_are_never_touched_in_recovery(
    layout: Any, refs: dict, tmp_path: Path, point: str
) -> None:
    """After each kill, a user's folder under the one name the protocol uses that the kill
    left free (``path`` itself where it is missing): the next export recovers around it
    or refuses, naming it; the folder is left intact."""
    tried = 0
    for name in ("out", "out.partial", "out.replaced"):
        root = tmp_path / name.replace(".", "_")
        root.mkdir()
        out = root / "out"
        _export(layout, out, 1)
        _killed_at(layout, out, 2, point, overwrite=True)
        user = root / name
        if user.exists():  # the protocol's own folder has that name
            continue
        # At path, a folder of the user's (a copy of an export there would be an export,
        # which overwrite=True replaces); beside it, a copy of an export, markers and all.
        _user_folder(user, None if name == "out" else refs[1])
        try:
            _export(layout, out, 3, overwrite=True)
        except hfmod.HFError as e:
            assert str(user) in str(e), e
        assert _intact(user)
        tried += 1
    assert tried == 1, tried


def test_a_copy_of_an_export_named_partial_is_not_moved_into_place(
    layout: Any, refs: dict, tmp_path: Path
) -> None:
    """A complete ``<path>.partial`` that export_hf did not mark in that very folder (a
    copy, its markers included): refused by name, never moved or removed."""
    out = tmp_path / "out"
    _export(layout, out, 1)
    _user_folder(tmp_path / "out.partial", refs[2])
    with pytest.raises(
        hfmod.HFError, match=r"out\.partial exists and is not an export in progress"
    ):
        _export(layout, out, 3, overwrite=True)
    assert _intact(tmp_path / "out.partial") and _same(out, refs[1])


def test_overwrite_refuses_what_is_no_export(layout: Any, refs: dict, tmp_path: Path) -> None:
    """A file, a link to a file, a folder export_hf did not write: refused with a clear
    error, untouched, and no ``.replaced`` or ``.partial`` debris."""
    target = tmp_path / "file"
    target.write_text("a file")
    (tmp_path / "filelink").symlink_to(target)
    _user_folder(tmp_path / "downloaded", None)
    for name, what in (("file", "a file"), ("filelink", "a file"), ("downloaded", "a folder")):
        for overwrite in (True, False) if what == "a file" else (True,):
            with pytest.raises(hfmod.HFError, match=f"exists and is {what}"):
                _export(layout, tmp_path / name, 1, overwrite=overwrite)
    assert target.read_text() == "a file" and (tmp_path / "filelink").is_symlink()
    assert _intact(tmp_path / "downloaded")
    assert sorted(os.listdir(tmp_path)) == ["downloaded", "file", "filelink"]
    _export(layout, tmp_path / "ok", 1)
    with pytest.raises(hfmod.HFError, match="pass overwrite=True"):
        _export(layout, tmp_path / "ok", 2)
    assert _same(tmp_path / "ok", refs[1])


def test_a_link_to_an_export_is_followed(layout: Any, refs: dict, tmp_path: Path) -> None:
    _export(layout, tmp_path / "v1", 1)
    (tmp_path / "latest").symlink_to("v1")
    _export(layout, tmp_path / "latest", 2, overwrite=True)
    assert (tmp_path / "latest").is_symlink() and os.readlink(tmp_path / "latest") == "v1"
    assert _same(tmp_path / "v1", refs[2])
    assert sorted(os.listdir(tmp_path)) == ["latest", "v1"]
    _export(layout, str(tmp_path / "latest") + "/", 3, overwrite=True)
    assert _same(tmp_path / "v1", refs[3])


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_gets_the_mode_config_json_gets(layout: Any, tmp_path: Path, umask: int) -> None:
    """Before: the shards were 0600 (safetensors writes a private temporary file) while
    config.json and the index followed the umask."""
    old = os.umask(umask)
    try:
        _export(layout, tmp_path / "out", 1, config={"tie_word_embeddings": False})
    finally:
        os.umask(old)
    modes = {n: os.stat(tmp_path / "out" / n).st_mode & 0o777 for n in os.listdir(tmp_path / "out")}
    assert set(modes.values()) == {0o666 & ~umask}, {n: oct(m) for n, m in modes.items()}
    done = json.loads((tmp_path / "out" / hfmod.EXPORT_DONE).read_text())
    assert done["format"] == "shardspec-export/1"


def test_without_overwrite_an_existing_path_is_never_replaced(
    layout: Any, refs: dict, tmp_path: Path
) -> None:
    """An interrupted overwrite, retried without ``overwrite=True``: refused before anything
    is done (``path`` exists). An export set aside whose replacement is gone: restored by
    recovery, then not replaced without ``overwrite=True``."""
    out = tmp_path / "out"
    _export(layout, out, 1)
    _killed_at(layout, out, 2, "marked", overwrite=True)
    with pytest.raises(hfmod.HFError, match="pass overwrite=True"):
        _export(layout, out, 3)
    assert _states(out) == ("complete", "complete", "missing")
    _killed_at(layout, out, 3, "renamed-old", overwrite=True)  # recovers "marked" first
    shutil.rmtree(tmp_path / "out.partial")  # the new export lost: only the old one remains
    with pytest.raises(hfmod.HFError, match=r"restored it to .*pass overwrite=True"):
        _export(layout, out, 3)
    assert _same(out, refs[2]) and sorted(os.listdir(tmp_path)) == ["out"]


def test_an_unreadable_config_is_refused_before_anything(
    layout: Any, refs: dict, tmp_path: Path
) -> None:
    """Every rank checks its config before step 1 and all raise together (on several
    ranks, tests/test_hf_export_crash.py: a config on one node only); nothing changes."""
    out = tmp_path / "out"
    _export(layout, out, 1)
    missing = tmp_path / "nowhere" / "config.json"
    with pytest.raises(hfmod.HFError, match=r"rank 0: HFError: config: .* not a readable"):
        _export(layout, out, 2, overwrite=True, config=str(missing))
    assert _same(out, refs[1]) and sorted(os.listdir(tmp_path)) == ["out"]
