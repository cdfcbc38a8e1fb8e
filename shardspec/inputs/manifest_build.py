"""``shardspec manifest``: build a model on the meta device and write its manifest.

This is the one compiler-side command that imports torch (to build the model); lint and
compile only read the JSON it writes.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
import tempfile
from pathlib import Path

from shardspec.core.styles import (
    CONV1D,
    CONV1D_FORWARDS,
    EMBEDDING,
    LINEAR,
    forward_class,
    qualified_name,
)
from shardspec.findings.diagnostics import clip
from shardspec.frontend.limits import NUMBER_HINT, number_too_large
from shardspec.frontend.textfile import file_mode
from shardspec.inputs.manifest import dump_manifest


class ManifestBuildError(Exception):
    """Why ``shardspec manifest`` could not write a manifest: the finding's message,
    hint and code (SS004: a bad command line, SS006: a number too large)."""

    def __init__(self, message: str, hint: str = "", code: str = "SS004") -> None:
        super().__init__(message)
        self.hint, self.code = hint, code


# A whole number as ``--arg`` takes one (what int() reads, without its underscores and
# Unicode digits): told apart before int() reads it, which refuses over 4,300 digits.
_WHOLE = re.compile(r"\s*([+-]?)([0-9]+)\s*")
_ARG_VALUES = "factory arguments are whole numbers, finite numbers, true/false or text"


def parse_arg(text: str) -> tuple[str, int | float | bool | str]:
    """``--arg NAME=VALUE`` as (name, value): ``true``/``false``, a whole number (at most
    ``MAX_NUMBER`` either way: SS006), a finite number, or else the text itself."""
    name, eq, raw = text.partition("=")
    if not eq or not name.isidentifier():
        raise ManifestBuildError(f"--arg {text!r} is not NAME=VALUE", "for example --arg ep=2")
    value: int | float | bool | str
    whole = _WHOLE.fullmatch(raw)
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    elif whole is not None:
        sign, digits = whole.groups()
        if number_too_large(digits):
            raise ManifestBuildError(
                f"--arg {name}: number too large: {clip(raw.strip())} ({len(digits)} digits)",
                NUMBER_HINT,
                "SS006",
            )
        value = int(sign + (digits.lstrip("0") or "0"))
    else:
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                value = raw
    if isinstance(value, float) and not math.isfinite(value):
        raise ManifestBuildError(f"--arg {name}={clip(raw)} is not a finite number", _ARG_VALUES)
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


def build_model(factory: str, kwargs: dict):
    """The model ``factory(**kwargs)`` builds on the meta device."""
    try:
        import torch
        from torch import nn
    except ImportError as e:  # lint, compile and explain need no torch; this does
        raise ManifestBuildError(
            f"`shardspec manifest` builds the model, which needs torch: {e}",
            "install torch in this environment (pip install torch)",
        ) from None

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
    return model


def build_entries(factory: str, kwargs: dict) -> list[dict]:
    """The manifest entries of the model ``factory(**kwargs)`` builds (see
    :func:`model_entries`)."""
    return model_entries(build_model(factory, kwargs))


def model_entries(model) -> list[dict]:
    """Every parameter (``named_parameters()``, tied ones under each name), persistent
    buffer and extra state of ``model``, as the model holds them: what its state-dict hooks
    make of them is :func:`state_dict_changes`'s business.

    A parameter's entry records its module's kind (what tensor-parallel styles derive
    from), class and, where inherited, the class whose ``forward`` it runs (whether
    torch's styles fit it), and for a tensor already listed under another name (a tied
    embedding and head), ``tied_to`` that first name."""
    from torch import nn

    entries = []
    first: dict[int, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, value in module._parameters.items():
            if value is not None:
                entry = {**_tensor_entry(dot + name, "param", value), **_module_fields(module)}
                if id(value) in first:
                    entry["tied_to"] = first[id(value)]
                else:
                    first[id(value)] = dot + name
                entries.append(entry)
        for name, value in module._buffers.items():
            if value is not None and name not in module._non_persistent_buffers_set:
                entries.append(_tensor_entry(dot + name, "buffer", value))
        if getattr(type(module), "get_extra_state", None) is not nn.Module.get_extra_state:
            entries.append({"fqn": dot + "_extra_state", "kind": "extra_state"})
    return entries


def _module_fields(module) -> dict[str, str]:
    """A parameter's module: its kind, class and (where inherited) whose forward it runs."""
    cls = type(module)
    out = {"module": _module_kind(module), "class": qualified_name(cls)}
    forward = forward_class(cls)
    if forward is not cls:
        out["forward"] = qualified_name(forward)
    return out


def _tensor_entry(fqn: str, kind: str, value) -> dict:
    return {
        "fqn": fqn,
        "kind": kind,
        "shape": list(value.shape),
        "dtype": str(value.dtype).removeprefix("torch."),
    }


# What a module can have that makes state_dict() differ from its parameters and buffers.
_HOOK_DICTS = (
    ("_state_dict_pre_hooks", "state_dict pre-hook"),
    ("_state_dict_hooks", "state_dict hook"),
    ("_load_state_dict_pre_hooks", "load_state_dict pre-hook"),
    ("_load_state_dict_post_hooks", "load_state_dict post-hook"),
)
_METHODS = ("state_dict", "_save_to_state_dict", "load_state_dict", "_load_from_state_dict")
# Those of them that can change what state_dict() returns (the others act on loading).
_SAVING = frozenset(
    {
        "state_dict pre-hook",
        "state_dict hook",
        "overrides state_dict",
        "overrides _save_to_state_dict",
    }
)


def module_hooks(model) -> dict[str, list[str]]:
    """Per module name (``""``: the model), its state-dict hooks and the state-dict methods
    its class overrides; modules without any are left out."""
    from torch import nn

    out: dict[str, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        kinds = [what for attr, what in _HOOK_DICTS if getattr(module, attr, None)]
        for method in _METHODS:
            if getattr(type(module), method, None) is not getattr(nn.Module, method):
                kinds.append(f"overrides {method}")
        if kinds:
            out[prefix] = kinds
    return out


def state_dict_changes(model, entries: list[dict]) -> dict | None:
    """What ``model.state_dict()`` (on the meta device) shows differently from ``entries``:
    keys added in place of entries, entries dropped, entries with another shape or dtype;
    each attributed to the innermost module with state-dict hooks (or overridden methods)
    around it. None when it shows the entries as they are. The manifest's ``state_dict``
    section."""
    import torch

    hooks = module_hooks(model)
    try:
        got = model.state_dict(keep_vars=True)
    except Exception as e:  # a hook that cannot run on meta tensors: say so, compare nothing
        return {
            "hooks": hooks,
            "keys": [],
            "error": f"state_dict() raised {type(e).__name__}: {e}",
        }
    held = {e["fqn"]: e for e in entries}
    keys: list[dict] = []
    for fqn, value in got.items():
        entry = held.get(fqn)
        is_tensor = isinstance(value, torch.Tensor)
        if entry is None:
            key = {"fqn": fqn, "change": "added", "module": _owner(fqn, hooks)}
            if is_tensor:
                key.update(shape=list(value.shape), dtype=_dtype(value))
            keys.append(key)
        elif entry["kind"] != "extra_state" and (
            not is_tensor or list(value.shape) != entry["shape"] or _dtype(value) != entry["dtype"]
        ):
            key = {"fqn": fqn, "change": "reshaped", "module": _owner(fqn, hooks)}
            if is_tensor:
                key.update(shape=list(value.shape), dtype=_dtype(value))
            keys.append(key)
    for fqn in held:
        if fqn not in got:
            keys.append({"fqn": fqn, "change": "dropped", "module": _owner(fqn, hooks)})
    if not keys:
        return None
    dropped: dict[str, list[str]] = {}
    for key in keys:
        if key["change"] == "dropped":
            dropped.setdefault(key["module"], []).append(key["fqn"])
    for key in keys:
        if key["change"] == "added" and dropped.get(key["module"]):
            key["from"] = sorted(dropped[key["module"]])
    changed = {key["module"] for key in keys}
    return {"hooks": {m: k for m, k in hooks.items() if m in changed}, "keys": keys}


def _dtype(value) -> str:
    return str(value.dtype).removeprefix("torch.")


def _owner(fqn: str, hooks: dict[str, list[str]]) -> str:
    """The innermost module whose name prefixes ``fqn`` and that has a hook or method that
    can change what ``state_dict()`` returns (``""``, the model, when none does)."""
    parts = fqn.split(".")
    for n in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:n])
        if _SAVING.intersection(hooks.get(prefix, ())):
            return prefix
    return ""


def describe_changes(section: dict, limit: int = 4) -> list[str]:
    """The warning ``shardspec manifest`` prints for a ``state_dict`` section: one line per
    group of modules whose hooks change the same keys (relative to the module)."""
    if section.get("error"):
        return [
            f"{section['error']}: state-dict hooks of "
            f"{_names(sorted(section['hooks']) or [''], limit)} were not checked"
        ]
    groups: dict[tuple, list[str]] = {}
    per_module: dict[str, dict[str, list[str]]] = {}
    for key in section["keys"]:
        module = key["module"]
        rel = key["fqn"][len(module) + 1 :] if module else key["fqn"]
        per_module.setdefault(module, {}).setdefault(key["change"], []).append(rel)
    for module, changes in per_module.items():
        sig = (
            tuple(section["hooks"].get(module, ())),
            *(tuple(sorted(changes.get(c, ()))) for c in ("added", "dropped", "reshaped")),
        )
        groups.setdefault(sig, []).append(module)
    lines = []
    for (kinds, added, dropped, reshaped), modules in sorted(groups.items()):
        what = []
        if added and dropped:
            what.append(
                f"writes {', '.join(added)} in place of the "
                f"{_plural(len(dropped), 'parameter')} {', '.join(dropped)}"
            )
        elif added:
            what.append(f"adds {', '.join(added)}")
        elif dropped:
            what.append(f"leaves out {', '.join(dropped)}")
        if reshaped:
            what.append(f"changes the shape or dtype of {', '.join(reshaped)}")
        by = f" ({', '.join(kinds)})" if kinds else ""
        lines.append(f"{_names(sorted(modules), limit)}{by}: state_dict() {'; '.join(what)}")
    return lines


def _plural(n: int, word: str) -> str:
    return word if n == 1 else word + "s"


def _names(modules: list[str], limit: int) -> str:
    shown = [m or "the model" for m in modules[:limit]]
    more = f" and {len(modules) - limit} more" if len(modules) > limit else ""
    return ", ".join(shown) + more


def _module_kind(module) -> str:
    """ "linear", "embedding", "conv1d" (a module running transformers' own Conv1D
    forward: a Linear whose weight is stored ``[in, out]``) or the class name of a module
    holding parameters (what tensor-parallel styles derive from)."""
    from torch import nn

    if isinstance(module, nn.Linear):
        return LINEAR
    if isinstance(module, nn.Embedding):
        return EMBEDDING
    if qualified_name(forward_class(type(module))) in CONV1D_FORWARDS:
        return CONV1D
    return type(module).__name__


def _kw(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def write_manifest(factory: str, output: str, args: list[str]) -> tuple[int, list[str]]:
    """Build the model, write its manifest to ``output``; return the number of entries and
    the warning lines about its state-dict hooks (none when ``state_dict()`` shows the
    entries as they are)."""
    kwargs = dict(parse_arg(a) for a in args)
    model = build_model(factory, kwargs)
    entries = model_entries(model)
    changes = state_dict_changes(model, entries)
    text = dump_manifest(entries, factory, kwargs, changes)
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
    return len(entries), describe_changes(changes) if changes is not None else []
