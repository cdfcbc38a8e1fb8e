"""Hints that point the right way (issue 23.4): SS031's hints name only lines the rule
holds and propose edits tried on the layout arithmetic, and SS010 names the ``-D world=``
that fits a ``-D`` override. Each test applies the hint's edits and lints again: the
finding must be gone (a hint that points the wrong way fails here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_checks import _cli

REPO = Path(__file__).resolve().parents[1]
EDIT = re.compile(
    r"(?:drop `(?P<drop>[^`]+)` and |`(?P<old>[^`]+)` becomes `(?P<new>[^`]+)` and )?"
    r"add `(?P<add>[^`]+)`"
)


def _spec(name: str, tmp: Path, edit: tuple[str, str]) -> Path:
    """specs/NAME.shard with ``edit`` made, its manifest and hf files by absolute path."""
    text = (REPO / "specs" / f"{name}.shard").read_text(encoding="utf-8")
    text = re.sub(
        r'(?m)^(manifest|hf) "([^"]+)"', lambda m: f'{m[1]} "{REPO / "specs" / m[2]}"', text
    )
    assert edit[0] in text
    path = tmp / f"{name}.shard"
    path.write_text(text.replace(*edit, 1), encoding="utf-8")
    return path


def _findings(path: Path, *args: str) -> list[dict]:
    _rc, out, err = _cli(["lint", "--format", "json", *args, str(path)])
    return json.loads(out) if out.strip() else [{"code": c} for c in re.findall(r"(SS\d{3}) ", err)]


def _one(findings: list[dict], code: str) -> dict:
    hits = [f for f in findings if f["code"] == code]
    assert len(hits) == 1, findings
    return hits[0]


def _apply(text: str, line: int, way: re.Match) -> str:
    """The spec with one way out of the hint made in the rule at ``line`` (1-based): a
    line the hint names is replaced or dropped (it must be there), a line added before
    the rule's closing brace."""
    lines = text.splitlines(keepends=True)
    start = max(i for i in range(line) if lines[i].startswith("param "))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("}"))
    rule = "".join(lines[start:end])
    for named in (way["drop"], way["old"]):
        if named is not None:
            assert f"    {named}\n" in rule, f"the hint names `{named}`, which the rule lacks"
    if way["drop"]:
        rule = rule.replace(f"    {way['drop']}\n", "")
    if way["old"]:
        rule = rule.replace(f"    {way['old']}\n", f"    {way['new']}\n")
    rule += f"    {way['add']}\n"
    return "".join([*lines[:start], rule, *lines[end:]])


def _fixed_by_each_way(path: Path, finding: dict) -> list[str]:
    """Every way out the hint proposes, each made in turn: the ones that leave SS031."""
    ways = list(EDIT.finditer(finding["hint"]))
    assert ways, finding["hint"]
    text = path.read_text(encoding="utf-8")
    left = []
    for way in ways:
        path.write_text(_apply(text, finding["line"], way), encoding="utf-8")
        if any(f["code"] == "SS031" for f in _findings(path)):
            left.append(way[0])
    path.write_text(text, encoding="utf-8")
    return left


def test_phi3_gqa_under_fsdp_hint_moves_fsdp_to_hidden(tmp_path: Path) -> None:
    """specs/phi3.shard without `shard hidden over dp_shard`: FSDP's default cuts q 64,
    k 32, v 32 each over dp_shard. The hint said `replicate dp_shard` instead of a
    `shard qkv over dp_shard` the rule does not hold, and not the fix that works; now it
    proposes `shard hidden over dp_shard` first, and every way it proposes works."""
    path = _spec(
        "phi3",
        tmp_path,
        ("    replicate tp\n    shard hidden over dp_shard\n", "    replicate tp\n"),
    )
    f = _one(_findings(path), "SS031")
    assert "FSDP shards the first dimension 'qkv' over 'dp_shard' by default" in f["hint"]
    assert "shard qkv over dp_shard" not in f["hint"]
    assert "local dp_shard" not in f["hint"]  # (Megatron's local shards are for tp)
    assert next(EDIT.finditer(f["hint"]))["add"] == "shard hidden over dp_shard"
    assert _fixed_by_each_way(path, f) == []


def test_gpt2_fused_bias_hint_keeps_it_whole_over_fsdp(tmp_path: Path) -> None:
    """specs/gpt2.shard's c_attn.bias ([qkv], per component over tp) without `replicate
    dp_shard`: the hint said "add another dimension" to a 1-D tensor; now it says the
    tensor has no other and proposes `replicate dp_shard`, which works."""
    line = "    replicate dp_shard   # tp already cuts it per component: FSDP would cut it again\n"
    path = _spec("gpt2", tmp_path, (line, ""))
    f = _one(_findings(path), "SS031")
    assert "another dimension" not in f["hint"]
    assert "'qkv' is the tensor's only dimension" in f["hint"]
    assert [w["add"] for w in EDIT.finditer(f["hint"])] == ["replicate dp_shard"]
    assert _fixed_by_each_way(path, f) == []


def test_fused_dim_stated_over_two_axes_hint_edits_that_line(tmp_path: Path) -> None:
    """The bias stating `shard qkv over (tp, dp_shard)`: the hint names that line and
    what it becomes, and the edit works."""
    old = "    shard qkv over tp\n    replicate dp_shard   # tp already cuts it per component"
    path = _spec("gpt2", tmp_path, (old, "    shard qkv over (tp, dp_shard)\n    #"))
    f = _one(_findings(path), "SS031")
    way = next(EDIT.finditer(f["hint"]))
    assert (way["old"], way["new"], way["add"]) == (
        "shard qkv over (tp, dp_shard)",
        "shard qkv over tp",
        "replicate dp_shard",
    )
    assert _fixed_by_each_way(path, f) == []


@pytest.mark.parametrize("override", ["tp=8", "tp=3"])
def test_override_beyond_the_specs_world_names_the_world(override: str) -> None:
    """`lint -D tp=8` on a spec `over 4 ranks` failed with SS010 saying only "give the
    world size"; the hint now names the `-D world=` that fits (keeping the rest axis's
    size, or the smallest), and linting with it has no SS010."""
    spec = str(REPO / "specs" / "gpt2.shard")
    f = _one(_findings(Path(spec), "-D", override), "SS010")
    worlds = re.findall(r"`-D world=(\d+)`", f["hint"])
    tp = int(override.split("=")[1])
    assert worlds == [str(2 * tp), str(tp)], f["hint"]
    assert f"`-D {override}`" in f["hint"]
    for w in worlds:
        assert "SS010" not in {
            x["code"] for x in _findings(Path(spec), "-D", override, "-D", f"world={w}")
        }
