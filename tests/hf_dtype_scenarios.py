"""Rank code for ``tests/test_hf_dtypes.py``: load_hf of GptOss checkpoints whose files'
dtypes differ from what the spec's HF manifest recorded, through ``specs/gpt_oss.shard``
(HF manifest: F32) and variants compiled by the test. Each case reports the HFError's text
(or None), whether the model was left as it was, and which tensors differ from the
expected values."""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

import torch

from examples.models import hf as hfm
from shardspec.runtime.hf import HFError
from tests.hf_scenarios import full_of, same_bits


def _model(mod: Any, mesh: Any) -> Any:
    with torch.device("meta"):
        model = hfm.gpt_oss_tiny()
    mod.distribute(model, mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    return model


def _values(model: Any) -> dict[str, torch.Tensor]:
    return {k: full_of(p).clone() for k, p in model.named_parameters()}


def load_case(root: str, module: str, folder: str, truth: str | None, **options: Any) -> dict:
    """Load ``folder`` through ``module``: the error's text (None when it loaded), whether
    a failed load left the model unchanged, and (``truth``: the folder of the values it
    must hold, in its own dtype, cast to the model's) the tensors that differ."""
    import transformers

    mod = importlib.import_module(module)
    mesh = mod.build_mesh(tp=1)
    model = _model(mod, mesh)
    before = _values(model)
    out: dict[str, Any] = {"error": None, "unchanged": None, "differ": None}
    try:
        mod.load_hf(model, os.path.join(root, folder), mesh, **options)
    except HFError as e:
        out["error"] = str(e)
        after = _values(model)
        out["unchanged"] = all(same_bits(after[k], before[k]) for k in before)
        return out
    if truth is not None:
        want = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, truth))
        theirs = {k: v.detach().float() for k, v in want.named_parameters()}
        out["differ"] = sorted(k for k, v in _values(model).items() if not same_bits(v, theirs[k]))
    return out


# Header dtype labels to fuzz with: every safetensors dtype, and strings that are none.
LABELS = (
    *"F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL F8_E4M3 F8_E5M2 C64".split(),
    *("", "f32", "F32 ", "FLOAT", "\u00e9", "I32\u0000"),
)


def fuzz_relabels(root: str, n: int, seed: int) -> dict[str, Any]:
    """``n`` loads of the F32 checkpoint with one random key's header dtype relabelled
    (the bytes as they are): each must load (the label unchanged) or raise an HFError
    and leave the model as it was. The outcomes that broke that rule (``bad``), and how
    many loaded and were refused."""
    import json
    import random
    import shutil
    import struct

    rng = random.Random(seed)
    bad: list[str] = []
    count = {"loaded": 0, "refused": 0}
    for k in range(n):
        folder = os.path.join(root, f"fuzz-{k}")
        shutil.copytree(os.path.join(root, "f32"), folder)
        path = os.path.join(folder, "model.safetensors")
        with open(path, "rb") as f:
            data = f.read()
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        key = rng.choice(sorted(k for k in header if k != "__metadata__"))
        label = rng.choice(LABELS)
        header[key]["dtype"] = label
        text = json.dumps(header, separators=(",", ":")).encode()
        with open(path, "wb") as f:
            f.write(data[:8] + text.ljust(size) + data[8 + size :])
        try:
            got = load_case(root, "generated.gpt_oss", f"fuzz-{k}", "f32")
        except Exception:
            bad.append(f"{key} as {label!r}: raised\n{traceback.format_exc()}")
            continue
        loaded = got["error"] is None
        count["loaded" if loaded else "refused"] += 1
        if loaded and (label != "F32" or got["differ"]):
            bad.append(f"{key} as {label!r}: loaded, differing in {got['differ']}")
        if not loaded and (label == "F32" or got["unchanged"] is not True):
            bad.append(f"{key} as {label!r}: {got['error']} (model unchanged: {got['unchanged']})")
        shutil.rmtree(folder)
    return {"bad": bad, **count}


def run_all(rank: int, world: int, root: str, cases: list[tuple], fuzz: int = 0) -> dict[str, Any]:
    gen = os.path.join(root, "gen")
    if gen not in sys.path:
        sys.path.insert(0, gen)
    out: dict[str, Any] = {}
    for label, module, folder, truth, options in cases:
        try:
            out[label] = load_case(root, module, folder, truth, **options)
        except Exception:
            out[label] = {"raised": traceback.format_exc()}
    out["fuzz"] = fuzz_relabels(root, fuzz, seed=20)
    return out
