"""A Hugging Face tensor stored in the model's own grouped layout: transformers' own
GptOssForCausalLM (stacked experts whose ``gate_up_proj`` ``[expert, hidden, 2F]`` and its
bias interleave gate and up: gate ``[..., ::2]``, up ``[..., 1::2]``), built from a tiny
config and used as it is, through ``specs/gpt_oss.shard`` (``fuse ffn as 32 groups of gate
1, up 1`` and ``grouped`` split lines).

On 1 rank and on 4 gloo ranks (dp_shard 2 x tp 2: gate/up cut per component over tp,
each rank reading its groups' strided columns; and dp_shard 2 x ep 2), ``load_hf`` gives
every parameter and buffer of transformers' own ``from_pretrained`` bitwise,
``export_hf`` writes the original files bitwise, and ``from_pretrained`` of the export
gives the original's logits.

The natural spec without ``grouped`` (issue 20's silent wrong load) is now an SS082 lint
error; compiled anyway (the finding suppressed), it loads every gate_up parameter wrong
while its round trip is bitwise, which is what the owner comparison above catches.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from shardspec.testing import run_ranks
from tests import hf_grouped_scenarios
from tests.hf_grouped_scenarios import GroupedCase
from tests.test_hf import _randomize
from tests.test_hf_split import shardspec

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
GATE_UP = "model.layers.{i}.mlp.experts.gate_up_proj"
GATE_UP_BIAS = "model.layers.{i}.mlp.experts.gate_up_proj_bias"
# Every gate_up tensor of the model: what a contiguous read gets wrong.
INTERLEAVED = sorted(name.format(i=i) for name in (GATE_UP, GATE_UP_BIAS) for i in range(2))


def spec_text(edits: list[tuple[str, str]]) -> str:
    """specs/gpt_oss.shard with ``edits`` (every occurrence of each old text)."""
    text = (REPO / "specs" / "gpt_oss.shard").read_text(encoding="utf-8")
    for old, new in edits:
        assert old in text, f"specs/gpt_oss.shard changed: {old!r} not found"
        text = text.replace(old, new)
    return text


def natural_edits(suppress: bool) -> list[tuple[str, str]]:
    """The natural spec: identity split lines without ``grouped`` (with ``suppress``, its
    SS082 silenced so that it compiles)."""
    tail = "   # shardspec: ignore[SS082]" if suppress else ""
    return [(f"{t} -> {t} grouped\n", f"{t} -> {t}{tail}\n") for t in (GATE_UP, GATE_UP_BIAS)]


# Expert parallelism instead of tp: whole experts over ep, the fused dimension whole.
EP = [
    ("    tp: 2\n", "    ep: 2\n"),
    ("    shard ffn over tp\n", "    shard expert over ep\n"),  # the three expert tensors
    ("    shard vocab over tp\n", ""),  # the embedding and the head: FSDP only
    ("    style colwise output replicate", "   "),
    (
        "param model.embed_tokens.weight [vocab, hidden] {\n}",
        "param model.embed_tokens.weight [vocab, hidden] {}",
    ),
]


def variant(gen: Path, name: str, edits: list[tuple[str, str]]) -> None:
    """specs/gpt_oss.shard with ``edits``, linted clean and compiled to ``gen/<name>.py``."""
    (gen / f"{name}.shard").write_text(spec_text(edits), encoding="utf-8")
    shardspec("lint", str(gen / f"{name}.shard"))
    shardspec("compile", str(gen / f"{name}.shard"), "-o", str(gen))


def checkpoint(root: Path, name: str, seed: int) -> Any:
    """transformers' tiny GptOss with random values, saved to ``root/name``; and the folder
    ``root/gen`` for spec variants, with the example spec's manifests."""
    from examples.models import hf as hfm

    model = hfm.gpt_oss_tiny()
    _randomize(model, seed)
    model.save_pretrained(root / name)
    (root / "gen").mkdir(exist_ok=True)
    for f in ("gpt_oss.manifest.json", "gpt_oss.hf.json"):
        shutil.copy(REPO / "specs" / f, root / "gen" / f)
    return model


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hf_grouped")
    checkpoint(root, "gpt_oss", 5)
    gen = root / "gen"
    variant(gen, "gpt_oss_natural", natural_edits(suppress=True))
    variant(gen, "gpt_oss_ep", EP)
    one = run_ranks(hf_grouped_scenarios.run_all, 1, str(root), CASES1, timeout=600)
    four = run_ranks(hf_grouped_scenarios.run_all, 4, str(root), CASES4, timeout=600)
    return {"one": one, "four": four}


S1 = (("tp", 1),)
S2 = (("tp", 2),)
GOOD1 = [GroupedCase("generated.gpt_oss", S1)]
GOOD4 = [GroupedCase("generated.gpt_oss", S2), GroupedCase("gpt_oss_ep", (("ep", 2),))]
NATURAL1 = [GroupedCase("gpt_oss_natural", S1)]
NATURAL4 = [GroupedCase("gpt_oss_natural", S2)]
CASES1 = GOOD1 + NATURAL1
CASES4 = GOOD4 + NATURAL4


def _items(results: dict, case: GroupedCase) -> list:
    ranks = results["one"] if case in CASES1 else results["four"]
    return [r[case.label] for r in ranks]


@pytest.mark.parametrize("case", GOOD1 + GOOD4, ids=lambda c: c.label)
def test_load_equals_the_owner_and_the_export_the_original(
    results: dict, case: GroupedCase
) -> None:
    items = _items(results, case)
    fails = [f for it in items for f in it.fail]
    assert not fails, "\n".join(fails)
    for it in items:
        assert it.extra["differ"] == [], it.extra["differ"]
        assert it.checked > 30  # every parameter and buffer
    assert items[0].extra["logits equal"] is True
    if len(items) > 1:
        assert sum(1 for it in items if it.extra["written"]) >= 2, "one writer did it all"


@pytest.mark.parametrize("case", NATURAL1 + NATURAL4, ids=lambda c: c.label)
def test_the_natural_spec_loads_gate_up_wrong_and_round_trips_bitwise(
    results: dict, case: GroupedCase
) -> None:
    """Without ``grouped``, every gate_up tensor differs from the owner's on every rank,
    while the export is bitwise the original and its logits equal: a round-trip test
    alone would pass it. (This is the comparison that makes the tests above able to fail.)"""
    items = _items(results, case)
    fails = [f for it in items for f in it.fail]
    assert not fails, "\n".join(fails)
    for it in items:
        assert it.extra["differ"] == INTERLEAVED
    assert items[0].extra["logits equal"] is True


def test_lint_rejects_the_natural_spec(tmp_path: Path) -> None:
    """SS082 on both gate_up lines, with the way out; the committed spec lints clean."""
    import contextlib
    import io

    from shardspec import cli

    for f in ("gpt_oss.manifest.json", "gpt_oss.hf.json"):
        shutil.copy(REPO / "specs" / f, tmp_path / f)
    spec = tmp_path / "natural.shard"
    spec.write_text(spec_text(natural_edits(suppress=False)), encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["lint", str(spec)])
    text = err.getvalue()
    assert rc == 1, text
    assert text.count("error SS082") == 2 and "2 error(s)" in text, text
    assert f"`{GATE_UP} -> {GATE_UP} grouped`" in text
    assert "drop the groups: `fuse ffn as gate 32, up 32`" in text
    assert cli.main(["lint", str(REPO / "specs" / "gpt_oss.shard")]) == 0


def test_explain_shows_each_group_s_rows() -> None:
    import contextlib
    import io

    from shardspec import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["explain", str(REPO / "specs" / "gpt_oss.shard"), GATE_UP.format(i=1)])
    assert rc == 0
    assert (
        "experts.gate_up_proj.up [4, 64, 32] <- model.layers.1.mlp.experts.gate_up_proj"
        "[1:2 of each of 32 groups of 2 of dim 2] [4, 64, 64]" in out.getvalue()
    ), out.getvalue()
