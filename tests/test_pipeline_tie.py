"""Weights tied across pipeline stages on 4 gloo ranks (scenarios in
tests/pipeline_tie_scenarios.py), through specs/llama_pp_tied.shard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.models import llama
from shardspec.testing import run_ranks
from tests import pipeline_tie_scenarios

REPO = Path(__file__).resolve().parents[1]

# Checks each scenario must make on every rank (a scenario that checks nothing fails).
MIN_CHECKS = {
    "train": 2 + 13 + 2 + 1,  # stage contents, every parameter, copies, the control
    "reshard": 3 + 2 * (13 + 1 + 13 + 1),
    "broadcast": 2 * 2,
    "errors": 3 * 2,
}


@pytest.mark.dist
def test_tied_pipeline_on_4_ranks() -> None:
    results = run_ranks(pipeline_tie_scenarios.run_all, 4, timeout=240)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, counts) in enumerate(results):
        for tag, least in MIN_CHECKS.items():
            assert counts.get(tag, 0) >= least, f"rank {rank}: {tag} made {counts.get(tag)}"


# ------------------------------------------------ a manifest that lists the tie's alias


def tied_as_transformers_ties(n_layers: int = 4) -> torch.nn.Module:
    """The 4-layer llama tied as transformers ties (the head's weight *is* the embedding's),
    not initialized: the factory ``shardspec manifest`` builds on the meta device."""
    model = llama.tiny(n_layers=n_layers)
    model.output.weight = model.tok_embeddings.weight
    return model


class _StubMesh:
    """What the runtime asks of a DeviceMesh here: axis names, sizes, this rank's place."""

    mesh_dim_names = ("pp", "dp_shard", "tp")

    def __init__(self, pp: int, stage: int) -> None:
        self.shape = (pp, 1, 1)
        self.coord = (stage, 0, 0)

    def get_coordinate(self) -> tuple[int, ...]:
        return self.coord


def test_a_manifest_listing_the_alias_tied_to_the_source(tmp_path: Path) -> None:
    """``shardspec manifest`` of a model tied as transformers ties lists the head's weight
    too, ``tied_to`` the embedding: specs/llama_pp_tied.shard lints clean on it (it was
    SS097, "a parameter of its own"), compiles, and the module places the tie as with the
    manifest that lists the weight once: the alias is no parameter of its own, the last
    stage's copy is stored under the source's name, and split_stage cuts the tied model."""
    import importlib
    import json
    import sys

    from shardspec.core.layout import Mesh
    from shardspec.runtime.units import canonical_plan

    manifest = tmp_path / "tied.manifest.json"
    _cli("manifest", "tests.test_pipeline_tie:tied_as_transformers_ties", "-o", str(manifest))
    entries = {e["fqn"]: e for e in json.loads(manifest.read_text())["entries"]}
    assert entries["output.weight"]["tied_to"] == "tok_embeddings.weight"
    text = (REPO / "specs" / "llama_pp_tied.shard").read_text(encoding="utf-8")
    old = 'manifest "llama_pp_tied.manifest.json"'
    assert old in text, "specs/llama_pp_tied.shard changed"
    spec = tmp_path / "tied_listed.shard"
    spec.write_text(text.replace(old, 'manifest "tied.manifest.json"'), encoding="utf-8")
    said = _cli("lint", str(spec))
    assert said.strip() == "shardspec lint: 1 spec(s) checked, no findings", said
    _cli("compile", str(spec), "-o", str(tmp_path))
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module("tied_listed")
    finally:
        sys.path.remove(str(tmp_path))
    assert "output.weight" in mod.PARAMS  # listed, as the manifest does
    for pp in (1, 2, 4):
        sp = mod.SPEC.stage_plan(Mesh(("pp", "dp_shard", "tp"), (pp, 1, 1)))
        assert "output.weight" not in sp.stage and sp.tie_stage == {"output.weight": pp - 1}
        assert sp.stages_of("tok_embeddings.weight") == tuple(sorted({0, pp - 1}))
    # The last of 2 stages, cut from the tied model: its copy is the source's unit.
    model = tied_as_transformers_ties()
    mod.split_stage(model, _StubMesh(2, 1), 1)
    assert model.tok_embeddings is None and model.output is not None
    flat = {k: v.detach() for k, v in model.state_dict().items()}
    lm = Mesh(("pp", "dp_shard", "tp"), (2, 1, 1))
    plan, rest, _ = canonical_plan(mod.SPEC, lm, 1, flat)
    units = {u.key for u in plan.units}
    assert "tok_embeddings.weight" in units and "output.weight" not in units
    assert not rest


def _cli(*args: str) -> str:
    import contextlib
    import io

    from shardspec.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(args))
    assert code == 0, out.getvalue()
    return out.getvalue()
