"""JSON that Python cannot read (a number of more digits than ``int`` reads, nesting too
deep, bytes that are not UTF-8) is one line that names the file and the cause, wherever it
is read: :mod:`shardspec.core.jsontext` and the runtime's readers of an HF checkpoint's
index and config.json and of a checkpoint's ``.shardspec.json``; and ``shardspec manifest
--arg`` refuses a number it cannot pass on as written."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from shardspec.cli import main
from shardspec.core.jsontext import INT_DIGITS, JSONTextError, loads, read_json
from shardspec.inputs.manifest_build import ManifestBuildError, parse_arg
from shardspec.runtime.checkpoint import folders
from shardspec.runtime.hf import HFError
from shardspec.runtime.hf.common import weight_map_of
from shardspec.runtime.hf.export import _check_config, _config_ties
from shardspec.runtime.units import CheckpointError

LONG = "9" * (INT_DIGITS + 700)  # json.loads raises a bare ValueError for it
PYTHONS_WORDS = "set_int_max_str_digits"


def _one_line_naming(message: str, path: Path) -> None:
    assert "\n" not in message and str(path) in message, message
    assert PYTHONS_WORDS not in message and "digits" in message, message
    assert len(message) < 400, message


def test_loads_says_which_number_and_where() -> None:
    with pytest.raises(JSONTextError) as e:
        loads('{"a": 1,\n  "b": ' + LONG + "}")
    assert (e.value.line, e.value.col) == (2, 8)
    assert e.value.reason == f"a number of {len(LONG)} digits (Python reads at most {INT_DIGITS})"
    with pytest.raises(JSONTextError, match="nested too deeply"):
        loads("[" * 100_000 + "]" * 100_000)
    with pytest.raises(JSONTextError) as e:
        loads('{"a": }')
    assert (e.value.reason, e.value.line, e.value.col) == ("Expecting value", 1, 7)
    assert loads('{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}


def test_read_json(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(JSONTextError, match="byte 7 is not UTF-8"):
        read_json(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "missing.json")
    (tmp_path / "bom.json").write_bytes(b'\xef\xbb\xbf{"a": 1}')
    assert read_json(tmp_path / "bom.json") == {"a": 1}


def test_an_hf_index_with_a_long_number(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"metadata": {"total_size": ' + LONG + '}, "weight_map": {}}')
    with pytest.raises(HFError) as e:
        weight_map_of(str(tmp_path), {})
    _one_line_naming(str(e.value), index)
    assert "line 1, column 29" in str(e.value)


def test_a_config_json_with_a_long_number(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"tie_word_embeddings": true, "vocab_size": ' + LONG + "}")
    with pytest.raises(HFError) as e:
        _check_config(str(config))
    _one_line_naming(str(e.value), config)
    with pytest.raises(HFError) as e:  # the folder holding it, as export_hf takes it
        _check_config(str(tmp_path))
    _one_line_naming(str(e.value), config)
    config.write_text('{"tie_word_embeddings": true}')
    _check_config(str(tmp_path))
    assert _config_ties(str(tmp_path)) is True


def test_a_checkpoint_marker_with_a_long_number(tmp_path: Path) -> None:
    """A completion marker that cannot be read was taken for no marker: the load went on
    as for a checkpoint of DCP's own, without the checksum the marker records."""
    marker = tmp_path / folders.MARKER
    marker.write_text('{"format": "shardspec-checkpoint/1", "inode": ' + LONG + "}")
    with pytest.raises(CheckpointError) as e:
        folders._read_marker(str(tmp_path))
    _one_line_naming(str(e.value), marker)
    assert "nothing was read" in str(e.value)
    marker.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="is not a JSON object"):
        folders._read_marker(str(tmp_path))
    marker.write_text(json.dumps({"format": "shardspec-checkpoint/1"}))
    assert folders._read_marker(str(tmp_path)) == {"format": "shardspec-checkpoint/1"}
    marker.unlink()
    assert folders._read_marker(str(tmp_path)) is None  # a checkpoint of DCP's own
    # a damaged marker never proves that shardspec made the folder
    marker.write_text('{"inode": ' + LONG + "}")
    assert not folders._owned(str(tmp_path), folders.MARKER)


# ------------------------------------------------------------------ shardspec manifest --arg


def _manifest(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["manifest", *argv])
    return status, out.getvalue() + err.getvalue()


@pytest.mark.parametrize("digits", ["9" * 5000, "9" * 20, "-" + "9" * 5000, "+" + "9" * 19])
def test_a_whole_number_too_large_is_ss006(digits: str) -> None:
    """A number of over 4,300 digits became float('inf'), passed to the factory; one of
    20 digits became an int no tensor size can be."""
    with pytest.raises(ManifestBuildError) as e:
        parse_arg(f"n={digits}")
    assert e.value.code == "SS006" and "number too large" in str(e.value)
    assert len(str(e.value)) < 400


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999", "9" * 5000 + ".5"])
def test_a_number_that_is_not_finite_is_refused(value: str) -> None:
    with pytest.raises(ManifestBuildError) as e:
        parse_arg(f"x={value}")
    assert e.value.code == "SS004" and "is not a finite number" in str(e.value)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("n=2", 2),
        ("n=-3", -3),
        ("n= 007 ", 7),
        ("n=9223372036854775807", 2**63 - 1),
        ("n=1_000", 1000),
        ("n=0.5", 0.5),
        ("n=True", True),
        ("n=abc", "abc"),
        ("n=", ""),
        ("n=" + "0" * 5000 + "5", 5),
    ],
)
def test_arguments_as_before(text: str, value: object) -> None:
    name, got = parse_arg(text)
    assert name == "n" and got == value and type(got) is type(value)


def test_the_command_reports_a_long_number(tmp_path: Path) -> None:
    status, out = _manifest(
        "examples.models.llama:tiny", "--arg", "n=" + "9" * 5000, "-o", str(tmp_path / "m.json")
    )
    assert status == 2 and "SS006" in out and "number too large" in out, out
    assert "unexpected keyword" not in out and not (tmp_path / "m.json").exists()
    assert len(out) < 2000
