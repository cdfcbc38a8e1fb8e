"""``load_hf`` and ``export_hf`` per pipeline stage, on 4 gloo ranks (scenarios in
tests/hf_pipeline_scenarios.py).

specs/llama_pp.shard has no hf block: the test compiles it, with the hf block of
specs/llama.shard, by the real CLI (once as it is, once with ``split layers.{layer}
local``), and specs/llama.shard for the same 4-layer model (the unsplit reference). The
Hugging Face checkpoint is the single-process tiny Llama (4 layers) written by hand as
that hf block maps it (checked here against the hand conversion of
:mod:`examples.models.hf`), in several files with an index.

Tied weights: specs/llama_pp_tied.shard (``tie output.weight = tok_embeddings.weight`` in
its pipeline block) is compiled the same way with the hf block for a tied checkpoint
(llama.shard's without the ``lm_head.weight -> output.weight`` line, as tests/test_hf.py
does for the tied Llama; its ``tie lm_head.weight = model.embed_tokens.weight`` stays).
The tied 4-layer Llama is written as a tied checkpoint twice: without ``lm_head.weight``
(as transformers saves one) and with it, equal to the embedding.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from examples.models import hf as hfm
from examples.models import llama
from shardspec.cli import main as shardspec_main
from shardspec.testing import run_ranks
from tests import hf_pipeline_scenarios

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
N_LAYERS = hf_pipeline_scenarios.N_LAYERS
HF_KEYS = 3 + 9 * N_LAYERS  # embed, norm, lm_head; 9 per layer
HF_KEYS_TIED = HF_KEYS - 1  # a tied checkpoint: no lm_head
# The tied export: no key in two files, the embedding once and no lm_head, the index names
# each key's file; then keys, the index's keys and every tensor bitwise.
TIED_EXPORT = 3 + 2 + HF_KEYS_TIED

# Checks each scenario must make on every rank (a scenario that checks nothing fails).
MIN_CHECKS = {
    "unsplit export": HF_KEYS + 2,
    # collectives, opens, stage names, >= 13 parameters, bytes, export keys and tensors
    "pp2 global": 3 + 13 + 1 + HF_KEYS + 2,
    "pp2 local": 3 + 13 + 1 + HF_KEYS + 2,
    "pp4 local": 3 + 6 + 1 + HF_KEYS + 2,
    "pp1 global": 3 + 27 + 1 + HF_KEYS + 2,
    "pp2 tp2 bf16": 3 + 13 + 1 + HF_KEYS + 2,
    "missing key": 2 * 3,
    # Tied: per load (two checkpoints, a fresh model each): stage contents, collectives,
    # opens, stage names, bytes, every parameter, the tied weight's value where the stage
    # holds it (at pp 1 also that head and embedding stay one tensor); the export once.
    "tied pp2 split": 2 * (5 + 13 + 1) + TIED_EXPORT,
    "tied pp2 megatron": 2 * (5 + 13 + 1) + TIED_EXPORT,
    "tied pp4 split": 2 * (5 + 6) + TIED_EXPORT,  # a middle stage: one layer, no tied weight
    "tied pp4 megatron": 2 * (5 + 6) + TIED_EXPORT,
    "tied pp1 split": 2 * (5 + 26 + 2) + TIED_EXPORT,
    "tied missing": 3,
}
TIED_TAGS = ["tied pp2 split", "tied pp2 megatron", "tied pp4 split", "tied pp4 megatron"]


def to_hf(state: dict[str, torch.Tensor], cfg: llama.LlamaConfig) -> dict[str, torch.Tensor]:
    """The example Llama's state dict as LlamaForCausalLM's (by hand; the inverse of
    :func:`examples.models.hf.llama_from_hf`)."""
    out = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"],
        "model.norm.weight": state["norm.weight"],
    }
    if "output.weight" in state:  # a tied model has none (and a tied checkpoint need not)
        out["lm_head.weight"] = state["output.weight"]
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        wq, wk, wv = llama.split_wqkv(state[p + "attention.wqkv.weight"], cfg)
        gate, up = state[p + "feed_forward.w13.weight"].chunk(2)
        out |= {
            q + "input_layernorm.weight": state[p + "attention_norm.weight"],
            q + "self_attn.q_proj.weight": hfm.meta_rope_to_hf(wq, cfg.head_dim),
            q + "self_attn.k_proj.weight": hfm.meta_rope_to_hf(wk, cfg.head_dim),
            q + "self_attn.v_proj.weight": wv,
            q + "self_attn.o_proj.weight": state[p + "attention.wo.weight"],
            q + "post_attention_layernorm.weight": state[p + "ffn_norm.weight"],
            q + "mlp.gate_proj.weight": gate,
            q + "mlp.up_proj.weight": up,
            q + "mlp.down_proj.weight": state[p + "feed_forward.w2.weight"],
        }
    return {k: v.contiguous().clone() for k, v in out.items()}


def write_hf(folder: Path, tensors: dict[str, torch.Tensor], cfg: llama.LlamaConfig) -> None:
    """Three safetensors files (keys dealt round robin, so files cut across stages), an
    index and a config.json (``tie_word_embeddings`` as ``cfg.tie_embeddings``)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    files: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
    weight_map = {}
    for k, key in enumerate(sorted(tensors)):
        files[names[k % 3]][key] = tensors[key]
        weight_map[key] = names[k % 3]
    for name, part in files.items():
        save_file(part, str(folder / name), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def compile_specs(gen: Path, hf_dir: Path) -> None:
    """llama4 (specs/llama.shard on the 4-layer manifest), llama_pp_hf and
    llama_pp_hf_local (specs/llama_pp.shard plus llama.shard's hf block), by the CLI."""
    gen.mkdir(parents=True)
    shutil.copy(ROOT / "specs" / "llama_pp.manifest.json", gen / "llama4.manifest.json")
    assert shardspec_main(["hf-manifest", str(hf_dir), "-o", str(gen / "llama4.hf.json")]) == 0
    base = (ROOT / "specs" / "llama.shard").read_text(encoding="utf-8")
    found = re.findall(r'(?ms)^hf "llama\.hf\.json" \{.*?^\}\n', base)
    assert len(found) == 1, "specs/llama.shard's hf block not found"
    hf_block = found[0].replace('hf "llama.hf.json"', 'hf "llama4.hf.json"')
    flat = base.replace('manifest "llama.manifest.json"', 'manifest "llama4.manifest.json"')
    flat = flat.replace('hf "llama.hf.json"', 'hf "llama4.hf.json"')
    assert flat.count('"llama4.') == 2, "specs/llama.shard changed"
    pp = (ROOT / "specs" / "llama_pp.shard").read_text(encoding="utf-8")
    assert pp.count('manifest "llama_pp.manifest.json"') == 1, "specs/llama_pp.shard changed"
    pp = pp.replace('manifest "llama_pp.manifest.json"', 'manifest "llama4.manifest.json"')
    pp += "\n" + hf_block
    split = "    split layers.{layer}\n"
    assert pp.count(split) == 1, "specs/llama_pp.shard changed"
    local = pp.replace(split, "    split layers.{layer} local\n")
    for name, text in (("llama4", flat), ("llama_pp_hf", pp), ("llama_pp_hf_local", local)):
        (gen / f"{name}.shard").write_text(text, encoding="utf-8")
        assert shardspec_main(["compile", str(gen / f"{name}.shard"), "-o", str(gen)]) == 0, name
        out = (gen / f"{name}.py").read_text(encoding="utf-8")
        assert "def load_hf(" in out and "def export_hf(" in out, name
    assert "local_names=True" in (gen / "llama_pp_hf_local.py").read_text(encoding="utf-8")


def compile_tied(gen: Path, hf_dir: Path) -> None:
    """llama_pp_tied_hf: specs/llama_pp_tied.shard plus specs/llama.shard's hf block for a
    tied checkpoint (as tests/test_hf.py's tied Llama: no ``lm_head.weight ->
    output.weight`` line, the whole model has no ``output.weight`` unit; ``tie
    lm_head.weight = model.embed_tokens.weight`` stays), with the HF manifest of the tied
    checkpoint ``hf_dir`` (no lm_head), linted clean and compiled by the CLI."""
    shutil.copy(ROOT / "specs" / "llama_pp_tied.manifest.json", gen / "llama4_tied.manifest.json")
    assert shardspec_main(["hf-manifest", str(hf_dir), "-o", str(gen / "llama4_tied.hf.json")]) == 0
    base = (ROOT / "specs" / "llama.shard").read_text(encoding="utf-8")
    found = re.findall(r'(?ms)^hf "llama\.hf\.json" \{.*?^\}\n', base)
    assert len(found) == 1, "specs/llama.shard's hf block not found"
    hf_block = found[0].replace('hf "llama.hf.json"', 'hf "llama4_tied.hf.json"')
    head = "    lm_head.weight -> output.weight\n"  # no output.weight unit: SS078 would warn
    assert hf_block.count(head) == 1, "specs/llama.shard's hf block no longer maps lm_head"
    hf_block = hf_block.replace(head, "")
    tie = "    tie lm_head.weight = model.embed_tokens.weight"
    assert hf_block.count(tie) == 1, "specs/llama.shard's hf block no longer ties lm_head"
    pp = (ROOT / "specs" / "llama_pp_tied.shard").read_text(encoding="utf-8")
    old = 'manifest "llama_pp_tied.manifest.json"'
    assert pp.count(old) == 1, "specs/llama_pp_tied.shard changed"
    assert pp.count("    tie output.weight = tok_embeddings.weight\n") == 1, "no pipeline tie"
    pp = pp.replace(old, 'manifest "llama4_tied.manifest.json"') + "\n" + hf_block
    spec = gen / "llama_pp_tied_hf.shard"
    spec.write_text(pp, encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = shardspec_main(["lint", str(spec)])
    said = out.getvalue() + err.getvalue()
    # no finding at all (SS078 would warn): only the summary line of a clean run
    assert code == 0 and said.strip() == "shardspec lint: 1 spec(s) checked, no findings", said
    assert shardspec_main(["compile", str(spec), "-o", str(gen)]) == 0
    text = (gen / "llama_pp_tied_hf.py").read_text(encoding="utf-8")
    assert "def load_hf(" in text and "def export_hf(" in text
    assert 'ties=(("output.weight", "tok_embeddings.weight"),)' in text


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list:
    root = tmp_path_factory.mktemp("hfpp")
    cfg = llama.LlamaConfig(n_layers=N_LAYERS)
    model = llama.tiny(n_layers=N_LAYERS)
    llama.init_weights(model, seed=7)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, root / "reference.pt")
    tensors = to_hf(state, cfg)
    # The hand conversion is the oracle's inverse, bitwise.
    back = hfm.llama_from_hf(tensors, cfg)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    write_hf(root / "hf", tensors, cfg)
    write_hf(
        root / "hf-missing",
        {k: v for k, v in tensors.items() if k != hf_pipeline_scenarios.MISSING},
        cfg,
    )
    compile_specs(root / "gen", root / "hf")

    # The tied model: tok_embeddings.weight is also its head (no output.weight).
    tcfg = llama.LlamaConfig(n_layers=N_LAYERS, tie_embeddings=True)
    tied = llama.tiny_tied(n_layers=N_LAYERS)
    llama.init_weights(tied, seed=11)
    tstate = {k: v.detach().clone() for k, v in tied.state_dict().items()}
    assert "output.weight" not in tstate
    torch.save(tstate, root / "reference-tied.pt")
    ttensors = to_hf(tstate, tcfg)
    assert "lm_head.weight" not in ttensors
    back = hfm.llama_from_hf(ttensors, tcfg)
    assert set(back) == set(tstate)
    assert all(torch.equal(back[k], tstate[k]) for k in tstate)
    embed = ttensors["model.embed_tokens.weight"]
    write_hf(root / "hf-tied", ttensors, tcfg)  # as transformers saves a tied model
    write_hf(root / "hf-tied-head", ttensors | {"lm_head.weight": embed.clone()}, tcfg)
    write_hf(
        root / "hf-tied-missing",
        {k: v for k, v in ttensors.items() if k != "model.embed_tokens.weight"},
        tcfg,
    )
    compile_tied(root / "gen", root / "hf-tied")
    return run_ranks(hf_pipeline_scenarios.run_all, WORLD, str(root), timeout=240)


@pytest.mark.dist
def test_load_and_export_per_pipeline_stage(results: list) -> None:
    failures = [f"rank {r}: {msg}" for r, (fails, _, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, counts, _) in enumerate(results):
        for tag, least in MIN_CHECKS.items():
            assert counts.get(tag, 0) >= least, f"rank {rank}: {tag} made {counts.get(tag)}"


@pytest.mark.dist
@pytest.mark.parametrize(
    "tag", ["pp2 global", "pp2 local", "pp4 local", "pp1 global", "pp2 tp2 bf16"]
)
def test_each_stage_reads_its_own_bytes_and_export_spreads(results: list, tag: str) -> None:
    extras = [extra[tag] for _, _, extra in results]
    model_bytes = extras[0]["model_bytes"]
    per_stage: dict[int, list[int]] = {}
    for e in extras:
        per_stage.setdefault(e["stage"], []).append(e["bytes_read"])
        assert 0 < e["bytes_read"] <= e["stage_bytes"] <= model_bytes, e
        assert e["bytes_read"] < model_bytes, e
    n_stages = int(tag[2])
    assert sorted(per_stage) == list(range(n_stages)), per_stage
    for stage, read in per_stage.items():
        stage_bytes = next(e["stage_bytes"] for e in extras if e["stage"] == stage)
        if "tp2" in tag:
            # Norms are replicated over tp: each tp rank reads its copy.
            assert stage_bytes < sum(read) < 2 * stage_bytes, (stage, read, stage_bytes)
        else:
            # The stage's ranks together read its parameters once (no replication over dp).
            assert sum(read) == stage_bytes, (stage, read, stage_bytes)
    assert sum(e["stage_bytes"] for e in {e["stage"]: e for e in extras}.values()) == model_bytes
    written = [e["written"] for e in extras]
    assert sum(1 for w in written if w) >= 2 and max(written) < sum(written), written


@pytest.mark.dist
@pytest.mark.parametrize("tag", [*TIED_TAGS, "tied pp1 split"])
def test_tied_stages_read_their_bytes_and_export_once(results: list, tag: str) -> None:
    """The tied weight: read by the first stage and, for its copy, by the last (each
    stage's ranks together read the stage's bytes once, the tied weight included); exported
    once (the ranks' written bytes add up to the whole model's, the tied weight counted
    once), into one rank's file."""
    extras = [extra[tag] for _, _, extra in results]
    model_bytes, tied_bytes = extras[0]["model_bytes"], extras[0]["tied_bytes"]
    n_stages = int(tag.split()[1][2:])
    per_stage: dict[int, list[int]] = {}
    stage_bytes: dict[int, int] = {}
    for e in extras:
        per_stage.setdefault(e["stage"], []).append(e["bytes_read"])
        assert stage_bytes.setdefault(e["stage"], e["stage_bytes"]) == e["stage_bytes"], e
        assert 0 < e["bytes_read"] < model_bytes, e
    assert sorted(per_stage) == list(range(n_stages)), per_stage
    for stage, read in per_stage.items():
        assert sum(read) == stage_bytes[stage], (stage, read, stage_bytes[stage])
    # Stages hold the whole model, plus the last stage's copy of the tied weight.
    copies = 1 if n_stages > 1 else 0
    assert sum(stage_bytes.values()) == model_bytes + copies * tied_bytes, stage_bytes
    written = [e["written"] for e in extras]
    assert sum(written) == model_bytes, written  # the tied weight written once
    assert sum(1 for w in written if w) >= 2, written
    embed_files = {e["embed_file"] for e in extras}
    assert len(embed_files) == 1 and None not in embed_files, embed_files
    (embed_file,) = embed_files
    assert [e["file"] for e in extras].count(embed_file) == 1, extras
