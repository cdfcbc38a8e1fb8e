"""Hugging Face checkpoints that store fused tensors, through split hf lines: transformers'
own Phi3 (fused ``qkv_proj``, all q rows then k then v, MHA and GQA, and ``gate_up_proj``)
and GPT-2 (Conv1D ``c_attn``, q|k|v along the last dimension), built from tiny configs and
used as they are (the model module is the transformers model).

Single process and on 4 gloo ranks (FSDP2 x TP, q/k/v or gate/up cut per component over
tp): ``load_hf`` equals transformers' weights bitwise, ``export_hf`` equals the original
safetensors bitwise, and ``from_pretrained`` of the export gives the original's logits.
A Phi3 checkpoint written with ``qkv_proj`` transposed, in the order k, q, v and with q
and k rows in the interleaved RoPE layout proves ``transpose``, an ``as`` list with sizes
and per-part ``rope`` on the same runtime path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shardspec.testing import run_ranks
from tests import hf_split_scenarios
from tests.hf_split_scenarios import SplitCase
from tests.test_hf import _randomize

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
QKV = "model.layers.{i}.self_attn.qkv_proj.weight"


def shardspec(*args: str) -> None:
    """The CLI, in this process (a subprocess per command would import torch again)."""
    from shardspec import cli

    assert cli.main(list(args)) == 0, f"shardspec {' '.join(args)} failed"


def write_checkpoints(root: Path) -> None:
    from examples.models import hf as hfm

    for name, model, seed in (
        ("phi3", hfm.phi3_tiny(), 1),
        ("phi3_mha", hfm.phi3_tiny(num_key_value_heads=4), 2),
        ("gpt2", hfm.gpt2_tiny(), 3),
    ):
        _randomize(model, seed)
        model.save_pretrained(root / name)
    write_kqv(root / "phi3", root / "phi3_kqv")


def write_kqv(src: Path, dst: Path) -> None:
    """Phi3's checkpoint with every ``qkv_proj`` stored transposed ([hidden, k|q|v]), its
    q and k rows permuted so that ``rope 16`` (rotate-half to interleaved) gives Phi3's
    rows back."""
    from safetensors.torch import load_file, save_file

    from examples.models import hf as hfm

    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(f))
        for k, w in tensors.items():
            if k.endswith("qkv_proj.weight"):
                q, kk, v = w.split([64, 32, 32])
                rot = [hfm.meta_rope_to_hf(x, 16) for x in (kk, q)]
                tensors[k] = torch.cat([*rot, v]).t().contiguous()
        save_file(tensors, str(f), metadata={"format": "pt"})


def variant(gen: Path, name: str, edits: list[tuple[str, str]], hf_dir: Path, **args: str) -> None:
    """specs/phi3.shard with ``edits``, its manifests (the factory called with ``args``)
    and the HF manifest of ``hf_dir``, linted clean and compiled to ``gen/<name>.py``."""
    text = (REPO / "specs" / "phi3.shard").read_text(encoding="utf-8")
    edits = [
        ('manifest "phi3.manifest.json"', f'manifest "{name}.manifest.json"'),
        ('hf "phi3.hf.json"', f'hf "{name}.hf.json"'),
        *edits,
    ]
    for old, new in edits:
        assert text.count(old) == 1, f"specs/phi3.shard changed: {old!r} not found once"
        text = text.replace(old, new)
    gen.mkdir(parents=True, exist_ok=True)
    (gen / f"{name}.shard").write_text(text, encoding="utf-8")
    extra = [x for k, v in args.items() for x in ("--arg", f"{k}={v}")]
    manifest = str(gen / f"{name}.manifest.json")
    shardspec("manifest", "examples.models.hf:phi3_tiny", *extra, "-o", manifest)
    shardspec("hf-manifest", str(hf_dir), "-o", str(gen / f"{name}.hf.json"))
    shardspec("lint", str(gen / f"{name}.shard"))
    shardspec("compile", str(gen / f"{name}.shard"), "-o", str(gen))


def compile_variants(root: Path) -> None:
    gen = root / "gen"
    # MHA: q, k and v are equal, so tp cuts each of them (per component).
    mha = [
        (
            "fuse qkv as q 64, k 32, v 32\n    replicate tp",
            "fuse qkv as q 64, k 64, v 64\n    shard qkv over tp",
        ),
        # o_proj then reads the heads qkv_proj cut (rowwise): SS036 otherwise.
        (
            "replicate tp   # qkv_proj is whole over tp, so attention is: o_proj's input is whole",
            "shard heads over tp",
        ),
    ]
    variant(gen, "phi3_mha", mha, root / "phi3_mha", num_key_value_heads="4")
    line = f"    {QKV} -> {QKV}\n"
    kqv = f"    {QKV} -> {QKV} transpose as k (num_key_value_heads * 16) rope 16, q 64 rope 16, v\n"
    variant(gen, "phi3_kqv", [(line, kqv)], root / "phi3_kqv")


S1 = (("tp", 1),)
S2 = (("tp", 2),)
CASES1 = [
    SplitCase("generated.phi3", S1, "phi3", "phi3", "phi3"),
    SplitCase("phi3_mha", S1, "phi3_mha", "phi3_mha", "phi3_mha"),
    SplitCase("phi3_kqv", S1, "phi3", "phi3_kqv", "phi3"),
    SplitCase("generated.gpt2", S1, "gpt2", "gpt2", "gpt2"),
]
# 4 ranks: dp_shard 2 x tp 2. Phi3 GQA: gate/up cut per component over tp, q/k/v whole
# over tp (unequal components); MHA: q/k/v cut per component; GPT-2: c_attn's columns.
CASES4 = [
    SplitCase("generated.phi3", S2, "phi3", "phi3", "phi3"),
    SplitCase("phi3_mha", S2, "phi3_mha", "phi3_mha", "phi3_mha"),
    SplitCase("phi3_kqv", S2, "phi3", "phi3_kqv", "phi3"),
    SplitCase("generated.gpt2", S2, "gpt2", "gpt2", "gpt2"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hf_split")
    write_checkpoints(root)
    compile_variants(root)
    one = run_ranks(hf_split_scenarios.run_all, 1, str(root), CASES1, timeout=600)
    four = run_ranks(hf_split_scenarios.run_all, 4, str(root), CASES4, timeout=600)
    return {"one": one, "four": four}


@pytest.mark.parametrize("case", CASES1, ids=lambda c: c.label)
def test_single_process(results: dict, case: SplitCase) -> None:
    (rank0,) = results["one"]
    item = rank0[case.label]
    assert not item.fail, "\n".join(item.fail)
    assert item.checked > 10
    if case.hf == case.truth:  # transformers reads the checkpoint as it is
        assert item.extra["logits equal"] is True


@pytest.mark.parametrize("case", CASES4, ids=lambda c: c.label)
def test_on_four_ranks(results: dict, case: SplitCase) -> None:
    fails = [f for r in results["four"] for f in r[case.label].fail]
    assert not fails, "\n".join(fails)
    assert all(r[case.label].checked > 10 for r in results["four"])
    written = [r[case.label].extra["written"] for r in results["four"]]
    assert sum(1 for w in written if w) >= 2, written  # the parts of a tensor go together


def test_the_checkpoint_variant_is_not_the_original() -> None:
    """The kqv checkpoint really differs from Phi3's (or its test would prove nothing)."""
    from examples.models import hf as hfm

    w = torch.randn(128, 64)
    q, k, v = w.split([64, 32, 32])
    stored = torch.cat([hfm.meta_rope_to_hf(k, 16), hfm.meta_rope_to_hf(q, 16), v]).t()
    assert stored.shape == (64, 128) and not torch.equal(stored.t()[32:96], q)
    assert torch.equal(hfm.hf_rope_to_meta(stored.t()[32:96], 16), q)


def test_lint_catches_phi3_declared_with_megatron_groups(tmp_path: Path) -> None:
    """Phi3's checkpoint and forward hold q|k|v as three blocks; `specs/phi3.shard` declares
    them so. Declared instead with Megatron's groups (2 kv groups of q 32, k 16, v 16), the
    identity split line would read q, k and v rows from the wrong places: SS082, the one
    finding, with both ways out in its hint."""
    import contextlib
    import io

    from shardspec import cli

    text = (REPO / "specs" / "phi3.shard").read_text(encoding="utf-8")
    right = "fuse qkv as q 64, k 32, v 32"
    assert text.count(right) == 1
    for f in ("phi3.manifest.json", "phi3.hf.json"):
        shutil.copy(REPO / "specs" / f, tmp_path / f)
    spec = tmp_path / "phi3_groups.shard"
    spec.write_text(text.replace(right, "fuse qkv as 2 groups of q 32, k 16, v 16"), "utf-8")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["lint", str(spec)])
    found = err.getvalue()
    assert rc == 1 and "1 error(s), 0 warning(s)" in found, found
    line = next(n for n, t in enumerate(text.splitlines(), 1) if t.startswith(f"    {QKV} ->"))
    assert f"phi3_groups.shard:{line}:" in found and "error SS082" in found, found
    assert "the model holds 2 groups of q 32, k 16, v 16" in found
    assert f"`{QKV} -> {QKV} grouped`" in found
    assert f"drop the groups: `{right}`" in found
    assert cli.main(["lint", str(REPO / "specs" / "phi3.shard")]) == 0
