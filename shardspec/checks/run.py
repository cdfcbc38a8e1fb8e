"""Run every check in order and apply ``# shardspec: ignore[...]`` suppressions."""

from __future__ import annotations

from shardspec.checks.coverage import COVERAGE_CHECKS
from shardspec.checks.fp8 import check_fp8_items, check_fp8_keys
from shardspec.checks.heads import (
    check_heads_items,
    check_replicated_items,
    check_replicated_sizes,
)
from shardspec.checks.hf import check_hf_items, check_hf_units, no_hf_manifest
from shardspec.checks.keys import check_key_layout_name, check_key_layout_units
from shardspec.checks.layouts import LAYOUT_CHECKS
from shardspec.checks.pipeline import check_pipeline_block, check_stages
from shardspec.checks.structure import STRUCTURE_CHECKS
from shardspec.checks.tensor_parallel import TENSOR_PARALLEL_CHECKS
from shardspec.checks.views import VIEW_RESOLVED_CHECKS, VIEW_SPEC_CHECKS, check_view_sizes
from shardspec.findings.codes import BY_CODE, RETIRED, diag
from shardspec.findings.diagnostics import Diagnostic, Span
from shardspec.frontend import ir
from shardspec.inputs.load import load_spec_hf_manifest, load_spec_manifest
from shardspec.inputs.manifest import Manifest
from shardspec.resolve import hf as resolve_hf
from shardspec.resolve.params import Resolved, resolve


def check(
    spec: ir.Spec,
    *,
    overrides: dict[str, int] | None = None,
    world: int | None = None,
    manifest: Manifest | None = None,
    use_manifest: bool = True,
    use_hf_manifest: bool = True,
) -> tuple[Resolved, list[Diagnostic]]:
    """All checks on a parsed spec. Returns the resolved facts and sorted diagnostics."""
    diags: list[Diagnostic] = []
    broken: set[int] = set()
    for c in (
        *VIEW_SPEC_CHECKS,
        *STRUCTURE_CHECKS,
        check_heads_items,
        check_replicated_items,
        check_key_layout_name,
    ):
        diags.extend(c(spec, broken))
    diags.extend(check_pipeline_block(spec, broken))
    if manifest is None and use_manifest:
        loaded = load_spec_manifest(spec)
        manifest = loaded.manifest
        diags.extend(loaded.findings)
    hf_bad: set[int] = set()
    hf_manifest = None
    stray: dict[str, str] | None = None
    if spec.hf is not None:
        found, hf_bad = check_hf_items(spec)
        diags.extend(found)
        diags.extend(check_fp8_items(spec))
        diags.extend(no_hf_manifest(spec))
        if use_hf_manifest:
            hf_loaded = load_spec_hf_manifest(spec)
            hf_manifest = hf_loaded.manifest
            diags.extend(hf_loaded.findings)
            if hf_manifest is not None:
                # the FP8 checks (SS112) and the unexpected keys (SS073) both ask
                stray = resolve_hf.stray_scales(spec.hf, hf_manifest)
                diags.extend(check_fp8_keys(spec, hf_manifest, stray))
    res = resolve(spec, manifest, broken=broken, overrides=overrides, world=world)
    res.hf_manifest = hf_manifest
    if res.mesh_error and res.mesh_error_code == "SS004":
        diags.append(
            diag(
                "SS004",
                res.mesh_error,
                Span("<command line>", 1, 1),
                "-D takes a mesh axis of the spec, or world",
            )
        )
    elif spec.views and not any(d.code in ("SS010", "SS101") for d in diags):
        diags.extend(check_view_sizes(res))
    elif (
        res.mesh_error
        and not spec.views
        and spec.mesh is not None
        and not any(d.code == "SS010" for d in diags)
        and not (manifest is None and _only_world_missing(spec, world))
    ):
        diags.append(
            diag(
                "SS010",
                res.mesh_error,
                spec.mesh.span,
                res.mesh_error_hint
                or "give the world size with `mesh over N ranks { ... }` or "
                "`-D world=N`, and make the axes multiply to it",
            )
        )
    if manifest is not None:
        for resolved_check in (
            *COVERAGE_CHECKS,
            *LAYOUT_CHECKS,
            *TENSOR_PARALLEL_CHECKS,
            *VIEW_RESOLVED_CHECKS,
            check_replicated_sizes,
            check_key_layout_units,
        ):
            diags.extend(resolved_check(res))
        diags.extend(check_stages(res))
        if spec.hf is not None:
            # One finding per cause: where SS133 names the pad that makes an uneven split
            # even, SS023's warning on the same dimension says less.
            uneven: set[Span] = set()
            diags.extend(check_hf_units(res, hf_manifest, hf_bad, stray, uneven=uneven))
            diags = [d for d in diags if not (d.code == "SS023" and d.span in uneven)]
    elif spec.manifest is None:
        diags.append(
            diag(
                "SS061",
                "no manifest: shape, coverage and precedence checks did not run",
                Span(spec.path, 1, 1),
                'add `manifest "model.json"` (made by `shardspec manifest`)',
            )
        )
    # Checks that need a manifest (or, for the hf block, an HF manifest) did not run
    # without one: a suppression of their codes is not known to be unused.
    partial = manifest is None or (spec.hf is not None and hf_manifest is None)
    return res, apply_suppressions(spec, diags, partial=partial)


def _only_world_missing(spec: ir.Spec, world: int | None) -> bool:
    """True when the mesh is fine but for an unknown world size, which only checks that
    compute layouts need (a spec without a manifest runs none; the runtime knows the world)."""
    assert spec.mesh is not None
    rest = [a for a in spec.mesh.axes if a.size is None]
    return len(rest) == 1 and spec.mesh.world is None and world is None


def apply_suppressions(
    spec: ir.Spec, diags: list[Diagnostic], *, partial: bool = False
) -> list[Diagnostic]:
    """Drop findings silenced by a suppression comment on their line, or on the first line
    of the rule they point into; report suppressions that silence nothing. With
    ``partial`` (a manifest or HF manifest missing), a suppression whose codes all need a
    manifest is not reported: its checks did not run."""
    rule_lines = {  # (none without suppressions: a span is worked out when asked for)
        r.span.line: (r.span.line, r.span.end_line or r.span.line)
        for r in (spec.rules if spec.suppressions else ())
    }
    used: set[int] = set()
    kept = []
    for d in diags:
        silenced = False
        if d.span.file == spec.path:
            for i, s in enumerate(spec.suppressions):
                lo, hi = rule_lines.get(s.span.line, (s.span.line, s.span.line))
                if lo <= d.span.line <= hi and d.code in s.codes:
                    used.add(i)
                    silenced = True
        if not silenced:
            kept.append(d)
    for i, s in enumerate(spec.suppressions):
        unknown = [c for c in s.codes if c not in BY_CODE]
        retired = [c for c in unknown if c in RETIRED]
        if not s.codes:
            kept.append(
                diag(
                    "SS060",
                    "the suppression names no code",
                    s.span,
                    "write the codes to silence, e.g. `# shardspec: ignore[SS023]`, "
                    "or delete the comment",
                )
            )
        elif unknown:
            what = f" ({', '.join(retired)} retired: no check reports it)" if retired else ""
            kept.append(
                diag(
                    "SS060",
                    f"unknown code(s) {', '.join(unknown)} in suppression{what}",
                    s.span,
                    "see docs/checks.md for the codes",
                )
            )
        elif i not in used and not (partial and all(BY_CODE[c].needs_manifest for c in s.codes)):
            kept.append(
                diag(
                    "SS060",
                    f"suppression of {', '.join(s.codes)} silences nothing",
                    s.span,
                    "delete the comment",
                )
            )
    return sorted(kept, key=Diagnostic.sort_key)
