"""Axis aliases (`dp_shard: * aka fsdp`): one spec verifies, saves and loads a model whose
DeviceMesh calls an axis as the trainer does (both torchtitan spellings of the FSDP axis),
and a mesh that uses neither name is refused naming the axis and the spec's axes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardspec.api import compile_specs
from shardspec.frontend.parse import parse
from shardspec.resolve.params import MeshError, axis_aliases
from tests import alias_scenarios as sc

ROOT = Path(__file__).resolve().parent.parent
AKA = "dp_shard: * aka fsdp   "


def _compile(tmp_path: Path, aka: bool = True) -> str:
    """specs/llama.shard, with ``aka fsdp`` on its FSDP axis (or as it is), compiled."""
    for name in ("llama.manifest.json", "llama.hf.json"):
        shutil.copy(ROOT / "specs" / name, tmp_path / name)
    text = (ROOT / "specs" / "llama.shard").read_text()
    assert "dp_shard: *   " in text
    if aka:
        text = text.replace("dp_shard: *   ", AKA, 1)
    spec = tmp_path / "llama_aka.shard"
    spec.write_text(text)
    out = compile_specs([str(spec)], str(tmp_path / "gen"))
    assert not out.errors, [str(d) for d in out.diagnostics]
    return str(tmp_path / "gen" / "llama_aka.py")


def _aliases(mesh: str) -> dict[str, str]:
    spec, diags = parse(f"mesh {{ {mesh} }}\n", "x.shard")
    assert spec is not None, diags
    return axis_aliases(spec)


def test_aka_parses_one_or_more_names() -> None:
    assert _aliases("dp_shard: * aka fsdp tp: 2") == {"fsdp": "dp_shard"}
    assert _aliases("dp_shard: * aka fsdp, dp_shard_cp  tp: 2 aka mp") == {
        "fsdp": "dp_shard",
        "dp_shard_cp": "dp_shard",
        "mp": "tp",
    }
    assert _aliases("dp_shard: *  tp: 2") == {}


@pytest.mark.parametrize(
    "mesh, says",
    [
        ("dp_shard: * aka tp  tp: 2", "already calls an axis 'tp'"),
        ("dp_shard: * aka x  tp: 2 aka x", "already calls an axis 'x'"),
    ],
)
def test_an_alias_that_names_another_axis_is_refused(mesh: str, says: str) -> None:
    with pytest.raises(MeshError, match=says):
        _aliases(mesh)


def test_aliases_in_views_are_refused() -> None:
    spec, _ = parse("mesh dense { fsdp: * aka dp_shard  tp: 2 }\n", "x.shard")
    assert spec is not None
    with pytest.raises(MeshError, match="one unnamed mesh only"):
        axis_aliases(spec)


def test_lint_reports_a_bad_alias_at_the_mesh(tmp_path: Path) -> None:
    spec = tmp_path / "bad.shard"
    spec.write_text("mesh over 4 ranks {\n    dp_shard: * aka tp\n    tp: 2\n}\n")
    out = compile_specs([str(spec)], str(tmp_path / "gen"))
    codes = [d.code for d in out.diagnostics if d.is_error]
    assert codes == ["SS010"], [str(d) for d in out.diagnostics]
    assert "already calls an axis 'tp'" in str(out.diagnostics[0])


def test_the_module_records_its_aliases(tmp_path: Path) -> None:
    text = Path(_compile(tmp_path)).read_text()
    assert 'AXIS_ALIASES: dict[str, str] = {"fsdp": "dp_shard"}' in text
    assert "    aliases=AXIS_ALIASES,\n" in text
    assert "AXIS_ALIASES" not in (ROOT / "generated" / "llama.py").read_text()


@pytest.mark.dist
def test_both_torchtitan_spellings_verify_save_and_load(tmp_path: Path) -> None:
    from shardspec.testing import run_ranks

    path = _compile(tmp_path)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    ranks = run_ranks(sc.run_all, 4, path, str(folder), str(tmp_path))
    for got in (r["save_and_load"] for r in ranks):
        assert got["dp_shard:axes"] == ("dp_shard", "tp")
        assert got["fsdp:axes"] == ("fsdp", "tp")  # the trainer's own mesh, as it is
        for move in ("dp_shard->fsdp", "fsdp->dp_shard"):
            assert got[move] == [], move
            assert got[f"{move}:keys"] > 10
    for got in (r["unknown_axis"] for r in ranks):
        for what, message in got.items():
            assert "'data' is neither an axis of spec 'llama_aka' nor an alias" in message, what
            assert "dp_shard (aka fsdp), tp" in message, what
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()
