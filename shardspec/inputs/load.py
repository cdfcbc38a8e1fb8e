"""The files a spec names, loaded for the checks: its model manifest (``manifest
"FILE"``) and its ``hf "FILE" { ... }`` block's HF manifest, each as the manifest or as
the finding that says why it could not be read (SS002: cannot be read; SS003: malformed),
placed at the statement that names the file. Paths are relative to the spec's folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span
from shardspec.frontend import ir
from shardspec.inputs.hfmanifest import HFManifest, HFManifestError, load_hf_manifest
from shardspec.inputs.manifest import Manifest, ManifestError, load_manifest

__all__ = [
    "Loaded",
    "hf_manifest_path",
    "load_spec_hf_manifest",
    "load_spec_manifest",
    "manifest_path",
]

M = TypeVar("M", Manifest, HFManifest)

_MANIFEST_HINTS = (
    "the path is relative to the spec's folder; "
    "create it with `shardspec manifest pkg.module:factory -o FILE`",
    "regenerate it with `shardspec manifest MODULE:FUNCTION -o FILE`",
)
_HF_MANIFEST_HINTS = (
    "the path is relative to the spec's folder; create it with "
    "`shardspec hf-manifest HF_DIR -o FILE`",
    "regenerate it with `shardspec hf-manifest HF_DIR -o FILE`",
)


@dataclass(frozen=True)
class Loaded(Generic[M]):
    """A manifest the spec names: ``manifest`` None when the spec names none, or with
    the ``findings`` that say why it could not be read."""

    manifest: M | None = None
    findings: list[Diagnostic] = field(default_factory=list)


def _spec_relative(spec: ir.Spec, name: str) -> str:
    """``name``, a path the spec names, relative to the spec's folder."""
    if os.path.isabs(name):
        return name
    return os.path.normpath(os.path.join(os.path.dirname(spec.path) or ".", name))


def manifest_path(spec: ir.Spec) -> str | None:
    """The model manifest's path (None: the spec names none)."""
    return None if spec.manifest is None else _spec_relative(spec, spec.manifest)


def hf_manifest_path(spec: ir.Spec) -> str | None:
    """The hf block's HF manifest's path (None: no hf block, or it names no file)."""
    if spec.hf is None or spec.hf.manifest is None:
        return None
    return _spec_relative(spec, spec.hf.manifest)


def _unreadable(
    path: str, e: ManifestError | HFManifestError, span: Span, hints: tuple[str, str]
) -> list[Diagnostic]:
    """The finding for a manifest that could not be read (``unreadable``) or is malformed."""
    unreadable = e.code == "SS002" if isinstance(e, HFManifestError) else "cannot read" in str(e)
    if unreadable:
        return [diag("SS002", str(e), span, hints[0])]
    where = path if (e.line, e.col) == (1, 1) else f"{path}:{e.line}:{e.col}"
    return [diag("SS003", f"{where}: {e}", span, hints[1])]


def load_spec_manifest(spec: ir.Spec) -> Loaded[Manifest]:
    """The spec's model manifest, or the SS002/SS003 finding at the ``manifest`` statement."""
    path = manifest_path(spec)
    if path is None:
        return Loaded()
    try:
        return Loaded(load_manifest(path))
    except ManifestError as e:
        span = spec.manifest_span or Span(spec.path, 1, 1)
        return Loaded(None, _unreadable(path, e, span, _MANIFEST_HINTS))


def load_spec_hf_manifest(spec: ir.Spec) -> Loaded[HFManifest]:
    """The HF manifest an ``hf "FILE"`` block names, or the SS002/SS003 finding at the
    file name."""
    path = hf_manifest_path(spec)
    if path is None or spec.hf is None:
        return Loaded()
    try:
        return Loaded(load_hf_manifest(path))
    except HFManifestError as e:
        span = spec.hf.manifest_span or spec.hf.span
        return Loaded(None, _unreadable(path, e, span, _HF_MANIFEST_HINTS))
