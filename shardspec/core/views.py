"""Views: several factorizations of one world (torchtitan's dense and sparse meshes,
Megatron-Core's "MoE parallel folding").

A spec with named meshes (``mesh dense { ... }``, ``mesh expert { ... }``) declares one
*view* per mesh. Every view factors the same ranks: rank ``r`` has ``r``'s row-major
coordinate in every view (as ``init_device_mesh`` numbers ranks), so a view is only a
:class:`~shardspec.core.layout.Mesh` of its own, and a parameter's layout is computed on its
view's mesh with the very arithmetic of a single mesh. Axes named in two views are *shared*
(``pp``, ``dp_replicate``): they come first in each view that has them, in one order, with
one size, so that the coordinates on them agree between views.

Pure Python, shared by the compiler and the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from shardspec.core.layout import LayoutError, LayoutProblem, Mesh, ParamLayout, resolve_sizes

# The view of a spec with one unnamed mesh.
SINGLE = ""


@dataclass(frozen=True)
class Views:
    """The views of a spec: each view's axes (outer to inner) and FSDP axis, in
    declaration order. The first view is the default: rules that name no axis and no view
    are placed on it."""

    axes: tuple[tuple[str, tuple[str, ...]], ...]  # (view, its axes)
    fsdp: tuple[tuple[str, str | None], ...] = ()  # (view, its fsdp axis)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v for v, _ in self.axes)

    @property
    def default(self) -> str:
        return self.axes[0][0]

    def axes_of(self, view: str) -> tuple[str, ...]:
        return dict(self.axes)[view]

    def fsdp_of(self, view: str) -> str | None:
        return dict(self.fsdp).get(view)

    @property
    def all_axes(self) -> tuple[str, ...]:
        """Every axis once: the shared ones, then each view's own, in declaration order."""
        out: dict[str, None] = {}
        for _, axes in self.axes:
            out.update(dict.fromkeys(axes))
        return tuple(out)

    @property
    def shared(self) -> tuple[str, ...]:
        """Axes that more than one view declares."""
        seen: dict[str, int] = {}
        for _, axes in self.axes:
            for a in axes:
                seen[a] = seen.get(a, 0) + 1
        return tuple(a for a in self.all_axes if seen[a] > 1)

    def views_of(self, axis: str) -> tuple[str, ...]:
        """The views that declare ``axis``."""
        return tuple(v for v, axes in self.axes if axis in axes)

    def meshes(self, sizes: Mapping[str, int]) -> dict[str, Mesh]:
        """Each view's mesh, from every axis's size."""
        return {v: Mesh(axes, tuple(int(sizes[a]) for a in axes)) for v, axes in self.axes}


def view_sizes(views: Views, sizes: Mapping[str, int | None], world: int | None) -> dict[str, int]:
    """Every axis's size: ``sizes`` by axis name (``None``: the rest of its view), each
    view's rest axis filled from the world. Without ``world``, a view that takes no rest
    gives it. Raises a :class:`LayoutError` (``MESH_SIZES``) where the views do not factor
    one world."""
    if world is None:
        for _, axes in views.axes:
            if all(sizes.get(a) is not None for a in axes):
                world = math.prod([int(sizes[a] or 0) for a in axes])
                break
    out: dict[str, int] = {}
    for v, axes in views.axes:
        try:
            got = resolve_sizes(axes, [sizes.get(a) for a in axes], world)
        except LayoutError as e:
            raise LayoutError(f"view {v!r}: {e}", e.problem, e.hint) from None
        for a, n in zip(axes, got, strict=True):
            if out.setdefault(a, n) != n:
                raise LayoutError(
                    f"view {v!r} sizes shared axis {a!r} {n}, another view {out[a]}",
                    LayoutProblem.MESH_SIZES,
                    "a shared axis has one size in every view",
                )
    return out


def coordinates(views: Views, sizes: Mapping[str, int], rank: int) -> dict[str, tuple[int, ...]]:
    """Rank ``rank``'s coordinate in every view (row-major in each)."""
    return {v: m.coord_of(rank) for v, m in views.meshes(sizes).items()}


@dataclass(frozen=True)
class Folded(Mesh):
    """Every view's mesh over one world, as one value: a :class:`Mesh` that is the default
    view's (``names``, ``sizes``: the shared pipeline axis and a rank's coordinate read as
    on any mesh), with every view's mesh in ``views``. Rank numbers are the same in every
    view, so per-rank tables computed on any view's mesh index the same ranks."""

    views: tuple[tuple[str, Mesh], ...] = ()

    def view(self, name: str) -> Mesh:
        return dict(self.views)[name]

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Every axis's size, by name (a shared axis once)."""
        out: dict[str, int] = {}
        for _, mesh in self.views:
            out.update(zip(mesh.names, mesh.sizes, strict=True))
        return out


def folded(views: Views, sizes: Mapping[str, int]) -> Folded:
    """The :class:`Folded` mesh of ``views`` at ``sizes`` (every axis's)."""
    meshes = views.meshes(sizes)
    default = meshes[views.default]
    return Folded(default.names, default.sizes, tuple(meshes.items()))


def layout_view(layout: ParamLayout, mesh: Mesh) -> Mesh:
    """The mesh ``layout`` is on: for a :class:`Folded` mesh, the first view that has every
    axis the layout names (its dimensions', local, checkpoint-only and stage axes); any
    other mesh is its own. A layout is on one view (a view's own axes belong to it alone),
    and one that names only shared axes, or none, has the same rank tables on every view
    that has them (shared axes are a common prefix of one size)."""
    if not isinstance(mesh, Folded):
        return mesh
    named = {a for d in layout.dims for a in d.axes} | set(layout.local)
    named |= {a for axes in layout.ckpt for a in axes}
    if layout.stage_axis is not None:
        named.add(layout.stage_axis)
    for _, m in mesh.views:
        if named <= set(m.names):
            return m
    raise LayoutError(f"no view of the mesh has every axis of the layout ({sorted(named)})")
