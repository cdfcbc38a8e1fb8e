"""The compiler's stages by name, for tests, tools and the CLI:

    spec, diags = parse_file(path)          # text -> IR
    res, diags = check(spec)                # IR (+ manifest) -> resolved facts, findings
    text = emit(res, spec_path, import_name)  # resolved facts -> generated module

``compile_specs`` strings them together for ``shardspec compile``: it renders everything in
memory (``render_specs``) and writes nothing unless every spec passed, replacing files
atomically. ``-D`` overrides go to both ``check`` and ``emit``; the generated module takes
them as its default sizes and records them in its header.
"""

from __future__ import annotations

import difflib
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from shardspec.checks.run import check
from shardspec.findings.diagnostics import Diagnostic
from shardspec.frontend.parse import parse, parse_file
from shardspec.frontend.textfile import file_mode, read_text
from shardspec.inputs.manifest import Manifest
from shardspec.resolve.params import Resolved

__all__ = [
    "check",
    "compile_specs",
    "display_path",
    "emit",
    "lint_specs",
    "parse",
    "parse_file",
    "render_specs",
]

INPUT_CODES = frozenset({"SS001", "SS002", "SS003", "SS004", "SS006", "SS007"})


def display_path(path: str | Path) -> str:
    """The path as it appears in headers and diagnostics: relative to the working directory
    when inside it, with forward slashes."""
    p = Path(path)
    try:
        rel = p.resolve().relative_to(Path.cwd().resolve())
        return rel.as_posix()
    except ValueError:
        return p.as_posix()


def emit(
    res: Resolved,
    spec_path: str,
    import_name: str,
    *,
    overrides: dict[str, int] | None = None,
    world: int | None = None,
) -> str:
    """The generated module's text. Pass the ``-D`` values ``res`` was resolved with: they
    become the module's default sizes and are recorded in its header."""
    from shardspec.codegen import render_module

    return render_module(res, spec_path, import_name, overrides=overrides, world=world)


@dataclass
class CompileOutcome:
    diagnostics: list[Diagnostic] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    stale: list[tuple[str, str]] = field(default_factory=list)  # (path, unified diff)

    @property
    def errors(self) -> bool:
        return any(d.is_error for d in self.diagnostics)

    @property
    def input_error(self) -> bool:
        return any(d.is_error and d.code in INPUT_CODES for d in self.diagnostics)


def output_path(spec_path: str, out_dir: str) -> Path:
    name = Path(spec_path).name
    stem = name[: -len(".shard")] if name.endswith(".shard") else Path(name).stem
    # The output is imported by name: make it a Python identifier (my-model -> my_model).
    stem = re.sub(r"\W", "_", stem)
    if not stem or stem[0].isdigit():
        stem = f"_{stem}"
    return Path(out_dir) / f"{stem}.py"


def import_name(target: Path) -> str:
    """The dotted name a trainer imports ``target`` by: its path relative to the working
    directory (``generated.llama``), or just its stem where that path is not importable
    (outside the working directory, or not made of identifiers)."""
    rel = Path(display_path(target)).with_suffix("")
    if not rel.is_absolute() and all(p.isidentifier() for p in rel.parts):
        return ".".join(rel.parts)
    return rel.name


def lint_specs(
    paths: list[str],
    overrides: dict[str, int] | None = None,
    world: int | None = None,
    manifest: Manifest | None = None,
) -> tuple[list[tuple[str, Resolved | None]], CompileOutcome]:
    """Parse and check every spec; collect diagnostics and their source texts.
    ``manifest``: the model manifest for every spec, in place of the one each names."""
    out = CompileOutcome()
    results: list[tuple[str, Resolved | None]] = []
    for path in paths:
        shown = display_path(path)
        # Every span carries the displayed path, so findings, their source lines and
        # suppressions agree whichever way the path was given.
        spec, diags = parse_file(path, shown)
        if spec is not None:
            out.sources[shown] = spec.source
            res, more = check(spec, overrides=overrides, world=world, manifest=manifest)
            # a manifest's text only where a finding shows a line of it (a large one's
            # is read again then, not held: shardspec.inputs.manifest.Manifest.text)
            for m in (res.manifest, res.hf_manifest):
                if m is not None and any(d.span.file == m.path for d in more):
                    out.sources[m.path] = m.text
            out.diagnostics.extend(diags + more)
            results.append((shown, res))
        else:
            out.diagnostics.extend(diags)
            try:
                out.sources[shown] = read_text(path)
            except (OSError, UnicodeDecodeError):
                pass
            results.append((shown, None))
    return results, out


def render_specs(
    paths: list[str],
    out_dir: str,
    *,
    overrides: dict[str, int] | None = None,
    world: int | None = None,
) -> tuple[CompileOutcome, list[tuple[Path, str]]]:
    """Check every spec and render each one's module in memory. Renders nothing (an empty
    list) when any spec has an error."""
    results, out = lint_specs(paths, overrides, world)
    out.diagnostics.extend(_colliding_outputs([shown for shown, _ in results], out_dir))
    if out.errors:
        return out, []
    rendered: list[tuple[Path, str]] = []
    for shown, res in results:
        assert res is not None
        target = output_path(shown, out_dir)
        text = emit(res, shown, import_name(target), overrides=overrides, world=world)
        rendered.append((target, text))
    return out, rendered


def _colliding_outputs(shown: list[str], out_dir: str) -> list[Diagnostic]:
    """SS004 for specs that would write the same output file (same name, other folders)."""
    from shardspec.findings.codes import diag
    from shardspec.findings.diagnostics import Span

    first: dict[Path, str] = {}
    found = []
    for spec in shown:
        target = output_path(spec, out_dir)
        if target in first and first[target] != spec:
            found.append(
                diag(
                    "SS004",
                    f"specs {first[target]} and {spec} would both write {display_path(target)}",
                    Span("<command line>", 1, 1),
                    "compile them into different output folders (-o DIR), or rename one",
                )
            )
        first.setdefault(target, spec)
    return found


def stale_diff(target: Path, text: str) -> str | None:
    """A unified diff from ``target`` on disk to ``text``; ``None`` when they are equal. A
    missing file diffs as empty."""
    try:
        current: str | None = target.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        current = None
    if current == text:
        return None
    shown = display_path(target)
    return "".join(
        difflib.unified_diff(
            (current or "").splitlines(keepends=True),
            text.splitlines(keepends=True),
            f"{shown} (on disk)" if current is not None else f"{shown} (missing)",
            f"{shown} (from spec)",
        )
    )


def compile_specs(
    paths: list[str],
    out_dir: str,
    *,
    check_only: bool = False,
    overrides: dict[str, int] | None = None,
    world: int | None = None,
) -> CompileOutcome:
    """Check every spec; if none has an error, write (or with ``check_only`` compare) each
    one's module. Writes nothing at all when any spec has an error."""
    out, rendered = render_specs(paths, out_dir, overrides=overrides, world=world)
    if out.errors:
        return out
    if check_only:
        for target, text in rendered:
            diff = stale_diff(target, text)
            if diff is not None:
                out.stale.append((display_path(target), diff))
        return out
    _write_all(rendered, out)
    return out


def _write_all(rendered: list[tuple[Path, str]], out: CompileOutcome) -> None:
    """Write every file to a temporary sibling first, then move all into place."""
    temps: list[tuple[str, Path]] = []
    mode = file_mode()
    try:
        for target, text in rendered:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            temps.append((tmp, target))
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
            os.chmod(tmp, mode)
        for tmp, target in temps:
            os.replace(tmp, target)
            out.written.append(display_path(target))
    finally:
        for tmp, _ in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)


def silenced_findings(
    paths: list[str], overrides: dict[str, int] | None = None, world: int | None = None
) -> list[Diagnostic]:
    """The findings of ``paths`` that ``# shardspec: ignore[...]`` comments silence (lint
    leaves them out; SARIF reports them as suppressed): each spec with suppressions is
    checked again without them, and what that finds beyond lint's findings is silenced."""
    from collections import Counter
    from dataclasses import replace

    out: list[Diagnostic] = []
    for path in paths:
        spec, _ = parse_file(path, display_path(path))
        if spec is None or not spec.suppressions:
            continue
        _, kept = check(spec, overrides=overrides, world=world)
        _, every = check(replace(spec, suppressions=()), overrides=overrides, world=world)
        out.extend((Counter(every) - Counter(kept)).elements())
    return sorted(out, key=Diagnostic.sort_key)
