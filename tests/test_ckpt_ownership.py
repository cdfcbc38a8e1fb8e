"""``save`` and ``load`` around folders they did not make, and around links (one process,
world 1, the benchmark's spec as in tests/test_integrity.py).

* A user's ``<path>.old`` (``cp -r ck ck.old``, notes inside: it carries the checkpoint's
  markers) and ``<path>.partial`` are never deleted, moved or restored by ``load`` or
  ``save``, in any path: a plain load, a save over the checkpoint, and the recovery of an
  interrupted save (stopped at each step in this process: the fault hook raises a
  ``BaseException`` the protocol does not catch, as a kill leaves the folders).
* A ``path`` that is a symbolic link is followed by both: the checkpoint it points to is
  replaced beside it, the link stays, and later saves and loads of the link work.
* ``save("ck/")`` writes ``ck``, not a ``.partial`` inside it.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from shardspec.runtime import checkpoint as ck
from tests.kill_harness import Killed, killed_at
from tests.test_integrity import SPEC, _mesh, _state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(path: str | Path, seed: int) -> ck.ShardspecSavePlanner:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ck.CheckpointRecoveryWarning)
        return ck.save(SPEC, _state(seed), path, mesh=_mesh())


def _load(path: str | Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    target = _state(99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planner = ck.load(SPEC, target, path, mesh=_mesh())
    said = [str(w.message) for w in caught if issubclass(w.category, ck.CheckpointRecoveryWarning)]
    assert said == planner.recovered
    return target["model"], said


def _holds(path: str | Path, seed: int) -> bool:
    got, _ = _load(path)
    want = _state(seed)["model"]
    return all(torch.equal(got[k], want[k]) for k in want)


def _user_copy(source: Path, dest: Path) -> None:
    """``cp -r source dest`` and a note of the user's inside."""
    shutil.copytree(source, dest)
    (dest / "notes.txt").write_text("mine: keep")


def _intact(dest: Path) -> bool:
    return (dest / "notes.txt").is_file() and (dest / ".metadata").is_file()


def test_a_users_copy_named_old_is_never_deleted(tmp_path: Path) -> None:
    ck_path = tmp_path / "ck"
    _save(ck_path, 1)
    _user_copy(ck_path, tmp_path / "ck.old")
    _, said = _load(ck_path)  # a read: before the fix it deleted ck.old
    assert said == [] and _intact(tmp_path / "ck.old")
    with pytest.raises(ck.CheckpointError, match=r"ck\.old exists and no save set it aside"):
        _save(ck_path, 2)
    assert _intact(tmp_path / "ck.old") and _holds(ck_path, 1)
    assert not (tmp_path / "ck.partial").exists()
    # A user's copy named <path>.partial: the same.
    shutil.rmtree(tmp_path / "ck.old")
    _user_copy(ck_path, tmp_path / "ck.partial")
    assert _load(ck_path)[1] == [] and _intact(tmp_path / "ck.partial")
    with pytest.raises(ck.CheckpointError, match=r"ck\.partial exists and is not a save"):
        _save(ck_path, 2)
    assert _intact(tmp_path / "ck.partial") and _holds(ck_path, 1)


def _interrupted(path: Path, seed: int, point: str) -> None:
    with killed_at(point), pytest.raises(Killed):
        _save(path, seed)


# What an interrupted save left, and what the next load finds at the path: the previous
# checkpoint (seed 1) or the new one (seed 2).
STEPS = {"prepared": 1, "written": 1, "marked": 2, "renamed-old": 2, "renamed-new": 2}


@pytest.mark.parametrize("point", sorted(STEPS))
def test_recovery_at_each_step_leaves_users_folders_alone(tmp_path: Path, point: str) -> None:
    """An interrupted save at each step, then a user's own folder under each name the
    protocol uses that is free: the next load recovers the path (or leaves it, where
    recovery would need the user's folder's name, saying so on the next save) and never
    touches the user's folder."""
    for name in ("ck.old", "ck.partial"):
        root = tmp_path / name.replace(".", "_")
        ck_path = root / "ck"
        _save(ck_path, 1)
        _interrupted(ck_path, 2, point)
        user = root / name
        if user.exists():  # the protocol's own folder is there: the user's cannot be
            continue
        _user_copy(ck_path if ck_path.exists() else root / "ck.partial", user)
        try:
            got, said = _load(ck_path)
        except ck.CheckpointError as e:  # recovery needs the user's folder's name
            assert name in str(e) and "move it away" in str(e), e
        else:
            want = _state(STEPS[point])["model"]
            assert all(torch.equal(got[k], want[k]) for k in want), (point, name, said)
        assert _intact(user), (point, name)


def test_a_symlinked_path_is_followed_by_save_and_load(tmp_path: Path) -> None:
    real = tmp_path / "step_100"
    _save(real, 1)
    link = tmp_path / "latest"
    link.symlink_to("step_100")
    assert _holds(link, 1)
    _save(link, 2)  # before the fix: OSError: Cannot call rmtree on a symbolic link
    assert link.is_symlink() and os.readlink(link) == "step_100"
    assert _holds(link, 2) and _holds(real, 2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_100"]
    _save(link, 3)
    assert _holds(link, 3)
    # An interrupted save through the link is recovered through the link.
    _interrupted(link, 4, "renamed-old")
    assert not real.exists() and (tmp_path / "step_100.partial").is_dir()
    _, said = _load(link)
    assert any("moved it to" in s for s in said) and _holds(real, 4)


def test_a_trailing_separator_names_the_folder(tmp_path: Path) -> None:
    _save(str(tmp_path / "ck") + "/", 1)
    _save(str(tmp_path / "ck") + "/", 2)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    inside = os.listdir(tmp_path / "ck")
    assert not any(n in (".partial", ".old") for n in inside), inside
    assert _holds(str(tmp_path / "ck") + "/", 2)
