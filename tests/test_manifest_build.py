"""``shardspec manifest``: entries as the model holds them (parameters, persistent buffers,
extra state), whatever its state-dict hooks do, and a record of what the hooks change.

The torchtitan-like model with hooks is ``examples/models/llama3_fused.py``; the small
ones here override ``state_dict``, transpose a weight, or need real data in a hook.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.models import llama, llama3_fused
from shardspec.cli import main
from shardspec.inputs.manifest import TORCH_DTYPES, ManifestError, dump_manifest, load_manifest
from shardspec.inputs.manifest_build import model_entries, state_dict_changes


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_fused_qkv_behind_hooks_is_recorded_as_the_parameter(
    in_repo: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "m.json"
    status, said, err = run(capsys, "manifest", "examples.models.llama3_fused:tiny", "-o", str(out))
    assert status == 0 and said == f"wrote {out} (15 entries)\n"
    # The warning names the modules, their hooks and what they change.
    assert err.startswith("warning: state-dict hooks change what state_dict() returns")
    assert (
        "  layers.0.attention, layers.1.attention (state_dict hook, load_state_dict pre-hook): "
        "state_dict() writes wk.weight, wq.weight, wv.weight in place of the parameter "
        "qkv_linear.wqkv.weight\n"
    ) in err
    assert "save() refuses them unless strict=False" in err
    m = load_manifest(out)
    assert m.format == "shardspec-manifest/2" and not m.from_state_dict
    params = {e.fqn: e for e in m.params}
    wqkv = params["layers.0.attention.qkv_linear.wqkv.weight"]
    assert (wqkv.shape, wqkv.dtype, wqkv.module) == ((128, 64), "float32", "linear")
    assert not any(".wq." in e.fqn for e in m.entries)
    assert m.state_dict is not None and m.state_dict.error is None
    assert m.state_dict.hooks == {
        f"layers.{i}.attention": ("state_dict hook", "load_state_dict pre-hook") for i in (0, 1)
    }
    wq = next(k for k in m.state_dict.added() if k.fqn == "layers.1.attention.wq.weight")
    assert (wq.module, wq.from_, wq.shape) == (
        "layers.1.attention",
        ("layers.1.attention.qkv_linear.wqkv.weight",),
        (64, 64),
    )
    dropped = {k.fqn for k in m.state_dict.keys if k.change == "dropped"}
    assert dropped == {f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in (0, 1)}
    assert len(m.state_dict.added()) == 6
    # The golden case's manifest is this one, fresh.
    case = Path("tests/cases/state_dict_hooks/manifest.json")
    assert out.read_text(encoding="utf-8") == case.read_text(encoding="utf-8")


def test_a_model_without_hooks_lists_what_state_dict_lists() -> None:
    with torch.device("meta"):
        model = llama.tiny_tied(n_layers=1)
    entries = model_entries(model)
    # Tied parameters under each name, as state_dict() lists them.
    assert sorted(e["fqn"] for e in entries) == sorted(model.state_dict())
    assert state_dict_changes(model, entries) is None


class _Extra(torch.nn.Module):
    def get_extra_state(self) -> dict:
        return {"scale": 1.0}

    def set_extra_state(self, state: object) -> None:
        pass


class _Buffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(3, 2))
        self.register_buffer("inv_freq", torch.zeros(2), persistent=False)
        self.fp8 = _Extra()


def test_persistent_buffers_and_extra_state_are_entries() -> None:
    with torch.device("meta"):
        model = _Buffers()
    entries = {e["fqn"]: e for e in model_entries(model)}
    assert entries["cache"] == {
        "fqn": "cache",
        "kind": "buffer",
        "shape": [3, 2],
        "dtype": "float32",
    }
    assert "inv_freq" not in entries  # not saved: no entry
    assert entries["fp8._extra_state"] == {"fqn": "fp8._extra_state", "kind": "extra_state"}
    assert entries["w.bias"]["kind"] == "param" and entries["w.bias"]["module"] == "linear"
    assert state_dict_changes(model, list(entries.values())) is None


class _Renamed(torch.nn.Module):
    """Overrides state_dict: every key under ``model.`` (what some wrappers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 2, bias=False)

    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        return {f"model.{k}": v for k, v in super().state_dict(*args, **kwargs).items()}


def _transpose(module, state_dict, prefix, local_metadata) -> None:  # type: ignore[no-untyped-def]
    state_dict[f"{prefix}weight"] = state_dict[f"{prefix}weight"].t()


def _needs_data(module, state_dict, prefix, local_metadata) -> None:  # type: ignore[no-untyped-def]
    state_dict["scale"] = state_dict["inner.weight"].sum().item()


class _Transposed(torch.nn.Module):
    """A hook that stores a weight transposed; with ``fail``, one that needs real data."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(2, 3, bias=False)
        self.inner._register_state_dict_hook(_transpose)
        if fail:
            self._register_state_dict_hook(_needs_data)


@pytest.mark.parametrize(
    ("make", "keys", "hooks"),
    [
        (
            _Renamed,
            [("model.w.weight", "added", "", ("w.weight",)), ("w.weight", "dropped", "", ())],
            {"": ("overrides state_dict",)},
        ),
        (
            _Transposed,
            [("inner.weight", "reshaped", "inner", ())],
            {"inner": ("state_dict hook",)},
        ),
    ],
)
def test_renames_and_reshapes_are_attributed(
    make: type, keys: list, hooks: dict, tmp_path: Path
) -> None:
    with torch.device("meta"):
        model = make()
    entries = model_entries(model)
    section = state_dict_changes(model, entries)
    assert section is not None
    path = tmp_path / "m.json"
    path.write_text(dump_manifest(entries, None, {}, section), encoding="utf-8")
    m = load_manifest(path)
    assert m.state_dict is not None and m.state_dict.hooks == hooks
    assert [(k.fqn, k.change, k.module, k.from_) for k in m.state_dict.keys] == keys
    if make is _Transposed:
        assert m.state_dict.keys[0].shape == (2, 3)


def test_a_hook_that_cannot_run_on_meta_is_reported(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama3_fused, "failing", lambda: _Transposed(fail=True), raising=False)
    out = tmp_path / "m.json"
    status, _, err = run(capsys, "manifest", "examples.models.llama3_fused:failing", "-o", str(out))
    assert status == 0
    assert "state_dict() raised" in err and "were not checked" in err and "the model" in err
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["state_dict"]["keys"] == [] and "raised" in doc["state_dict"]["error"]
    section = load_manifest(out).state_dict
    assert section is not None and section.error is not None
    assert section.error.startswith("state_dict() raised")


# ------------------------------------------------------------------ classes, ties, dtypes


def test_entries_record_module_classes_and_whose_forward_they_run() -> None:
    """``class`` always; ``forward`` only where the class inherits it (a subclass of
    torch's Linear that keeps torch's forward); a forward of its own is the class's."""
    from tests.custom_modules import NamedEmbedding, VocabParallelEmbedding

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vocab = VocabParallelEmbedding(8, 4)
            self.named = NamedEmbedding(8, 4)
            self.out = torch.nn.MultiheadAttention(4, 2).out_proj  # torch's own subclass
            self.w = torch.nn.Linear(4, 4)

    with torch.device("meta"):
        model = Model()
    entries = {e["fqn"]: e for e in model_entries(model)}
    fields = {f: (e["module"], e["class"], e.get("forward")) for f, e in entries.items()}
    assert fields == {
        "vocab.weight": (
            "embedding",
            "tests.custom_modules.VocabParallelEmbedding",
            None,
        ),
        "named.weight": (
            "embedding",
            "tests.custom_modules.NamedEmbedding",
            "torch.nn.modules.sparse.Embedding",
        ),
        "out.weight": (
            "linear",
            "torch.nn.modules.linear.NonDynamicallyQuantizableLinear",
            "torch.nn.modules.linear.Linear",
        ),
        "out.bias": (
            "linear",
            "torch.nn.modules.linear.NonDynamicallyQuantizableLinear",
            "torch.nn.modules.linear.Linear",
        ),
        "w.weight": ("linear", "torch.nn.modules.linear.Linear", None),
        "w.bias": ("linear", "torch.nn.modules.linear.Linear", None),
    }


def test_ties_are_recorded_under_the_first_name() -> None:
    """GPT-2's head is its token embedding's Parameter: the head's entry says so; a
    module registered under two names ties each of its parameters."""
    from examples.models import hf

    with torch.device("meta"):
        gpt2 = hf.gpt2_tiny()
        shared = torch.nn.Linear(2, 2)
        twice = torch.nn.ModuleDict({"a": shared, "b": shared})
    ties = {e["fqn"]: e["tied_to"] for e in model_entries(gpt2) if "tied_to" in e}
    assert ties == {"lm_head.weight": "transformer.wte.weight"}
    ties = {e["fqn"]: e["tied_to"] for e in model_entries(twice) if "tied_to" in e}
    assert ties == {"b.weight": "a.weight", "b.bias": "a.bias"}
    with torch.device("meta"):
        untied = llama.tiny()
    assert not any("tied_to" in e for e in model_entries(untied))


def test_the_dtype_table_is_torchs() -> None:
    """The compiler's table of dtype names (it does not import torch) is exactly torch's,
    and its aliases name what torch's other names are."""
    from shardspec.inputs.manifest import DTYPE_ALIASES, TORCH_DTYPES

    dtypes = {k: v for k, v in vars(torch).items() if isinstance(v, torch.dtype)}
    names = {str(v).removeprefix("torch.") for v in dtypes.values()}
    assert names == TORCH_DTYPES
    aliases = {k: str(v).removeprefix("torch.") for k, v in dtypes.items() if k not in names}
    assert aliases == DTYPE_ALIASES


def test_a_manifest_without_the_new_fields_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(
        '{"format": "shardspec-manifest/2", "factory": null, "factory_args": {},\n'
        '  "entries": [\n'
        '    {"fqn": "w.weight", "kind": "param", "shape": [4, 4], "dtype": "float32", '
        '"module": "linear"}\n  ]\n}\n',
        encoding="utf-8",
    )
    (entry,) = load_manifest(path).entries
    assert (entry.module, entry.cls, entry.forward, entry.tied_to) == ("linear", None, None, None)
    assert entry.forward_class is None


def _lint_with_manifest(
    spec: Path, model: torch.nn.Module, tmp_path: Path, edit: tuple[str, str] = ("", "")
) -> str:
    """What ``shardspec lint`` says (standard error) of ``spec`` (its hf block dropped,
    ``edit`` made) with the manifest built from ``model``."""
    (tmp_path / "m.json").write_text(dump_manifest(model_entries(model), "tests:model"))
    text = spec.read_text(encoding="utf-8")
    text = re.sub(r'(?m)^manifest "[^"]*"', 'manifest "m.json"', text)
    text = re.sub(r'(?ms)^hf "[^"]*" \{.*?^\}\n?', "", text)
    assert edit[0] in text
    (tmp_path / "s.shard").write_text(text.replace(*edit), encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        main(["lint", str(tmp_path / "s.shard")])
    return err.getvalue()


def _codes(said: str) -> list[str]:
    return re.findall(r": (?:error|warning) (SS\d{3}) ", said)


def test_lint_refuses_torchs_style_on_a_vocab_parallel_embedding(tmp_path: Path) -> None:
    """A manifest built from a llama whose token embedding does its own lookup: the
    derived rowwise style is SS038 at the rule; with `style none`, or torch's own
    Embedding, lint is clean."""
    from tests.custom_modules import NamedEmbedding, VocabParallelEmbedding, with_embedding

    spec = Path(__file__).resolve().parents[1] / "specs" / "llama.shard"
    with torch.device("meta"):
        custom = with_embedding(llama.tiny(), VocabParallelEmbedding)
        named = with_embedding(llama.tiny(), NamedEmbedding)
        plain = llama.tiny()
    said = _lint_with_manifest(spec, custom, tmp_path)
    assert "error SS038 [custom-module-style]: tok_embeddings.weight gets torch's rowwise " in said
    assert "VocabParallelEmbedding (tests.custom_modules.VocabParallelEmbedding)" in said
    assert _codes(said) == ["SS038"]
    rule = "    shard vocab over tp\n}\nparam output"
    none = (rule, rule.replace("tp\n}", "tp\n    style none\n}"))
    assert "SS038" not in _lint_with_manifest(spec, custom, tmp_path, none)
    assert _lint_with_manifest(spec, named, tmp_path) == ""
    assert _lint_with_manifest(spec, plain, tmp_path) == ""


def test_lint_warns_about_gpt2s_tied_head_sharded_over_tp(tmp_path: Path) -> None:
    """specs/gpt2.shard with its tied embedding sharded over tp (the spec keeps it whole
    over tp, so that GPT-2 trains with TP): the manifest's tie gives SS037."""
    from examples.models import hf

    spec = Path(__file__).resolve().parents[1] / "specs" / "gpt2.shard"
    with torch.device("meta"):
        model = hf.gpt2_tiny()
    rule = "param transformer.wte.weight [vocab, hidden] {}"
    sharded = rule.replace("{}", "{\n    shard vocab over tp\n}")
    said = _lint_with_manifest(spec, model, tmp_path, (rule, sharded))
    assert "warning SS037 [tied-parameter-sharded]: lm_head.weight is tied to " in said
    assert _codes(said) == ["SS037"]
    assert _lint_with_manifest(spec, model, tmp_path) == ""


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.one_of(
        st.sampled_from(["float32", "bfloat16", "", "float", "torch.int64"]), st.text()
    ),
    tied=st.one_of(st.none(), st.sampled_from(["a", "b", "c", "buf"]), st.text(max_size=5)),
    shape=st.sampled_from([[4, 4], [4, 2]]),
)
def test_manifest_dtypes_and_ties_fuzzed(
    dtype: str, tied: str | None, shape: list[int], tmp_path_factory
) -> None:
    """Any dtype text and any tie: the manifest reads, or says why with a ManifestError
    (never another exception); it reads exactly when the dtype is torch's (or empty) and
    the tie names an untied parameter entry of the same shape and dtype."""
    entries = [
        {"fqn": "a", "kind": "param", "shape": [4, 4], "dtype": dtype},
        {"fqn": "b", "kind": "param", "shape": [4, 4], "dtype": dtype, "tied_to": "a"},
        {"fqn": "buf", "kind": "buffer", "shape": [4, 4], "dtype": dtype},
        {"fqn": "c", "kind": "param", "shape": shape, "dtype": dtype}
        | ({"tied_to": tied} if tied is not None else {}),
    ]
    path = tmp_path_factory.mktemp("fuzz") / "m.json"
    path.write_text(dump_manifest(entries, None), encoding="utf-8")
    good = (dtype == "" or dtype in TORCH_DTYPES) and (
        tied is None or (tied == "a" and shape == [4, 4])
    )
    try:
        load_manifest(path)
        assert good, (dtype, tied, shape)
    except ManifestError as e:
        assert not good, e
        assert len(str(e)) < 400  # a quoted name, not the whole input
