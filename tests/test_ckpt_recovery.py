"""The save protocol's folder steps in one process, on crafted folders (no ranks): what
recovery does with each state an interrupted save can leave, and that it never deletes,
restores or overwrites a folder no save made (a user's ``<path>.old`` or ``<path>.partial``,
a copy of a checkpoint with its markers, a link, a path that is not a checkpoint). The
multi-rank crash tests are in tests/test_ckpt_crash.py; ``save`` and ``load`` themselves
around users' folders and links are in tests/test_ckpt_ownership.py.

A folder is the protocol's own only when it holds a marker written into that very folder
(the marker records the folder's inode): :func:`ours` writes one as the protocol does, and
``shutil.copytree`` (``cp -r``) of such a folder makes one that is not."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from shardspec.runtime import checkpoint as ck
from shardspec.runtime.checkpoint import folders


def folder(path: Path, *names: str, tag: str = "") -> str:
    path.mkdir(parents=True)
    for name in names:
        (path / name).write_text(tag or name)
    return str(path)


def ours(path: str, marker: str) -> str:
    """Write ``marker`` into ``path`` as the protocol does (stamped with its inode)."""
    folders._stamp(path, marker, {"format": "test"})
    return path


def content(path: str) -> dict[str, str]:
    return {
        n: (Path(path) / n).read_text()
        for n in sorted(os.listdir(path))
        if n not in (ck.MARKER, ck.REPLACED, ck.SAVING)
    }


DATA = (".metadata", "__0_0.distcp")


def checkpoint(path: Path, tag: str) -> str:
    """A complete checkpoint whose completion marker was written into it."""
    return ours(folder(path, *DATA, tag=tag), ck.MARKER)


def test_a_complete_partial_is_moved_into_place(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "c", "A")
    checkpoint(tmp_path / "c.partial", "B")
    done = folders._recover(path)
    assert len(done) == 1 and "moved it to" in done[0] and "removed" in done[0]
    assert content(path) == {n: "B" for n in DATA}
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_between_the_renames_the_new_checkpoint_wins(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    ours(checkpoint(tmp_path / "c.old", "A"), ck.REPLACED)
    checkpoint(tmp_path / "c.partial", "B")
    done = folders._recover(path)
    assert len(done) == 1 and "moved it to" in done[0]
    assert content(path) == {n: "B" for n in DATA}
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_set_aside_checkpoint_is_restored_or_removed(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    ours(folder(tmp_path / "c.old", ".metadata", tag="A"), ck.REPLACED)  # a plain DCP one
    done = folders._recover(path)
    assert len(done) == 1 and "restored it to" in done[0]
    assert sorted(os.listdir(path)) == [".metadata"]  # the set-aside note is gone
    ours(folder(tmp_path / "c.old", *DATA, tag="old"), ck.REPLACED)
    done = folders._recover(path)
    assert len(done) == 1 and "removed" in done[0]
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_someone_elses_folders_are_never_touched(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "c", "A")
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
    assert sorted(content(other)) == [".metadata"]
    # A user's folder named <path>.partial, and a path that is no checkpoint: refused.
    folder(tmp_path / "e.partial", "notes.txt")
    with pytest.raises(ck.CheckpointError, match="not a save in progress"):
        folders._prepare(str(tmp_path / "e"))
    assert content(str(tmp_path / "e.partial")) == {"notes.txt": "notes.txt"}
    folder(tmp_path / "f", "notes.txt")
    with pytest.raises(ck.CheckpointError, match="is not a checkpoint"):
        folders._prepare(str(tmp_path / "f"))
    assert not os.path.exists(str(tmp_path / "f.partial"))


def test_copies_carry_the_markers_but_are_not_the_protocols(tmp_path: Path) -> None:
    """``cp -r ck ck.old`` (notes added), ``cp -r ck ck.partial``, and copies of a folder
    the protocol set aside or left unfinished: recovery moves and removes none of them,
    and a save that needs their names refuses, naming them."""
    path = checkpoint(tmp_path / "c", "A")
    aside = ours(checkpoint(tmp_path / "elsewhere" / "x.old", "X"), ck.REPLACED)
    for name, source in (("c.old", path), ("c.partial", path)):
        shutil.copytree(source, tmp_path / name)
        (tmp_path / name / "notes.txt").write_text("keep me")
    assert folders._recover(path) == []  # what a load does first
    with pytest.raises(ck.CheckpointError, match=r"c\.old exists and no save set it aside"):
        folders._prepare(path)
    shutil.rmtree(tmp_path / "c.old")
    shutil.copytree(aside, tmp_path / "c.old")  # set-aside marker and all
    (tmp_path / "c.old" / "notes.txt").write_text("keep me")
    assert folders._recover(path) == []
    shutil.rmtree(tmp_path / "c.old")
    with pytest.raises(
        ck.CheckpointError, match=r"c\.partial exists and is not a save in progress"
    ):
        folders._prepare(path)
    # An unfinished save copied (its in-progress marker and all) is not a save in progress.
    unfinished = ours(folder(tmp_path / "elsewhere" / "y.partial", ".metadata"), ck.SAVING)
    shutil.rmtree(tmp_path / "c.partial")
    shutil.copytree(unfinished, tmp_path / "c.partial")
    with pytest.raises(
        ck.CheckpointError, match=r"c\.partial exists and is not a save in progress"
    ):
        folders._prepare(path)
    assert (tmp_path / "c.partial" / ck.SAVING).is_file()
    assert content(path) == {n: "A" for n in DATA}
    # Without a checkpoint at path, a copied complete one at <path>.old is not restored.
    shutil.copytree(aside, tmp_path / "g.old")
    assert folders._recover(str(tmp_path / "g")) == []
    assert not os.path.exists(tmp_path / "g")


def test_links_are_never_the_protocols(tmp_path: Path) -> None:
    """Siblings that are links to folders the protocol made are refused, never followed
    into and removed; a path that is a link is followed by target()."""
    real = checkpoint(tmp_path / "real", "A")
    (tmp_path / "c").mkdir()
    path = checkpoint(tmp_path / "c" / "ck", "B")
    set_aside = ours(checkpoint(tmp_path / "aside", "C"), ck.REPLACED)
    os.symlink(set_aside, path + ".old")
    assert folders._recover(path) == []
    with pytest.raises(ck.CheckpointError, match="no save set it aside"):
        folders._prepare(path)
    os.remove(path + ".old")
    unfinished = ours(folder(tmp_path / "u", ".metadata"), ck.SAVING)
    os.symlink(unfinished, path + ".partial")
    with pytest.raises(ck.CheckpointError, match="not a save in progress"):
        folders._prepare(path)
    assert os.path.isdir(unfinished) and os.path.isdir(set_aside)
    link = tmp_path / "latest"
    link.symlink_to(real)
    assert folders.target(str(link)) == os.path.realpath(real)
    assert folders.target(str(link) + "/") == os.path.realpath(real)
    assert folders.target(path + "//") == path
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ck.CheckpointError, match="does not resolve"):
        folders.target(str(loop))


def test_an_unfinished_save_is_removed_by_the_next_save_and_never_loaded(
    tmp_path: Path,
) -> None:
    path = checkpoint(tmp_path / "c", "A")
    tmp = ours(folder(tmp_path / "c.partial", ".metadata", "__0_0.distcp"), ck.SAVING)
    assert folders._recover(path) == []  # a load leaves it
    with pytest.raises(ck.CheckpointError, match="unfinished save"):
        folders._refuse_unfinished(tmp)
    done = folders._prepare(path)
    assert done == [f"removed {tmp}, an unfinished save"]
    assert sorted(os.listdir(tmp)) == [ck.SAVING]  # a fresh one
    # The complete protocol: marked, moved, the previous one removed.
    (Path(tmp) / ".metadata").write_text("B")
    folders._commit(path, {"format": "test"})
    assert sorted(os.listdir(path)) == [".metadata", ck.MARKER]
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert folders._owned(path, ck.MARKER)  # the marker of the folder now at path
    # Names: an unmarked '.partial' folder is refused, a plain DCP checkpoint is not.
    plain = folder(tmp_path / "p.partial", ".metadata")
    with pytest.raises(ck.CheckpointError, match="not marked complete"):
        folders._refuse_unfinished(plain)
    folders._refuse_unfinished(folder(tmp_path / "dcp", ".metadata"))
    folders._refuse_unfinished(path)
