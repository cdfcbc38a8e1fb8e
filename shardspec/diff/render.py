"""The output of ``shardspec diff``, from :mod:`shardspec.diff.facts`' values: text for
people, or JSON (format ``shardspec-diff/1``, with the keys :data:`JSON_KEYS` names) for
tools."""

from __future__ import annotations

import json
from typing import Any

from shardspec.diff.facts import (
    HFChange,
    HFFacts,
    ParamChange,
    Problem,
    Refusal,
    Side,
    SpecDiff,
    Status,
)
from shardspec.findings.diagnostics import attach_sources, render_all_text, render_json

FORMAT = "shardspec-diff/1"
# The top-level keys of the JSON output, in order (a test holds them).
JSON_KEYS = ("format", "old", "new", "status", "verdict", "mesh", "params", "checkpoint", "hf")

VERDICTS = {
    Status.SAME: "no change in layout, checkpoint keys or the hf mapping",
    Status.CHANGED: "changed; checkpoints saved under OLD (and Hugging Face checkpoints "
    "that load under OLD) load under NEW",
    Status.INCOMPATIBLE: "checkpoint-incompatible: a checkpoint saved under OLD, or a "
    "Hugging Face checkpoint that loads under OLD, does not load under NEW",
}


def render_refusal(x: Refusal, fmt: str = "text") -> str:
    """The findings that keep diff from comparing, as lint prints them."""
    diags = attach_sources(list(x.diagnostics), x.sources)
    return render_json(diags) if fmt == "json" else render_all_text(diags)


# ----------------------------------------------------------------------------- text


def render_text(d: SpecDiff) -> str:
    """What ``shardspec diff`` prints for people."""
    lines = [f"shardspec diff {d.old_path} (OLD) -> {d.new_path} (NEW)"]
    if d.mesh:
        lines += ["", "mesh:"]
        lines += [f"  {c.subject}: {c.old or '(none)'} -> {c.new or '(none)'}" for c in d.mesh]
    lines.append("")
    if d.params:
        # Groups whose change reads the same (they differ only in what stays) print once.
        merged: dict[tuple[str, ...], list[tuple[str, int]]] = {}
        for c in d.params:
            merged.setdefault(tuple(_change_lines(c)), []).extend(c.globs)
        n = sum(c.count for c in d.params)
        lines.append(
            f"layout: {n} parameter(s) change in {len(merged)} group(s); {d.unchanged} unchanged"
        )
        for body, globs in merged.items():
            lines += ["", *_globs_lines(tuple(globs), "param", "  "), *body]
    else:
        lines.append(f"layout: no change ({d.unchanged} parameter(s))")
    lines += ["", "checkpoints:"]
    if d.keys is not None:
        lines.append(
            f"  key layout (`checkpoint keys`): {d.keys[0]} -> {d.keys[1]}; a checkpoint saved "
            f"under OLD loads under NEW with keys={d.keys[0]!r}"
        )
    if d.checkpoint:
        lines.append("  a checkpoint saved under OLD does NOT load under NEW:")
        lines += _problem_lines(d.checkpoint)
    else:
        lines.append(
            "  checkpoints saved under OLD load under NEW (same keys, global shapes, dtypes)"
        )
    if d.fallbacks:
        lines.append("  NEW reads these components from the whole tensor OLD stored:")
        lines += [f"    {_glob_text(g, n, 'key')}" for g, n in d.fallbacks]
    if d.hf is not None:
        lines += ["", "Hugging Face (hf block):"]
        lines += _hf_lines(d.hf)
    lines += ["", f"verdict (exit {int(d.status)}): {VERDICTS[d.status]}"]
    return "\n".join(lines) + "\n"


def _glob_text(glob: str, count: int, noun: str) -> str:
    return glob if count == 1 else f"{glob} ({count} {noun}s)"


def _globs_lines(globs: tuple[tuple[str, int], ...], noun: str, indent: str) -> list[str]:
    return [f"{indent}{_glob_text(g, n, noun)}" for g, n in globs]


def _arrow(label: str, old: str, new: str) -> str:
    return f"    {label + ':':<14}{old} -> {new}" if old != new else ""


def _change_lines(c: ParamChange) -> list[str]:
    """What changes for one group of parameters: only what differs."""
    out: list[str] = []
    a, b = c.old, c.new
    if a.state != "placed" or b.state != "placed":
        out.append(_arrow("state", _state(a), _state(b)))
        return [x for x in out if x]
    out.append(_arrow("mesh", a.mesh, b.mesh))
    out.append(_arrow("dims", a.dims, b.dims))
    out += [_arrow(axis, x, y) for axis, x, y in c.axis_changes]
    if not c.axis_changes:  # (the axis lines say it otherwise)
        out.append(_arrow("DTensor", a.dtensor, b.dtensor))
    out.append(
        _arrow(
            "local shape",
            f"{list(a.local_shape)} on rank {a.rank}",
            f"{list(b.local_shape)} on rank {b.rank}",
        )
    )
    out.append(_arrow("every rank", _shapes(a), _shapes(b)))
    out.append(_arrow("stage", a.stage or "-", b.stage or "-"))
    out.append(_arrow("style", a.style, b.style))
    return [x for x in out if x]


def _state(s: Side) -> str:
    return s.state + (f" ({s.note})" if s.note else "")


def _shapes(s: Side) -> str:
    return "; ".join(f"{list(shape)} on {n}" for shape, n in s.shapes)


def _problem_lines(problems: tuple[Problem, ...]) -> list[str]:
    out = []
    for p in problems:
        first, *rest = p.globs
        out.append(f"    {p.kind}: {_glob_text(*first, 'key')}")
        out += _globs_lines(tuple(rest), "key", " " * (len(p.kind) + 6))
        out.append(f"      why: {p.why}")
    return out


def _hf_lines(h: HFFacts) -> list[str]:
    out = [f"  - {x}" for x in h.removed_lines] + [f"  + {x}" for x in h.added_lines]
    if not h.changed:
        out.append("  no change: every storage unit reads the same Hugging Face tensors")
    for u in h.units:
        out += _hf_unit_lines(u)
    if h.keys_only_old:
        out.append("  HF keys only OLD reads (and export_hf writes):")
        out += _globs_lines(h.keys_only_old, "key", "    ")
    if h.keys_only_new:
        out.append("  HF keys only NEW reads (and export_hf writes):")
        out += _globs_lines(h.keys_only_new, "key", "    ")
    if h.problems:
        out.append("  an HF checkpoint that loads under OLD does NOT load under NEW:")
        out += _problem_lines(h.problems)
    elif h.changed:
        out.append("  HF checkpoints that load under OLD load under NEW")
    return out


def _hf_unit_lines(u: HFChange) -> list[str]:
    return [
        *_globs_lines(u.globs, "unit", "  "),
        f"    {'OLD reads:':<14}{u.old}",
        f"    {'NEW reads:':<14}{u.new}",
    ]


# ----------------------------------------------------------------------------- JSON


def render_json_diff(d: SpecDiff) -> str:
    """The JSON output (``--format json``)."""
    doc: dict[str, Any] = {
        "format": FORMAT,
        "old": d.old_path,
        "new": d.new_path,
        "status": int(d.status),
        "verdict": d.status.name.lower(),
        "mesh": [{"subject": c.subject, "old": c.old, "new": c.new} for c in d.mesh],
        "params": {
            "changed": [_change_json(c) for c in d.params],
            "unchanged": d.unchanged,
        },
        "checkpoint": {
            "compatible": not d.checkpoint,
            "problems": [_problem_json(p) for p in d.checkpoint],
            "fallbacks": _globs_json(d.fallbacks),
            "keys": None if d.keys is None else {"old": d.keys[0], "new": d.keys[1]},
        },
        "hf": None if d.hf is None else _hf_json(d.hf),
    }
    assert tuple(doc) == JSON_KEYS
    return json.dumps(doc, indent=2) + "\n"


def _globs_json(globs: tuple[tuple[str, int], ...]) -> list[dict[str, Any]]:
    return [{"glob": g, "count": n} for g, n in globs]


def _side_json(s: Side) -> dict[str, Any]:
    return {
        "state": s.state,
        "note": s.note,
        "mesh": s.mesh,
        "dims": s.dims,
        "placements": [{"axis": a, "placement": p} for a, p in s.axes],
        "dtensor": s.dtensor,
        "rank": s.rank,
        "local_shape": list(s.local_shape),
        "shapes": [{"shape": list(shape), "ranks": n} for shape, n in s.shapes],
        "stage": s.stage,
        "style": s.style,
    }


def _change_json(c: ParamChange) -> dict[str, Any]:
    return {
        "params": _globs_json(c.globs),
        "count": c.count,
        "old": _side_json(c.old),
        "new": _side_json(c.new),
        "axes": [{"axis": a, "old": x, "new": y} for a, x, y in c.axis_changes],
    }


def _problem_json(p: Problem) -> dict[str, Any]:
    return {"kind": p.kind, "keys": _globs_json(p.globs), "count": p.count, "why": p.why}


def _hf_json(h: HFFacts) -> dict[str, Any]:
    return {
        "removed_lines": list(h.removed_lines),
        "added_lines": list(h.added_lines),
        "units": [
            {"units": _globs_json(u.globs), "count": u.count, "old": u.old, "new": u.new}
            for u in h.units
        ],
        "keys_only_old": _globs_json(h.keys_only_old),
        "keys_only_new": _globs_json(h.keys_only_new),
        "compatible": not h.problems,
        "problems": [_problem_json(p) for p in h.problems],
    }
