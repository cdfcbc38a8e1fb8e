"""The benchmark's synthetic model (bench/synth.py) stays a valid, lint-clean spec and
manifest, with and without its hf block and HF manifest, so ``python -m
bench.bench_compiler`` measures clean runs and cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import synth
from shardspec.cli import main
from shardspec.inputs.hfmanifest import dump_hf_manifest, load_hf_manifest
from shardspec.inputs.manifest import load_manifest


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[synth.Config, Path]:
    cfg = synth.config_for(200)
    return cfg, synth.write(cfg, tmp_path_factory.mktemp("synth"))


def test_manifest_is_valid_and_sized(small: tuple[synth.Config, Path]) -> None:
    cfg, spec = small
    m = load_manifest(spec.with_name("moe.manifest.json"))
    assert len(m.params) == cfg.n_params
    assert 150 <= cfg.n_params <= 300
    assert m.factory_args == {"ep": cfg.ep}
    names = {e.fqn for e in m.entries}
    last = cfg.layers - 1
    for proj in ("gate", "up", "down"):
        fqn = f"model.layers.{last}.mlp.experts.{cfg.experts_per_rank - 1}.{proj}_proj.weight"
        assert fqn in names
    assert {e.kind for e in m.entries} == {"param", "buffer", "extra_state"}


def test_lints_clean(small: tuple[synth.Config, Path], capsys: pytest.CaptureFixture) -> None:
    _, spec = small
    assert main(["lint", "--format", "json", str(spec)]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_compiles(small: tuple[synth.Config, Path], tmp_path: Path) -> None:
    cfg, spec = small
    assert main(["compile", str(spec), "-o", str(tmp_path)]) == 0
    text = (tmp_path / "moe.py").read_text(encoding="utf-8")
    # One PARAMS row for every routed expert of every MoE layer (the table is folded).
    layers = f"{{{cfg.first_dense}..{cfg.layers - 1}}}"
    experts = f"{{0..{cfg.experts_per_rank - 1}}}"
    assert f'"model.layers.{layers}.mlp.experts.{experts}.down_proj.weight"' in text


@pytest.mark.parametrize("n", [1_000, 10_000, 100_000])
def test_config_sizes(n: int) -> None:
    cfg = synth.config_for(n)
    assert abs(cfg.n_params - n) / n < 0.05
    assert len(synth.manifest_entries(cfg)) > cfg.n_params  # plus buffers and extra state
    assert cfg.dp_shard * cfg.ep * cfg.tp == cfg.world


@pytest.mark.parametrize("with_file", [True, False])
def test_hf_variant_lints_clean(
    small: tuple[synth.Config, Path], with_file: bool, capsys: pytest.CaptureFixture
) -> None:
    cfg, spec = small
    hf_spec = synth.write_hf(cfg, spec.parent, hf_manifest=with_file)
    assert main(["lint", "--format", "json", str(hf_spec)]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_hf_manifest_is_canonical_and_complete(small: tuple[synth.Config, Path]) -> None:
    cfg, spec = small
    synth.write_hf(cfg, spec.parent)
    path = spec.with_name("moe.hf.json")
    hfm = load_hf_manifest(path)
    tensors = {
        k: {"shape": list(t.shape), "dtype": t.dtype, "file": t.file}
        for k, t in hfm.tensors.items()
    }
    canonical = dump_hf_manifest({"config": hfm.config, "tensors": tensors})
    assert path.read_text(encoding="utf-8") == canonical
    assert len(hfm.tensors) == cfg.n_units  # the router's buffer is a unit too
    last = f"model.layers.{cfg.layers - 1}.mlp.experts.{cfg.experts - 1}.down_proj.weight"
    assert hfm.tensors[last].shape == (cfg.hidden, cfg.moe_ffn)
    assert hfm.config["n_routed_experts"] == cfg.experts
