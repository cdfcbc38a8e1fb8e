"""The HF manifest: a Hugging Face checkpoint described without its weights.

``shardspec hf-manifest DIR -o FILE`` writes one from a Hugging Face model directory
(``config.json`` and the safetensors headers of ``model.safetensors.index.json``'s files, or
of a single ``model.safetensors``); an ``hf "FILE" { ... }`` block names it, and lint checks
the mapping against its keys, shapes and config. The format::

    {"format": "shardspec-hf-manifest/1",
      "config": {"hidden_size": 64, ...},
      "tensors": {
        "lm_head.weight": {"shape": [256, 64], "dtype": "F32", "file": "model.safetensors"},
        ...
      }
    }

Safetensors headers are read here in pure Python (8-byte little-endian length, then JSON);
the tensor data is never read, and nothing imports torch.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from shardspec.core.jsontext import JSONTextError, loads
from shardspec.core.paths import Escape, escape
from shardspec.frontend.textfile import JSON_STRING, positions, read_text

FORMAT = "shardspec-hf-manifest/1"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the header size
_KEY = re.compile(r"(?m)^[ \t]*(" + JSON_STRING + r'):\s*\{"shape"')


class HFManifestError(ValueError):
    """Why an HF manifest (or an HF directory) could not be read. ``code``: SS002 when
    a file cannot be read, SS003 when it is malformed; ``line``/``col`` are 1-based."""

    def __init__(
        self, message: str, code: str = "SS003", hint: str = "", line: int = 1, col: int = 1
    ) -> None:
        super().__init__(message)
        self.code, self.hint, self.line, self.col = code, hint, line, col


class HFTensor(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    shape: tuple[StrictInt, ...]
    dtype: str
    file: str


class HFManifestFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str
    config: dict[str, Any]
    tensors: dict[str, HFTensor]


@dataclass(frozen=True)
class HFManifest:
    path: str
    config: dict[str, Any]
    tensors: dict[str, HFTensor]
    text: str = ""

    @cached_property
    def _positions(self) -> dict[str, tuple[int, int]]:
        return positions(self.text, _KEY)

    def position(self, key: str) -> tuple[int, int]:
        """(line, col) of a tensor's key in the file, for diagnostics ((1, 1) if unknown)."""
        return self._positions.get(key, (1, 1))


def load_hf_manifest(path: str | Path) -> HFManifest:
    """Read and validate an HF manifest. Raises :class:`HFManifestError`."""
    p = Path(path)
    try:
        text = read_text(p)
    except (OSError, UnicodeDecodeError) as e:
        raise HFManifestError(
            f"cannot read HF manifest {str(p)!r}: {getattr(e, 'strerror', None) or e}",
            "SS002",
        ) from None
    try:
        raw = loads(text)
    except JSONTextError as e:
        raise HFManifestError(
            f"HF manifest is not valid JSON: {e.reason}", line=e.line, col=e.col
        ) from None
    if isinstance(raw, dict) and raw.get("format") != FORMAT:
        raise HFManifestError(f"HF manifest field format: expected {FORMAT!r}")
    try:
        mf = HFManifestFile.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(root)"
        raise HFManifestError(f"HF manifest field {where}: {first['msg']}") from None
    manifest = HFManifest(str(path), mf.config, mf.tensors, text)
    for key, t in mf.tensors.items():
        if any(s < 0 for s in t.shape):
            line, col = manifest.position(key)
            raise HFManifestError(
                f"HF manifest tensor {key!r} has a negative size", line=line, col=col
            )
    return manifest


# ----------------------------------------------------------------------------- writing


def read_safetensors_header(path: str | Path) -> dict[str, dict[str, Any]]:
    """The tensors of a safetensors file: ``{name: {"dtype", "shape"}}`` (``__metadata__``
    left out), read from its header alone. Raises :class:`HFManifestError`."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFManifestError(f"{p}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise HFManifestError(f"{p}: safetensors header length {n} is not plausible")
            size = os.fstat(f.fileno()).st_size
            if 8 + n > size:
                raise HFManifestError(
                    f"{p}: safetensors header of {n} bytes runs past the end of the file "
                    f"({size} bytes)"
                )
            blob = f.read(n)
    except OSError as e:
        raise HFManifestError(f"cannot read {str(p)!r}: {e.strerror or e}", "SS002") from None
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: a long number too
        raise HFManifestError(f"{p}: the safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise HFManifestError(f"{p}: the safetensors header is not a JSON object")
    out: dict[str, dict[str, Any]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if (
            not isinstance(shape, list)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
            or not isinstance(dtype, str)
        ):
            raise HFManifestError(f"{p}: tensor {name!r} has no valid dtype and shape")
        out[name] = {"dtype": dtype, "shape": shape}
    return out


def _read_json(path: Path, what: str) -> Any:
    try:
        text = read_text(path)
    except (OSError, UnicodeDecodeError) as e:
        raise HFManifestError(
            f"cannot read {what} {str(path)!r}: {getattr(e, 'strerror', None) or e}", "SS002"
        ) from None
    try:
        return loads(text)
    except JSONTextError as e:
        raise HFManifestError(
            f"{path}:{e.line}:{e.col}: {what} is not valid JSON: {e.reason}"
        ) from None


_LINK_HINT = (
    "the checkpoint links outside its folder (only Hugging Face's cache may, from "
    "snapshots/<revision>/ to ../../blobs/): copy the folder with `cp -rL` and run "
    "hf-manifest on the copy"
)
_LINKS_OUT = (Escape.LINK_OUT, Escape.FILE_LINK_OUT)


def _inside(root: Path, name: object) -> str:
    """``name`` (a weight_map file) if it is a file inside ``root`` (the rule of
    :mod:`shardspec.core.paths`, which load_hf applies too)."""
    why = escape(root, name)
    if why is Escape.NO_NAME:
        raise HFManifestError(f"{root / INDEX}: weight_map names a file that is not a string")
    if why is not None:
        hint = _LINK_HINT if why in _LINKS_OUT else ""
        raise HFManifestError(f"{root / INDEX}: weight_map file {name!r} {why.value}", hint=hint)
    assert isinstance(name, str)
    return name


def _fixed(root: Path, name: str) -> Path:
    """``root / name`` for one of the folder's fixed names (config.json, the index, the
    single file), refused when it links out of the folder (the same rule)."""
    why = escape(root, name)
    if why is not None:
        raise HFManifestError(f"{root / name}: the file {why.value}", hint=_LINK_HINT)
    return root / name


def build_hf_manifest(directory: str | Path) -> dict[str, Any]:
    """The HF manifest of a Hugging Face model directory, as a JSON object."""
    root = Path(directory)
    if not root.is_dir():
        raise HFManifestError(
            f"{str(root)!r} is not a directory",
            "SS002",
            "give the folder that holds config.json and the safetensors files",
        )
    config = _read_json(_fixed(root, "config.json"), "config.json")
    if not isinstance(config, dict):
        raise HFManifestError(f"{root / 'config.json'}: config.json is not a JSON object")
    index_path = root / INDEX
    files: dict[str, list[str] | None] = {}
    if index_path.is_file():
        index = _read_json(_fixed(root, INDEX), INDEX)
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict):
            raise HFManifestError(f"{index_path}: {INDEX} has no weight_map object")
        for key, name in wmap.items():
            files.setdefault(_inside(root, name), []).append(key)  # type: ignore[union-attr]
    elif (root / SINGLE).is_file():
        _fixed(root, SINGLE)
        files[SINGLE] = None
    else:
        raise HFManifestError(
            f"{root}: neither {INDEX} nor {SINGLE}",
            "SS002",
            "the directory must hold safetensors weights (save_pretrained writes them)",
        )
    tensors: dict[str, dict[str, Any]] = {}
    for name in sorted(files):
        header = read_safetensors_header(root / name)
        wanted = files[name]
        keys = sorted(header) if wanted is None else sorted(wanted)
        for key in keys:
            if key not in header:
                raise HFManifestError(
                    f"{index_path}: weight_map puts {key!r} in {name}, whose header lacks it"
                )
            if key in tensors:
                raise HFManifestError(f"{root}: tensor {key!r} is in two files")
            tensors[key] = {**header[key], "file": name}
    return {"format": FORMAT, "config": config, "tensors": tensors}


def dump_hf_manifest(manifest: dict[str, Any]) -> str:
    """Canonical text: sorted, one tensor per line, stable across runs."""
    config = json.dumps(manifest["config"], sort_keys=True)
    lines = [
        f"{json.dumps(k)}: "
        + json.dumps(
            {"shape": list(t["shape"]), "dtype": t["dtype"], "file": t["file"]},
            separators=(", ", ": "),
        )
        for k, t in sorted(manifest["tensors"].items())
    ]
    body = ",\n    ".join(lines)
    tensors = "{\n    " + body + "\n  }" if lines else "{}"
    return f'{{"format": {json.dumps(FORMAT)},\n  "config": {config},\n  "tensors": {tensors}\n}}\n'


def write_hf_manifest(directory: str | Path, output: str | Path) -> int:
    """Build the manifest of ``directory`` and write it to ``output``; the tensor count."""
    manifest = build_hf_manifest(directory)
    text = dump_hf_manifest(manifest)
    try:
        Path(output).write_text(text, encoding="utf-8", newline="\n")
    except OSError as e:
        raise HFManifestError(
            f"cannot write {str(output)!r}: {e.strerror or e}", "SS002", "check the path"
        ) from None
    return len(manifest["tensors"])
