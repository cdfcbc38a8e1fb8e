"""Pipeline stages of the example Llama, and pipelined training on 2 gloo ranks.

Unit tests (one process): ``stage_layers``, ``stage_model`` (global and renumbered layer
names, dropped modules, the tied output copy), stage forwards composing to the full
model's logits bitwise, and the full model's forward unchanged. One spawn of 2 ranks runs
the training cases of tests/pipeline_harness.py (GPipe and 1F1B, 4 microbatches, 3 AdamW
steps) against a single process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from examples.models import llama
from shardspec.testing import run_ranks
from tests import pipeline_harness

# ----------------------------------------------------------------------------- helpers


def _tokens(batch: int = 3, seq: int = 11, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7))


def _initialised(tied: bool = False) -> llama.Llama:
    model = llama.tiny_tied(n_layers=4) if tied else llama.tiny4()
    llama.init_weights(model, seed=3)
    return model


def _cut(full: llama.Llama, n_stages: int, *, renumber: bool = False) -> list[llama.Llama]:
    n = full.config.n_layers
    return [
        llama.stage_model(
            copy.deepcopy(full),
            llama.stage_layers(n, n_stages, s),
            first=s == 0,
            last=s == n_stages - 1,
            renumber=renumber,
        )
        for s in range(n_stages)
    ]


def _forward_before_pipelining(model: llama.Llama, tokens: torch.Tensor) -> torch.Tensor:
    """``Llama.forward`` as it was before stages existed (the full model only)."""
    h = model.tok_embeddings(tokens)
    cfg = model.config
    cos, sin = llama.rope_cos_sin(tokens.shape[1], cfg.head_dim, cfg.rope_theta, device=h.device)
    for layer in model.layers.values():
        h = layer(h, cos, sin)
    h = model.norm(h)
    if model.output is not None:
        return model.output(h)
    return F.linear(h, model.tok_embeddings.weight)


# ----------------------------------------------------------------------------- unit tests


def test_stage_layers_splits_evenly() -> None:
    assert [llama.stage_layers(4, 2, s) for s in range(2)] == [[0, 1], [2, 3]]
    assert [llama.stage_layers(4, 4, s) for s in range(4)] == [[0], [1], [2], [3]]
    assert llama.stage_layers(6, 3, 2) == [4, 5]
    assert llama.stage_layers(4, 1, 0) == [0, 1, 2, 3]
    for args in ((4, 3, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1), (0, 1, 0)):
        with pytest.raises(ValueError):
            llama.stage_layers(*args)


def test_tiny4_has_four_layers() -> None:
    model = llama.tiny4()
    assert list(model.layers.keys()) == ["0", "1", "2", "3"]
    assert model.config.n_layers == 4 and model.output is not None
    assert llama.tiny4(dim=32).config.dim == 32
    for name in ("stage_layers", "stage_model", "tiny4"):
        assert name in llama.__all__


@pytest.mark.parametrize("renumber", [False, True])
def test_stage_model_keeps_its_modules(renumber: bool) -> None:
    full = _initialised()
    s0, s1 = _cut(full, 2, renumber=renumber)
    assert s0.norm is None and s0.output is None and s0.tok_embeddings is not None
    assert s1.tok_embeddings is None and s1.norm is not None and s1.output is not None
    assert list(s0.layers.keys()) == ["0", "1"]
    assert list(s1.layers.keys()) == (["0", "1"] if renumber else ["2", "3"])
    assert s1.config.n_layers == 4  # the config describes the whole pipeline
    names0 = {n for n, _ in s0.named_parameters()}
    names1 = {n for n, _ in s1.named_parameters()}
    assert "tok_embeddings.weight" in names0 and "layers.1.attention.wqkv.weight" in names0
    assert "output.weight" in names1 and "norm.weight" in names1
    assert ("layers.0.ffn_norm.weight" in names1) == renumber
    # The blocks are the full model's own values (global name -> stage name).
    full_state = full.state_dict()
    for k, i in enumerate((2, 3)):
        key = str(k) if renumber else str(i)
        for name, value in s1.layers[key].state_dict().items():
            assert torch.equal(value, full_state[f"layers.{i}.{name}"])
    # Global names (torchtitan): init_weights on a stage draws the full model's values.
    fresh = llama.stage_model(llama.tiny4(), [2, 3], first=False, last=True)
    llama.init_weights(fresh, seed=3)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, full_state[name]), name


def test_stage_model_ties_a_copy_on_the_last_stage() -> None:
    full = _initialised(tied=True)
    s0, s1 = _cut(full, 2)
    assert s0.output is None and s0.tok_embeddings is not None
    assert s1.tok_embeddings is None and s1.output is not None
    assert s1.output.bias is None
    weight = s1.output.weight
    assert weight.requires_grad and weight.data_ptr() != s0.tok_embeddings.weight.data_ptr()
    assert torch.equal(weight, full.tok_embeddings.weight)
    assert {n for n, _ in s1.named_parameters()} >= {"output.weight", "norm.weight"}
    # A single stage (first and last) stays tied through the embedding itself.
    whole = llama.stage_model(copy.deepcopy(full), range(4), first=True, last=True)
    assert whole.output is None and whole.tok_embeddings is not None


def test_stage_model_refuses() -> None:
    with pytest.raises(ValueError, match="already a stage"):
        llama.stage_model(_cut(llama.tiny4(), 2)[0], [0, 1], first=True, last=False)
    with pytest.raises(ValueError, match="strictly increasing"):
        llama.stage_model(llama.tiny4(), [1, 0], first=True, last=False)
    with pytest.raises(ValueError, match="strictly increasing"):
        llama.stage_model(llama.tiny4(), [1, 1], first=True, last=False)
    with pytest.raises(ValueError, match="not in"):
        llama.stage_model(llama.tiny4(), [3, 4], first=False, last=True)
    with pytest.raises(ValueError, match="at least one layer"):
        llama.stage_model(llama.tiny4(), [], first=False, last=False)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("n_stages", "renumber"), [(2, False), (2, True), (4, True)])
def test_stages_compose_to_the_full_model_bitwise(
    tied: bool, n_stages: int, renumber: bool
) -> None:
    full = _initialised(tied=tied)
    tokens = _tokens()
    with torch.no_grad():
        want = full(tokens)
        h = tokens
        for stage in _cut(full, n_stages, renumber=renumber):
            h = stage(h)
            if stage.norm is None:  # hidden states between stages
                assert h.shape == (*tokens.shape, full.config.dim)
    assert torch.equal(h, want)


@pytest.mark.parametrize(
    "factory", [llama.tiny, llama.tiny4, llama.tiny_tied, lambda: llama.tiny_tp_local(tp=2)]
)
def test_full_forward_unchanged(factory) -> None:
    model = factory()
    llama.init_weights(model, seed=1)
    tokens = _tokens(vocab=model.tok_embeddings.num_embeddings)
    with torch.no_grad():
        assert torch.equal(model(tokens), _forward_before_pipelining(model, tokens))


def test_stage_example_args() -> None:
    s0, s1 = _cut(_initialised(), 2)
    inp, out = pipeline_harness.stage_example_args(s0, (2, 16))
    assert (inp.shape, inp.dtype, inp.device.type) == ((2, 16), torch.long, "meta")
    assert out.shape == (2, 16, 64) and out.requires_grad
    inp, out = pipeline_harness.stage_example_args(s1, (2, 16))
    assert inp.shape == (2, 16, 64) and inp.requires_grad and out.shape == (2, 16, 256)


# ----------------------------------------------------------------------------- 2 ranks


@pytest.mark.dist
def test_pipelined_training_matches_one_process() -> None:
    results = run_ranks(pipeline_harness.run_all, 2, timeout=120)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    # Per case: the names check, a gradient per parameter, a loss check per step (the
    # last stage compares it, the first checks it got None), a delta per parameter.
    least = {0: 1 + 13 + 3 + 13, 1: 1 + 14 + 3 + 14}
    for rank, (_, counts) in enumerate(results):
        assert len(counts) == len(pipeline_harness.CASES)
        for tag, n in counts.items():
            assert n >= least[rank], f"rank {rank}: {tag} made {n} checks"
