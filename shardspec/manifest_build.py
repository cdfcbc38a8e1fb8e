"""``shardspec manifest``: build a model on the meta device and write its manifest.

This is the one compiler-side command that imports torch (to build the model); lint and
compile only read the JSON it writes.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path

from shardspec.api import file_mode
from shardspec.manifest import dump_manifest


class ManifestBuildError(Exception):
    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


def parse_arg(text: str) -> tuple[str, int | float | bool | str]:
    name, eq, raw = text.partition("=")
    if not eq or not name.isidentifier():
        raise ManifestBuildError(f"--arg {text!r} is not NAME=VALUE", "for example --arg ep=2")
    value: int | float | bool | str
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    else:
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                value = raw
    return name, value


def load_factory(spec: str):
    module_name, colon, func = spec.partition(":")
    if not colon or not module_name or not func:
        raise ManifestBuildError(
            f"{spec!r} is not MODULE:FUNCTION", "for example examples.models.llama:tiny"
        )
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ManifestBuildError(
            f"cannot import {module_name!r}: {e}",
            "run from the directory the module is importable from",
        ) from None
    except Exception as e:  # a module that fails while importing: report, don't crash
        raise ManifestBuildError(
            f"importing {module_name!r} failed: {type(e).__name__}: {e}",
            "fix the module so that it imports",
        ) from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ManifestBuildError(
            f"{module_name!r} has no function {func!r}", "name a function that returns an nn.Module"
        )
    return fn


def build_entries(factory: str, kwargs: dict) -> list[dict]:
    import torch
    from torch import nn

    fn = load_factory(factory)
    try:
        with torch.device("meta"):
            model = fn(**kwargs)
    except TypeError as e:
        raise ManifestBuildError(
            f"{factory}({_kw(kwargs)}) failed: {e}",
            "check the --arg names against the factory's keywords",
        ) from None
    except Exception as e:
        raise ManifestBuildError(
            f"{factory}({_kw(kwargs)}) raised {type(e).__name__}: {e}",
            "check the --arg values; the factory must build the model on the meta device",
        ) from None
    if not isinstance(model, nn.Module):
        raise ManifestBuildError(
            f"{factory} returned {type(model).__name__}, not an nn.Module",
            "name a function that returns an nn.Module",
        )
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    entries = []
    for name, value in model.state_dict(keep_vars=True).items():
        if name.endswith("._extra_state") or name == "_extra_state":
            entries.append({"fqn": name, "kind": "extra_state"})
            continue
        kind = "param" if name in params else "buffer"
        entry = {
            "fqn": name,
            "kind": kind,
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
        }
        if kind == "param":
            entry["module"] = _module_kind(model, name)
        entries.append(entry)
    # Tied parameters appear once in the state dict under each name; keep them all.
    return entries


def _module_kind(model, fqn: str) -> str:
    """ "linear", "embedding" or the class name of the module holding parameter ``fqn``
    (what tensor-parallel styles derive from)."""
    from torch import nn

    owner = fqn.rpartition(".")[0]
    module = model.get_submodule(owner) if owner else model
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return type(module).__name__


def _kw(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def write_manifest(factory: str, output: str, args: list[str]) -> int:
    kwargs = dict(parse_arg(a) for a in args)
    entries = build_entries(factory, kwargs)
    text = dump_manifest(entries, factory, kwargs)
    out = Path(output)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, file_mode())
        os.replace(tmp, out)
    except OSError as e:
        raise ManifestBuildError(
            f"cannot write {output!r}: {e.strerror or e}", "check the output path"
        ) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return len(entries)
