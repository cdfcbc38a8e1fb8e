"""A trainer spec and an engine spec for the `shardspec transfer` cases (SS124-SS129):
the case's spec is the trainer's, its ``engine`` the engine's (written as engine.shard)."""

from __future__ import annotations

from typing import Any

SPEC = """
manifest "m.json"
mesh over 2 ranks { tp: 2 }
param w.weight [rows, cols] {
    shard rows over tp
}
param n.weight [cols] {}
hf {
    w.proj -> w.weight
    n.proj -> n.weight
}
"""
# line 8: the w.proj map line; line 9: n.proj's
MANIFEST = {"w.weight": (8, 4), "n.weight": (4,)}


def pair(
    engine_spec: str = SPEC,
    engine_manifest: dict[str, Any] | None = None,
    engine_fields: dict[str, Any] | None = None,
    spec: str = SPEC,
) -> dict[str, Any]:
    """A case's trainer and engine (its name and expect to be added)."""
    engine: dict[str, Any] = {"spec": engine_spec, "manifest": engine_manifest or MANIFEST}
    if engine_fields:
        engine["fields"] = engine_fields
    return {"spec": spec, "manifest": MANIFEST, "engine": engine}
