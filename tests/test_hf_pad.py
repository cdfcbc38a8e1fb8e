"""``pad D to M``: a model dimension padded past the Hugging Face tensor's (vLLM pads the
vocabulary of ``VocabParallelEmbedding``/``ParallelLMHead`` to a multiple of 64).

* the language: the transform parses, prints back and resolves with the HF size the spec's
  HF manifest records;
* the index arithmetic (``core/hfmap``), by hypothesis against a brute-force reference
  written here: every real HF index maps to exactly one model index and back, and no
  padding index maps to HF;
* on 4 gloo ranks (dp_shard 2 x tp 2, the vocabulary over tp): transformers' own Llama
  checkpoint (vocabulary 1000) loads into the padded model (1024) bitwise for the real
  rows, padding rows zero, reading only the real bytes; export writes transformers' files
  back bitwise; a DCP checkpoint stores the padded parameter whole.
"""

from __future__ import annotations

from itertools import product
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardspec.core.hfmap import (
    Transform,
    hf_shape,
    model_indices,
    padded_dims,
    padded_size,
    source_indices,
)
from shardspec.frontend.parse import parse
from shardspec.resolve.hf import build_hfmap
from shardspec.testing import run_ranks
from tests import hf_pad_scenarios
from tests.hf_pad_scenarios import PADDED, VOCAB

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- the language


def _hf_block(line: str):
    spec, diags = parse(f"hf {{\n    {line}\n}}\n", "t.shard")
    assert spec is not None and spec.hf is not None, diags
    return spec.hf


def test_pad_parses_and_prints_back() -> None:
    hf = _hf_block("a.weight -> b.weight transpose pad 1 to 128 x tp x ep")
    (m,) = hf.maps
    kinds = [t.kind for t in m.transforms]
    assert kinds == ["transpose", "pad"]
    pad = m.transforms[1]
    assert (pad.dim, pad.multiple, [a.text for a in pad.axes]) == (1, 128, ["tp", "ep"])
    rule = build_hfmap(hf).rules[0]
    assert str(rule) == "a.weight -> b.weight transpose pad 1 to 128 x tp x ep"


def test_pad_size_comes_from_the_hf_manifest(tmp_path: Path) -> None:
    from shardspec.inputs.hfmanifest import HFManifest, HFTensor

    hf = _hf_block("e.weight -> tok.weight transpose pad 1 to 64")
    hfm = HFManifest("x", {}, {"e.weight": HFTensor(shape=(1000, 32), dtype="F32", file="f")})
    (rule,) = build_hfmap(hf, hfm).rules
    pad = rule.transforms[1]
    assert pad.size == 1000  # dimension 1 after the transpose: the HF tensor's dim 0
    assert hf_shape((32, 1024), rule.transforms) == (1000, 32)
    assert build_hfmap(hf).rules[0].transforms[1].size == 0  # no manifest: unknown


@pytest.mark.parametrize(
    "line, why",
    [
        ("a -> b pad 0 to 64 rope 16", "write the pad last"),
        ("a -> b pad 0 to 0", "at least 1"),
        ("a -> b as q pad 0 to 64, k", "not a fused part"),
    ],
)
def test_pad_problems(line: str, why: str) -> None:
    problems = [w for _, w in build_hfmap(_hf_block(line)).problems()]
    assert any(why in w for w in problems), problems


# ----------------------------------------------------------------- the index arithmetic


def _brute_source(chain: list[Transform], index: tuple[int, ...]) -> tuple[int, ...] | None:
    """The HF index of model index ``index``, undoing the chain one step at a time; None
    for a padding index."""
    idx = list(index)
    for t in reversed(chain):
        if t.kind == "transpose":
            idx.reverse()
        elif t.kind == "pad" and idx[t.dim] >= t.size:
            return None
    return tuple(idx)


@st.composite
def _chains(draw: st.DrawFn) -> tuple[list[Transform], tuple[int, ...], tuple[int, ...]]:
    """A chain of transposes and pads on a 2-D tensor: ``(chain, hf shape, model shape)``."""
    hshape = [draw(st.integers(1, 9)), draw(st.integers(1, 9))]
    shape = list(hshape)
    chain = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            chain.append(Transform("transpose"))
            shape.reverse()
        else:
            d, m = draw(st.integers(0, 1)), draw(st.integers(1, 8))
            chain.append(Transform("pad", dim=d, multiple=m, size=shape[d]))
            shape[d] = padded_size(shape[d], m)
    return chain, tuple(hshape), tuple(shape)


@settings(max_examples=300, deadline=None)
@given(_chains(), st.data())
def test_source_indices_against_brute_force(case, data) -> None:  # type: ignore[no-untyped-def]
    chain, hshape, shape = case
    assert hf_shape(shape, chain) == hshape
    # A box of the model's tensor: its real positions are a leading sub-box, each reading
    # the brute-force HF index; its padding positions have none.
    offsets = [data.draw(st.integers(0, n - 1)) for n in shape]
    sizes = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=True)]
    per_dim, model_dim_of = source_indices(chain, offsets, sizes)
    lead = [0] * 2
    for k, idx in enumerate(per_dim):
        lead[model_dim_of[k]] = len(idx)
    for pos in product(*(range(s) for s in sizes)):
        m = tuple(o + p for o, p in zip(offsets, pos, strict=True))
        want = _brute_source(chain, m)
        real = all(p < n for p, n in zip(pos, lead, strict=True))
        assert real == (want is not None), (m, want, lead)
        if real:
            got = tuple(per_dim[k][pos[model_dim_of[k]]] for k in range(2))
            assert got == want
    # Every real HF index comes from exactly one model index, and back (export's map).
    per_model, hf_dim_of = model_indices(chain, shape)
    sources = {}
    for m in product(*(range(n) for n in shape)):
        h = _brute_source(chain, m)
        if h is not None:
            assert h not in sources
            sources[h] = m
    assert set(sources) == set(product(*(range(n) for n in hshape)))
    for h, m in sources.items():
        back = [0, 0]
        for d in range(2):
            back[d] = per_model[d][h[hf_dim_of[d]]]
        assert tuple(back) == m


def test_padded_dims_follow_transposes() -> None:
    pad = Transform("pad", dim=0, multiple=64, size=1000)
    assert padded_dims(2, [pad]) == [(0, pad)]
    assert padded_dims(2, [pad, Transform("transpose")]) == [(1, pad)]


# ------------------------------------------------------------------ 4 gloo ranks, owner


def _compile(root: Path) -> None:
    from shardspec import cli

    hf_pad_scenarios.write_hf(str(root / "hf"))
    (root / "padded.shard").write_text(hf_pad_scenarios.SPEC, encoding="utf-8")
    manifest = str(root / "padded.manifest.json")
    for args in (
        ["manifest", "tests.hf_pad_scenarios:padded_model", "-o", manifest],
        ["hf-manifest", str(root / "hf"), "-o", str(root / "padded.hf.json")],
        ["lint", str(root / "padded.shard")],
        ["compile", str(root / "padded.shard"), "-o", str(root / "gen")],
    ):
        assert cli.main(args) == 0, args


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_pad")
    _compile(root)
    return root


@pytest.fixture(scope="module")
def four(compiled: Path) -> tuple[Path, list[dict]]:
    return compiled, run_ranks(hf_pad_scenarios.run, 4, str(compiled), timeout=600)


def test_explain_shows_the_unpadded_hf_shape(
    compiled: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardspec import cli

    capsys.readouterr()
    assert cli.main(["explain", str(compiled / "padded.shard"), "lm_head.weight"]) == 0
    out = capsys.readouterr().out
    assert "lm_head.weight [1024, 32] <- lm_head.weight [1000, 32]" in out, out
    assert "pad 0 to 64" in out


def test_load_equals_transformers_weights_real_rows_padding_zero(four) -> None:  # type: ignore[no-untyped-def]
    root, ranks = four
    hf = hf_pad_scenarios.hf_state(str(root / "hf"))
    got = ranks[0]["fulls"]
    assert sorted(got) == sorted(hf)
    padded = 0
    for key, want in hf.items():
        g = got[key]
        if want.shape[0] == VOCAB and g.shape[0] == PADDED:
            padded += 1
            assert torch.equal(g[:VOCAB], want), key
            assert torch.equal(g[VOCAB:], torch.zeros_like(g[VOCAB:])), key
        else:
            assert torch.equal(g, want), key
    assert padded == 2  # the embedding and the LM head


def test_load_reads_only_the_real_bytes(four) -> None:  # type: ignore[no-untyped-def]
    _, ranks = four
    for r in ranks:
        assert r["bytes_read"] == r["bytes_owned"] == r["real_local"]
    # the last tp rank's last dp_shard chunk holds the padding: fewer real bytes there
    assert len({r["real_local"] for r in ranks}) > 1


def test_export_equals_the_original_files(four) -> None:  # type: ignore[no-untyped-def]
    root, _ = four
    hf = hf_pad_scenarios.hf_state(str(root / "hf"))
    out = hf_pad_scenarios.hf_state(str(root / "export"))
    assert sorted(out) == sorted(hf)
    for key in hf:
        assert out[key].shape == hf[key].shape, key
        assert torch.equal(out[key], hf[key]), key


def test_dcp_checkpoint_stores_the_padded_parameter(four) -> None:  # type: ignore[no-untyped-def]
    _, ranks = four
    for r in ranks:
        assert r["dcp_same"]
        assert set(r["dcp_padding"]) == {3.0}  # the padding row written before the save


def test_diff_padding_the_vocabulary_keeps_hf_checkpoints_loading(
    compiled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``shardspec diff`` from the unpadded model to the padded one: the HF tensors read
    keep their shape, so HF checkpoints that load under OLD load under NEW (DCP
    checkpoints do not: the parameters' global shape changes)."""
    import json

    from shardspec import cli

    for name in ("padded.shard", "padded.manifest.json", "padded.hf.json"):
        (tmp_path / name).write_bytes((compiled / name).read_bytes())
    doc = json.loads((compiled / "padded.manifest.json").read_text(encoding="utf-8"))
    for e in doc["entries"]:
        if e["shape"][:1] == [PADDED]:
            e["shape"][0] = VOCAB
    (tmp_path / "plain.manifest.json").write_text(json.dumps(doc), encoding="utf-8")
    text = hf_pad_scenarios.SPEC.replace(" pad 0 to 64", "")
    text = text.replace("padded.manifest.json", "plain.manifest.json")
    (tmp_path / "plain.shard").write_text(text, encoding="utf-8")
    capsys.readouterr()
    cli.main(["diff", str(tmp_path / "plain.shard"), str(tmp_path / "padded.shard")])
    out = capsys.readouterr().out
    assert "NEW reads:    lm_head.weight [1000, 32] pad 0 to 64" in out, out
    assert "HF checkpoints that load under OLD load under NEW" in out, out
