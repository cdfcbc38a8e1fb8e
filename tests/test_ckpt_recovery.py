"""The save protocol's folder steps in one process, on crafted folders (no ranks): what
recovery does with each state an interrupted save can leave, and that it never deletes,
restores or overwrites a folder no save made (a user's ``<path>.old`` or
``<path>.partial``, a path that is not a checkpoint). The multi-rank crash tests are in
tests/test_ckpt_crash.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardspec.runtime import checkpoint as ck
from shardspec.runtime.checkpoint import folders


def folder(path: Path, *names: str, tag: str = "") -> str:
    path.mkdir(parents=True)
    for name in names:
        (path / name).write_text(tag or name)
    return str(path)


def content(path: str) -> dict[str, str]:
    return {n: (Path(path) / n).read_text() for n in sorted(os.listdir(path))}


COMPLETE = (".metadata", ck.MARKER, "__0_0.distcp")


def test_a_complete_partial_is_moved_into_place(tmp_path: Path) -> None:
    path = folder(tmp_path / "c", *COMPLETE, tag="A")
    folder(tmp_path / "c.partial", *COMPLETE, tag="B")
    done = folders._recover(path)
    assert len(done) == 1 and "moved it to" in done[0] and "removed" in done[0]
    assert content(path) == {n: "B" for n in COMPLETE}
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_between_the_renames_the_new_checkpoint_wins(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    folder(tmp_path / "c.old", *COMPLETE, ck.REPLACED, tag="A")
    folder(tmp_path / "c.partial", *COMPLETE, tag="B")
    done = folders._recover(path)
    assert len(done) == 1 and "moved it to" in done[0]
    assert content(path) == {n: "B" for n in COMPLETE}
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_set_aside_checkpoint_is_restored_or_removed(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    folder(tmp_path / "c.old", ".metadata", ck.REPLACED, tag="A")  # a plain DCP one, set aside
    done = folders._recover(path)
    assert len(done) == 1 and "restored it to" in done[0]
    assert content(path) == {".metadata": "A"}  # the set-aside note is gone
    folder(tmp_path / "c.old", *COMPLETE, tag="old")
    done = folders._recover(path)
    assert len(done) == 1 and "removed" in done[0]
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_someone_elses_folders_are_never_touched(tmp_path: Path) -> None:
    path = folder(tmp_path / "c", *COMPLETE, tag="A")
    mine = folder(tmp_path / "c.old", ".metadata", "notes.txt", tag="user")  # a DCP backup
    assert folders._recover(path) == []
    with pytest.raises(ck.CheckpointError, match="no save set it aside"):
        folders._prepare(path)
    assert content(mine) == {".metadata": "user", "notes.txt": "user"}
    assert not os.path.exists(path + ".partial")
    # Without a checkpoint at path, the save needs no <path>.old: it goes ahead, leaving it.
    other = str(tmp_path / "d")
    folder(tmp_path / "d.old", ".metadata", tag="user")
    assert folders._recover(other) == []
    assert not os.path.exists(other)  # not "restored"
    folders._prepare(other)
    (Path(other + ".partial") / ".metadata").write_text("B")
    folders._commit(other, {"format": "test"})
    assert content(other + ".old") == {".metadata": "user"}
    assert sorted(content(other)) == [".metadata", ck.MARKER]
    # A user's folder named <path>.partial, and a path that is no checkpoint: refused.
    folder(tmp_path / "e.partial", "notes.txt")
    with pytest.raises(ck.CheckpointError, match="not a save in progress"):
        folders._prepare(str(tmp_path / "e"))
    assert content(str(tmp_path / "e.partial")) == {"notes.txt": "notes.txt"}
    folder(tmp_path / "f", "notes.txt")
    with pytest.raises(ck.CheckpointError, match="is not a checkpoint"):
        folders._prepare(str(tmp_path / "f"))
    assert not os.path.exists(str(tmp_path / "f.partial"))


def test_an_unfinished_save_is_removed_by_the_next_save_and_never_loaded(
    tmp_path: Path,
) -> None:
    path = folder(tmp_path / "c", *COMPLETE, tag="A")
    tmp = folder(tmp_path / "c.partial", ".metadata", ck.SAVING, "__0_0.distcp")
    assert folders._recover(path) == []  # a load leaves it
    with pytest.raises(ck.CheckpointError, match="unfinished save"):
        folders._refuse_unfinished(tmp)
    done = folders._prepare(path)
    assert done == [f"removed {tmp}, an unfinished save"]
    assert sorted(os.listdir(tmp)) == [ck.SAVING]  # a fresh one
    # The complete protocol: marked, moved, the previous one removed.
    (Path(tmp) / ".metadata").write_text("B")
    folders._commit(path, {"format": "test"})
    assert sorted(content(path)) == [".metadata", ck.MARKER]
    assert sorted(os.listdir(tmp_path)) == ["c"]
    # Names: an unmarked '.partial' folder is refused, a plain DCP checkpoint is not.
    plain = folder(tmp_path / "p.partial", ".metadata")
    with pytest.raises(ck.CheckpointError, match="not marked complete"):
        folders._refuse_unfinished(plain)
    folders._refuse_unfinished(folder(tmp_path / "dcp", ".metadata"))
    folders._refuse_unfinished(path)
