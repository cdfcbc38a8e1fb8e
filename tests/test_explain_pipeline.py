"""``shardspec explain`` on a spec with a pipeline block (specs/llama_pp.shard: pp 2,
dp_shard 2, tp 2 over 8 ranks; 4 layers): the parameter's stage, why it is there, and only
the ranks of that stage in the table."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from shardspec.cli import main

SPEC = "specs/llama_pp.shard"
ROW = re.compile(r"^\s+(\d+)\s+\(")


def explain(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    status = main(["explain", *argv])
    out, err = capsys.readouterr()
    assert status == 0 and err == "", err
    assert "Traceback" not in out
    return out


def ranks(out: str) -> list[int]:
    """The ranks of the table's rows, in order."""
    return [int(m[1]) for m in map(ROW.match, out.splitlines()) if m]


def stage_line(out: str) -> str:
    (line,) = [x for x in out.splitlines() if x.startswith("  pipeline stage:")]
    return line


def test_a_layer_on_the_second_stage(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = explain(capsys, SPEC, "layers.2.feed_forward.w13.weight")
    assert stage_line(out) == (
        "  pipeline stage: 1 of 2 on pp (layer 2 of split layers.{layer}); "
        "ranks 0-3 (other stages) hold none of it"
    )
    assert "pipeline stage: 1 of 2" in out
    assert ranks(out) == [4, 5, 6, 7]
    # the layout within the stage is the rule's, over the mesh without pp
    assert "DTensor: mesh (dp_shard, tp)" in out
    rows = {int(r.split()[0]): r.split() for r in out.splitlines() if ROW.match(r)}
    assert rows[4][1:4] == ["(1,0,0)", "[96,", "32]"]
    assert rows[7][1] == "(1,1,1)"


def test_first_and_last_stage_parameters(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = explain(capsys, SPEC, "tok_embeddings.weight")
    assert "pipeline stage: 0 of 2 on pp (first stage); ranks 4-7 (other stages)" in out
    assert ranks(out) == [0, 1, 2, 3]
    out = explain(capsys, SPEC, "layers.1.attention.wqkv.weight")
    assert "pipeline stage: 0 of 2 on pp (layer 1 of split layers.{layer})" in out
    assert ranks(out) == [0, 1, 2, 3]
    out = explain(capsys, SPEC, "output.weight")
    assert "pipeline stage: 1 of 2 on pp (last stage); ranks 0-3 (other stages)" in out
    assert ranks(out) == [4, 5, 6, 7]


def test_stages_follow_a_defined_pipeline_size(
    in_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At pp 4 each stage holds one layer over 2 ranks; the other ranks are listed."""
    out = explain(capsys, "-D", "pp=4", SPEC, "layers.2.feed_forward.w13.weight")
    assert "mesh: pp=4, dp_shard=1, tp=2" in out
    assert "pipeline stage: 2 of 4 on pp (layer 2 of split layers.{layer}); " in out
    assert "ranks 0, 1, 2, 3, 6, 7 (other stages) hold none of it" in out
    assert ranks(out) == [4, 5]


def test_local_names_are_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With `split ... local` the stage model's own name for the parameter is given."""
    repo = Path(__file__).resolve().parents[1]
    text = (repo / SPEC).read_text(encoding="utf-8")
    assert "    split layers.{layer}\n" in text
    (tmp_path / "llama_pp.shard").write_text(
        text.replace("    split layers.{layer}\n", "    split layers.{layer} local\n"), "utf-8"
    )
    shutil.copy(repo / "specs" / "llama_pp.manifest.json", tmp_path)
    monkeypatch.chdir(tmp_path)
    out = explain(capsys, "llama_pp.shard", "layers.3.feed_forward.w2.weight")
    assert (
        "pipeline stage: 1 of 2 on pp (layer 3 of split layers.{layer}; the stage model "
        "names it layers.1.feed_forward.w2.weight)"
    ) in out
    assert ranks(out) == [4, 5, 6, 7]


def test_no_pipeline_no_stage_line(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = explain(capsys, "specs/llama.shard", "layers.1.feed_forward.w13.weight")
    assert "pipeline stage" not in out
    assert ranks(out) == list(range(8))


def test_a_single_stage(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = explain(capsys, "-D", "pp=1", SPEC, "output.weight")
    assert ranks(out) == list(range(8))
    line = stage_line(out)
    assert line.startswith("  pipeline stage: 0 of 1 on pp (last stage)")
    assert "ranks  (" not in line


def test_a_weight_tied_across_stages(in_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """specs/llama_pp_tied.shard: the embedding is the output head's weight. Both stages
    hold it (every rank a shard), stored once under the source's name."""
    tied = "specs/llama_pp_tied.shard"
    out = explain(capsys, tied, "tok_embeddings.weight")
    assert stage_line(out) == (
        "  pipeline stage: 0 of 2 on pp (first stage; tied: stage 1 holds a copy as "
        "output.weight (stored once, under this name))"
    )
    assert ranks(out) == list(range(8))
    rows = {int(r.split()[0]): r.split() for r in out.splitlines() if ROW.match(r)}
    assert rows[0][2:] == rows[4][2:] and rows[3][2:] == rows[7][2:]  # the same shards
    # the alias explains as its source, saying so
    alias = explain(capsys, tied, "output.weight")
    first = alias.splitlines()[0]
    assert first.startswith("output.weight is tied to tok_embeddings.weight (pipeline tie)")
    assert alias.splitlines()[1:] == out.splitlines()
    # at pp 4 the copy is on stage 3, and the middle stages hold none of it
    out = explain(capsys, tied, "-D", "pp=4", "tok_embeddings.weight")
    assert "tied: stage 3 holds a copy as output.weight" in stage_line(out)
    assert "ranks 2-5 (other stages) hold none of it" in stage_line(out)
    assert ranks(out) == [0, 1, 6, 7]
