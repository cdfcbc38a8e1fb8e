"""Odd and hostile input found by fuzzing (issue 11): each gives a finding or an error with
a code, never a traceback, a hang or unbounded memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardspec.cli import main
from shardspec.runtime import hf as hfmod
from shardspec.runtime.hf import HFError
from shardspec.textfile import read_text

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


def _safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(path))


@pytest.mark.parametrize("name", [hfmod.SINGLE, hfmod.INDEX])
def test_checkpoint_files_linked_out_of_the_folder_are_refused(tmp_path: Path, name: str) -> None:
    """Index entries pointing outside were refused, but a single-file checkpoint (or the
    index itself) linked out of the folder was read."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if name == hfmod.SINGLE:
        _safetensors(outside / "secret.safetensors")
        (ckpt / name).symlink_to(outside / "secret.safetensors")
    else:
        _safetensors(ckpt / "model-1.safetensors")
        (outside / "index.json").write_text('{"weight_map": {"w": "model-1.safetensors"}}')
        (ckpt / name).symlink_to(outside / "index.json")
    with pytest.raises(HFError, match="points outside the checkpoint directory"):
        hfmod._weight_map(str(ckpt), {})
    # the same files inside the folder are read
    (ckpt / name).unlink()
    if name == hfmod.SINGLE:
        _safetensors(ckpt / name)
        assert hfmod._weight_map(str(ckpt), {})[0] == {"w": hfmod.SINGLE}
    else:
        (ckpt / name).write_text('{"weight_map": {"w": "model-1.safetensors"}}')
        assert hfmod._weight_map(str(ckpt), {}) == ({"w": "model-1.safetensors"}, [])
