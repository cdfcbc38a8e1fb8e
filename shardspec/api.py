"""The compiler's stages by name, for tests, tools and the CLI:

    spec, diags = parse_file(path)          # text -> IR
    res, diags = check(spec)                # IR (+ manifest) -> resolved facts, findings
    text = emit(res, spec_path, import_name)  # resolved facts -> generated module

``compile_specs`` strings them together for ``shardspec compile``: it renders everything in
memory and writes nothing unless every spec passed, replacing files atomically.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from shardspec.checks.run import check
from shardspec.diagnostics import Diagnostic
from shardspec.parse import parse, parse_file
from shardspec.resolve import Resolved

__all__ = ["check", "compile_specs", "display_path", "emit", "parse", "parse_file"]

INPUT_CODES = frozenset({"SS001", "SS002", "SS003", "SS004"})


def display_path(path: str | Path) -> str:
    """The path as it appears in headers and diagnostics: relative to the working directory
    when inside it, with forward slashes."""
    p = Path(path)
    try:
        rel = p.resolve().relative_to(Path.cwd().resolve())
        return rel.as_posix()
    except ValueError:
        return p.as_posix()


def emit(res: Resolved, spec_path: str, import_name: str) -> str:
    from shardspec.codegen import render_module

    return render_module(res, spec_path, import_name)


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
    return Path(out_dir) / f"{stem}.py"


def lint_specs(
    paths: list[str], overrides: dict[str, int] | None = None, world: int | None = None
) -> tuple[list[tuple[str, Resolved | None]], CompileOutcome]:
    """Parse and check every spec; collect diagnostics and their source texts."""
    out = CompileOutcome()
    results: list[tuple[str, Resolved | None]] = []
    for path in paths:
        shown = display_path(path)
        spec, diags = parse_file(path)
        if spec is not None:
            spec = spec.model_copy(update={"path": shown})
            diags = [_reroot(d, str(path), shown) for d in diags]
            out.sources[shown] = spec.source
            res, more = check(spec, overrides=overrides, world=world)
            if res.manifest is not None:
                out.sources[res.manifest.path] = res.manifest.text
            out.diagnostics.extend(diags + more)
            results.append((shown, res))
        else:
            out.diagnostics.extend(_reroot(d, str(path), shown) for d in diags)
            try:
                out.sources[shown] = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                pass
            results.append((shown, None))
    return results, out


def _reroot(d: Diagnostic, old: str, new: str) -> Diagnostic:
    if d.span.file != old:
        return d
    from dataclasses import replace

    return replace(d, span=replace(d.span, file=new))


def compile_specs(
    paths: list[str],
    out_dir: str,
    *,
    check_only: bool = False,
    overrides: dict[str, int] | None = None,
    world: int | None = None,
) -> CompileOutcome:
    results, out = lint_specs(paths, overrides, world)
    if out.errors:
        return out
    rendered: list[tuple[Path, str]] = []
    for shown, res in results:
        assert res is not None
        target = output_path(shown, out_dir)
        import_name = ".".join(Path(display_path(target)).with_suffix("").parts)
        rendered.append((target, emit(res, shown, import_name)))
    if check_only:
        for target, text in rendered:
            try:
                current = target.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                current = None
            if current != text:
                diff = "".join(
                    difflib.unified_diff(
                        (current or "").splitlines(keepends=True),
                        text.splitlines(keepends=True),
                        f"{display_path(target)} (on disk)",
                        f"{display_path(target)} (from spec)",
                    )
                )
                out.stale.append(
                    (display_path(target), diff if current is not None else "missing\n")
                )
        return out
    _write_all(rendered, out)
    return out


def _write_all(rendered: list[tuple[Path, str]], out: CompileOutcome) -> None:
    """Write every file to a temporary sibling first, then move all into place."""
    temps: list[tuple[str, Path]] = []
    try:
        for target, text in rendered:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
            temps.append((tmp, target))
        for tmp, target in temps:
            os.replace(tmp, target)
            out.written.append(display_path(target))
    finally:
        for tmp, _ in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
