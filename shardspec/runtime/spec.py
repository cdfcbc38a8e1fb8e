"""``CompiledSpec``: the object behind a generated module.

A generated module holds plain tables (axes, rules, parameters); it builds one
``CompiledSpec`` from them and delegates to it. Layout arithmetic is
:mod:`shardspec.core.layout`, the very code the compiler checked the spec with. The
parameter table is a :class:`shardspec.core.paramtable.ParamTable`: rows of names that
differ only in numbers, looked up without expanding them.
"""

from __future__ import annotations

import dataclasses
import importlib
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from shardspec import RUNTIME_API, __version__
from shardspec.core.layout import (
    WHOLE,
    LayoutError,
    LayoutProblem,
    Mesh,
    ParamLayout,
    Placement,
    RuleSpec,
    build_layout,
    dtensor_placements,
    rank_table,
    representable,
    resolve_sizes,
    torch_problem,
    torch_problem_text,
)
from shardspec.core.paramtable import ParamTable, absolute_name, relative_name
from shardspec.core.patterns import compile_glob
from shardspec.core.stages import PipelineSpec, StageError, StagePlan, StageProblem
from shardspec.core.stages import plan as stage_plan
from shardspec.core.views import Folded, Views, folded, view_sizes


class SpecError(LayoutError):
    """A model, mesh or argument that does not fit the compiled spec. ``code``: the check
    the compiler would report it under, for the runtime's own errors (``None`` for a
    :class:`LayoutError` or a :class:`StageError` passed on, whose ``problem`` or
    ``stage_problem`` says what is wrong)."""

    def __init__(
        self,
        message: str,
        code: str | None = "SS031",
        hint: str = "",
        problem: LayoutProblem | None = None,
        stage_problem: StageProblem | None = None,
    ) -> None:
        super().__init__(message, problem, hint)
        self.code = code
        self.stage_problem = stage_problem


@dataclass(frozen=True)
class Param:
    """One manifest parameter: its winning rule, module tensor shape and dtype."""

    rule: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Buffer:
    """One persistent buffer of the manifest: the rule that places it (None: no rule
    matches it, so it is whole on every rank), its module tensor shape and dtype."""

    rule: int | None
    shape: tuple[int, ...] | None  # None: unknown (a buffer named by hand)
    dtype: str


@dataclass(frozen=True)
class Hook:
    """A key the model's state-dict hooks write in place of parameters: the module whose
    hook writes it (``""``: the model's ``state_dict()``) and the parameters it comes from.
    Each name is written relative to the key (:func:`shardspec.core.paramtable.
    relative_name`): a ``*`` segment is the key's segment at that position, so every
    layer's hook shares one row of the table."""

    module: str
    sources: tuple[str, ...] = ()


class HookKeys(Mapping[str, tuple[str, tuple[str, ...]]]):
    """The keys state-dict hooks write: key -> (the hook's module, the parameters), from a
    folded table of :class:`Hook` rows (names made whole again on lookup)."""

    def __init__(
        self, keys: ParamTable[Hook] | Mapping[str, tuple[str, Iterable[str]]] | None = None
    ) -> None:
        if isinstance(keys, HookKeys):
            self.table: ParamTable[Hook] = keys.table
        elif isinstance(keys, ParamTable):
            self.table = keys
        else:
            self.table = ParamTable.from_names(
                {
                    k: Hook(relative_name(m, k), tuple(relative_name(f, k) for f in sources))
                    for k, (m, sources) in (keys or {}).items()
                }
            )

    def __getitem__(self, key: str) -> tuple[str, tuple[str, ...]]:
        hook = self.table[key]
        return absolute_name(hook.module, key), tuple(absolute_name(f, key) for f in hook.sources)

    def __contains__(self, key: object) -> bool:
        return key in self.table

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)


def require(api: int, compiler: str) -> None:
    """Called by generated modules: refuse to run against an incompatible runtime."""
    if api != RUNTIME_API:
        raise ImportError(
            f"this generated module needs shardspec runtime API {api} (compiled by shardspec "
            f"{compiler}), but the installed shardspec {__version__} provides API "
            f"{RUNTIME_API}; recompile the spec with `shardspec compile`"
        )


class MeshViews(Mapping[str, Any]):
    """What ``build_mesh()`` returns for a spec with views: view name -> torch
    ``DeviceMesh``, every one over the same ranks (rank r has r's row-major coordinate in
    each), unflattened from one 1-D mesh over the world (``world``) with torch's
    ``DeviceMesh._unflatten``, as torchtitan builds its dense and sparse meshes. Pass it
    where a single-mesh spec takes its DeviceMesh (``distribute``, ``placements``,
    ``save``, ``load``); ``views["expert"]`` is a view's own DeviceMesh."""

    def __init__(self, meshes: Mapping[str, Any], world: Any = None) -> None:
        self._meshes = dict(meshes)
        self.world = world

    def __getitem__(self, view: str) -> Any:
        return self._meshes[view]

    def __iter__(self) -> Iterator[str]:
        return iter(self._meshes)

    def __len__(self) -> int:
        return len(self._meshes)

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate in the default (first) view."""
        return next(iter(self._meshes.values())).get_coordinate()

    def __repr__(self) -> str:
        return f"MeshViews({self._meshes!r})"


class _WeakViews:
    """A :class:`MeshViews` held by weak references to its DeviceMeshes (see
    :attr:`CompiledSpec.last_mesh`)."""

    __slots__ = ("refs",)

    def __init__(self, views: MeshViews) -> None:
        self.refs = {v: weakref.ref(m) for v, m in views.items()}

    def get(self) -> MeshViews | None:
        meshes = {v: r() for v, r in self.refs.items()}
        if any(m is None for m in meshes.values()):
            return None
        return MeshViews(meshes)


class RuntimeModule:
    """``shardspec.runtime.<name>``, imported when one of its names is first used.

    A generated module calls the runtime's torch.distributed parts (``parallel``,
    ``checkpoint``: DTensor, FSDP2, DCP) only from its functions, through these, so that
    importing it costs its tables, not torch's distributed packages (a data-loader worker or
    a launcher that imports the trainer reads the tables only); the first call pays for them.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = f"shardspec.runtime.{name}"

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.name), attr)

    def __repr__(self) -> str:
        return f"RuntimeModule({self.name!r})"


class CompiledSpec:
    """Everything a trainer needs from one spec, at any mesh size."""

    def __init__(
        self,
        *,
        name: str,
        axes: tuple[str, ...],
        sizes: Mapping[str, int | None],
        world: int | None,
        rules: tuple[RuleSpec, ...],
        params: Mapping[str, Param] | None,
        ignore: tuple[str, ...] = (),
        name_indexed_counts: Mapping[int, Mapping[str, int]] | None = None,
        factory_args: Mapping[str, object] | None = None,
        fsdp: str | None = None,
        styles: Mapping[int, Mapping[str, object]] | None = None,
        pipeline: PipelineSpec | None = None,
        buffers: Mapping[str, Buffer] | Iterable[str] = (),
        hook_keys: ParamTable[Hook] | Mapping[str, tuple[str, tuple[str, ...]]] | None = None,
        views: Mapping[str, tuple[str, ...]] | None = None,
        view_fsdp: Mapping[str, str | None] | None = None,
        rule_views: tuple[str, ...] = (),
        aliases: Mapping[str, str] | None = None,
        checkpoint_keys: str | None = None,
    ) -> None:
        self.name = name
        # `checkpoint keys NAME`: the key layout save and load use where ``keys=`` is not
        # given (None: shardspec's own).
        self.checkpoint_keys = checkpoint_keys
        # Other names a trainer's DeviceMesh may give an axis (`dp_shard: * aka fsdp`):
        # alias -> the spec's axis. Meshes and DTensors are read in the spec's names.
        self.aliases: dict[str, str] = dict(aliases or {})
        # Views (named meshes over the same ranks): each view's axes and fsdp axis, and
        # each rule's view. None: one mesh, ``axes``.
        self.views: Views | None = (
            Views(tuple(views.items()), tuple((v, (view_fsdp or {}).get(v)) for v in views))
            if views
            else None
        )
        self.rule_views = rule_views
        self.axes = axes
        self.default_sizes = dict(sizes)
        self.default_world = world
        self.rules = rules
        # Every parameter of the manifest's model (None: no manifest). A plain mapping of
        # names (a table built by hand) is folded into rows like a generated module's.
        self.params: ParamTable[Param] | None = (
            params
            if params is None or isinstance(params, ParamTable)
            else ParamTable.from_names(params)
        )
        self.ignore = ignore
        self._globs = [compile_glob(r.pattern) for r in rules]
        # The manifest's state-dict entries that are no parameter: persistent buffers
        # (storage units as parameters are: whole on every rank unless a rule places them,
        # see buffer_layout; with pipeline stages, on their module's stage), and the keys
        # the model's state-dict hooks write, each with the module whose hook writes it and
        # the parameters it comes from (save refuses them: no rule places them). Buffers
        # given by name only (a table built by hand) have their rules matched here, and
        # their shapes taken from their tensors.
        self.buffers: ParamTable[Buffer] = (
            buffers
            if isinstance(buffers, ParamTable)
            else ParamTable.from_names(
                buffers
                if isinstance(buffers, Mapping)
                else {b: self._unsized_buffer(b) for b in buffers}
            )
        )
        self.hook_keys = HookKeys(hook_keys)
        # The FSDP2 axis (`fsdp AXIS`), and the tensor-parallel styles rules state
        # (rule index -> {"kind": ..., "input": ..., "output": ..., "local": ...}).
        self.fsdp_axis = fsdp
        self.rule_styles = {k: dict(v) for k, v in (styles or {}).items()}
        self.name_indexed_counts = {k: dict(v) for k, v in (name_indexed_counts or {}).items()}
        # Local axes' sizes the manifest's model was built with (its factory arguments
        # named after mesh axes): the per-parameter table holds only at those sizes.
        local = {a for r in rules for a in r.local}
        self.built_sizes = {
            a: int(v)
            for a, v in (factory_args or {}).items()
            if a in local and isinstance(v, int) and not isinstance(v, bool)
        }
        # The mesh the model was last built or distributed on: the default for planners.
        self._last_mesh: object | None = None  # see last_mesh: a weak reference, mostly
        self._ignore_globs = [compile_glob(p) for p in ignore]
        # Pipeline stages (`pipeline AXIS { ... }`): placed per pipeline size, on demand.
        self.pipeline = pipeline
        self._stage_plans: dict[int, StagePlan] = {}

    def _unsized_buffer(self, fqn: str) -> Buffer:
        found = self._winner(fqn)
        return Buffer(found[0] if found is not None else None, None, "")

    # ----------------------------------------------------------------- sizes and meshes

    @property
    def last_mesh(self) -> object | None:
        """The mesh last built or distributed on (the planners' default), while it lives.

        A spec lives as long as its generated module, so it only refers to a DeviceMesh
        weakly: a strong reference would keep the mesh, and with it its process groups and
        their gloo threads, alive after ``destroy_process_group()``, until interpreter
        shutdown, where those threads can abort the process (issue 8). The model's DTensors
        hold their mesh, so it lives as long as the distributed model; this is None once
        nothing else refers to it. Objects without weak references (a dict of sizes, a
        :class:`shardspec.core.layout.Mesh`) hold no process group and are kept as they are.
        A :class:`MeshViews` is kept as weak references to its DeviceMeshes, each held by
        the DTensors on it: it lives as long as its views do.
        """
        ref = self._last_mesh
        if isinstance(ref, _WeakViews):
            return ref.get()
        return ref() if isinstance(ref, weakref.ref) else ref

    @last_mesh.setter
    def last_mesh(self, mesh: object | None) -> None:
        try:
            if isinstance(mesh, MeshViews):
                self._last_mesh = _WeakViews(mesh)
                return
            self._last_mesh = weakref.ref(mesh) if mesh is not None else None
        except TypeError:  # not weakly referenceable: holds no process group
            self._last_mesh = mesh

    def sizes(self, world: int | None = None, **overrides: int) -> dict[str, int]:
        """Axis sizes: defaults, ``overrides``, the rest axis filled from ``world``. With
        views: every view's axes (a shared one once), each view's rest axis from the world."""
        unknown = sorted(set(overrides) - set(self.axes))
        if unknown:
            raise SpecError(
                f"unknown mesh axis {', '.join(map(repr, unknown))}; the spec's axes are "
                f"{', '.join(self.axes)}"
            )
        for what, value in [*overrides.items(), ("world", world)]:
            if what == "world" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(
                    f"{'the world size' if what == 'world' else f'mesh axis {what!r}'} must "
                    f"be a whole number of at least 1, not {value!r}"[:300]
                )
        merged = [overrides.get(a, self.default_sizes[a]) for a in self.axes]
        w = world if world is not None else self.default_world
        try:
            if self.views is not None:
                return view_sizes(self.views, dict(zip(self.axes, merged, strict=True)), w)
            resolved = resolve_sizes(self.axes, merged, w)
        except SpecError:
            raise
        except LayoutError as e:
            raise SpecError(str(e), None, e.hint, e.problem) from None
        return dict(zip(self.axes, resolved, strict=True))

    def axis_names(self, names: Iterable[str]) -> tuple[str, ...]:
        """A DeviceMesh's axis names in the spec's spelling: each alias as its axis."""
        return tuple(self.aliases.get(n, n) for n in names)

    def mesh_names(self, mesh: object, axes: Iterable[str]) -> tuple[str, ...]:
        """The spec's ``axes`` as ``mesh`` (a DeviceMesh) spells them, to index it."""
        own = {self.aliases.get(n, n): n for n in getattr(mesh, "mesh_dim_names", None) or ()}
        return tuple(own.get(a, a) for a in axes)

    def _axes_doc(self) -> str:
        """The spec's axes with their aliases, in words: ``dp_shard (aka fsdp), tp``."""
        aka = {a: [k for k, v in self.aliases.items() if v == a] for a in self.axes}
        return ", ".join(f"{a} (aka {', '.join(aka[a])})" if aka[a] else a for a in self.axes)

    def layout_mesh(self, mesh: object) -> Mesh:
        """A :class:`shardspec.core.layout.Mesh` for a DeviceMesh, a Mesh or a dict of sizes.
        With views: a :class:`~shardspec.core.views.Folded` mesh (every view's) for
        ``build_mesh()``'s :class:`MeshViews`, a mapping view -> DeviceMesh or Mesh, or a
        dict of every axis's size."""
        if self.views is not None:
            return self._folded(mesh)
        if isinstance(mesh, Mesh):
            lm = mesh
        elif isinstance(mesh, Mapping):
            lm = Mesh(tuple(mesh), tuple(int(v) for v in mesh.values()))
        else:
            names = getattr(mesh, "mesh_dim_names", None)
            if names is None:
                raise SpecError("the DeviceMesh has no mesh_dim_names; build it with build_mesh()")
            names = self.axis_names(names)
            unknown = [n for n in names if n not in self.axes]
            if unknown:
                raise SpecError(
                    f"the DeviceMesh's axes {tuple(getattr(mesh, 'mesh_dim_names', ()))} are "
                    f"not the spec's axes {self.axes}: axis "
                    f"{', '.join(map(repr, unknown))} is neither an axis of spec "
                    f"{self.name!r} nor an alias of one (the spec's axes are "
                    f"{self._axes_doc()}); build the mesh with build_mesh()",
                    None,
                    f"name it as the spec does, or declare the trainer's name in the spec's "
                    f"mesh (`{self.axes[0]}: ... aka {unknown[0]}`)",
                )
            lm = Mesh(tuple(names), tuple(int(s) for s in mesh.shape))  # type: ignore[attr-defined]
        if lm.names != self.axes:
            raise SpecError(
                f"the mesh's axes {lm.names} are not the spec's axes {self.axes} (outer to "
                "inner); build it with build_mesh()"
            )
        return lm

    def _folded(self, mesh: object) -> Folded:
        """The Folded mesh of a spec with views, from what a caller passes."""
        views = self.views
        assert views is not None
        if isinstance(mesh, Folded):
            got = mesh
        elif isinstance(mesh, Mapping) and all(isinstance(v, int) for v in mesh.values()):
            unknown = sorted(set(mesh) - set(self.axes))
            if unknown:
                raise SpecError(f"unknown mesh axis {', '.join(map(repr, unknown))}")
            merged = {a: mesh.get(a, self.default_sizes[a]) for a in self.axes}
            world = None if set(mesh) == set(self.axes) else self.default_world
            try:
                got = folded(views, view_sizes(views, merged, world))
            except LayoutError as e:
                raise SpecError(str(e), None, e.hint, e.problem) from None
        elif isinstance(mesh, Mapping):
            meshes = {}
            for view, m in mesh.items():
                names = getattr(m, "mesh_dim_names", None) if not isinstance(m, Mesh) else m.names
                if names is None:
                    raise SpecError(
                        f"view {view!r}'s DeviceMesh has no mesh_dim_names; build the views "
                        "with build_mesh()"
                    )
                sizes = m.sizes if isinstance(m, Mesh) else tuple(int(s) for s in m.shape)
                meshes[view] = Mesh(tuple(names), tuple(sizes))
            default = meshes.get(views.default)
            got = Folded(
                default.names if default else (),
                default.sizes if default else (),
                tuple(meshes.items()),
            )
        else:
            raise SpecError(
                f"spec {self.name!r} has views ({', '.join(views.names)}): pass build_mesh()'s "
                "views (a mapping view name -> DeviceMesh), not one mesh",
                None,
                "build them with build_mesh(), or as {view: DeviceMesh} over the same ranks",
            )
        names = tuple(v for v, _ in got.views)
        if names != views.names:
            raise SpecError(
                f"the meshes are for views {', '.join(names) or '(none)'}, but spec "
                f"{self.name!r} has views {', '.join(views.names)}; build them with build_mesh()"
            )
        worlds = set()
        for view, m in got.views:
            if m.names != views.axes_of(view):
                raise SpecError(
                    f"view {view!r}'s mesh has axes {m.names}, not the spec's "
                    f"{views.axes_of(view)} (outer to inner); build it with build_mesh()"
                )
            worlds.add(m.world)
        shared = got.axis_sizes
        for _, m in got.views:
            for a, n in zip(m.names, m.sizes, strict=True):
                if shared[a] != n:
                    raise SpecError(f"views size shared axis {a!r} {shared[a]} and {n}")
        if len(worlds) > 1:
            raise SpecError(
                f"the views' meshes are over {sorted(worlds)} ranks: every view factors one world"
            )
        return got

    def view_of_rule(self, rule: int | None) -> str | None:
        """The view that places rule ``rule`` (None: the spec has no views; a buffer that
        no rule places is on the default view)."""
        if self.views is None:
            return None
        if rule is None or rule >= len(self.rule_views):
            return self.views.default
        return self.rule_views[rule]

    def view_mesh(self, lm: Mesh, rule: int | None) -> Mesh:
        """The mesh rule ``rule``'s parameters are laid out on: its view's in a Folded
        mesh, else ``lm`` itself."""
        view = self.view_of_rule(rule)
        return lm.view(view) if isinstance(lm, Folded) and view is not None else lm

    def mesh_of(self, fqn: str, mesh: object) -> Mesh:
        """The mesh ``fqn``'s layout is on: its rule's view's (the mesh itself without
        views)."""
        lm = self.layout_mesh(mesh)
        if self.views is None:
            return lm
        return self.view_mesh(lm, self._rule_of(fqn))

    def _rule_of(self, fqn: str) -> int | None:
        if self.stores_buffer(fqn):
            return self.buffers[fqn].rule
        if self.params is not None and fqn in self.params:
            return self.params[fqn].rule
        found = self._winner(fqn)
        return found[0] if found is not None else None

    def stored_fused(self, fqn: str) -> bool:
        """Whether ``fqn``'s rule stores its fused dimension whole (`stored fused`)."""
        rule = self._rule_of(fqn)
        return rule is not None and self.rules[rule].stored_fused

    def _axis_sizes(self, lm: Mesh) -> dict[str, int]:
        if isinstance(lm, Folded):
            return lm.axis_sizes
        return dict(zip(lm.names, lm.sizes, strict=True))

    def is_module(self, name: str) -> bool:
        """Whether ``name`` is a module that holds parameters of the manifest, or a module
        around them (``layers``, ``layers.0``, ``layers.0.attention``); never without a
        manifest. Answered from the table's rows, without listing every module."""
        return self.params is not None and self.params.has_module(name)

    # ----------------------------------------------------------------- pipeline stages

    def stage_plan(self, mesh: object) -> StagePlan | None:
        """Where every parameter lives at ``mesh``'s pipeline size (None: no pipeline)."""
        if self.pipeline is None:
            return None
        lm = self.layout_mesh(mesh)
        n = lm.size(self.pipeline.axis)
        got = self._stage_plans.get(n)
        if got is None:
            if self.params is None:
                raise SpecError(f"spec {self.name!r} has a pipeline but no manifest", "SS090")
            try:
                # The whole model's names, listed (in sorted order) only here: a pipeline
                # places every parameter and persistent buffer on a stage. A tie's alias
                # that the manifest lists is the tie's (lint checked that the manifest
                # ties it to the source: SS097).
                got = stage_plan(
                    self.pipeline,
                    list(self.params),
                    n,
                    buffers=[b for b in self.buffers if not self.is_ignored(b)],
                    tied_to=dict(self.pipeline.ties),
                )
            except StageError as e:
                raise SpecError(
                    f"cannot place spec {self.name!r}'s parameters on {n} pipeline stage(s): {e}",
                    None,
                    e.hint,
                    stage_problem=e.problem,
                ) from None
            self._stage_plans[n] = got
        return got

    def stage_of(self, mesh: object, coord: Iterable[int] | None = None) -> int | None:
        """The pipeline stage of the rank at ``coord`` (default: this rank's coordinate on
        a DeviceMesh); None without a pipeline."""
        if self.pipeline is None:
            return None
        lm = self.layout_mesh(mesh)
        if coord is None:
            coord = mesh.get_coordinate()  # type: ignore[attr-defined]
            if coord is None:
                raise SpecError("this rank is not part of the mesh")
        return tuple(coord)[lm.names.index(self.pipeline.axis)]

    def global_names(
        self,
        names: Iterable[str],
        mesh: object,
        coord: Iterable[int] | None = None,
        ties: bool = True,
    ) -> dict[str, str]:
        """A stage model's parameter names -> the whole model's (global) names.

        Without a pipeline, or with stage models that keep global names, every name maps to
        itself. With ``split ... local`` a stage's layers count from 0, and the k-th maps to
        the stage's k-th global layer. A tie's alias on its own stage maps to its source
        (``ties=False``: to itself, the name its rule and style go by). Raises one
        :class:`SpecError` naming every name that is not this stage's, and every parameter
        of the stage the names lack (given a manifest); ignored names map to themselves.
        """
        names = list(names)
        sp = self.stage_plan(mesh)
        if sp is None:
            return {n: n for n in names}
        stage = self.stage_of(mesh, coord)
        assert stage is not None
        out: dict[str, str] = {}
        foreign: list[str] = []
        for n in names:
            if self.is_ignored(n):
                out[n] = n
                continue
            g = sp.global_name(n, stage, ties)
            if g is None:
                other = sp.stage_of(n)
                if n in sp.tie_stage and other == stage:
                    where = (
                        f"a tensor of its own; the spec ties it to {sp.tie_source[n]}, which "
                        "this stage holds too: the model must hold them as one tensor"
                    )
                elif other is not None and not sp.spec.local_names:
                    where = f"stage {other}'s"
                else:
                    where = "no parameter of this stage"
                foreign.append(f"{n} ({where})")
            else:
                out[n] = g
        held = {sp.global_name(n, stage) for n in out if not self.is_ignored(n)}
        missing = sorted(set(sp.params_of(stage)) - held)
        if foreign or missing:
            lines = [f"holds {f}" for f in foreign[:5]]
            if len(foreign) > 5:
                lines.append(f"... and {len(foreign) - 5} more it should not hold")
            if missing:
                local = [sp.local_name(m, stage) for m in missing]
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                lines.append(
                    f"lacks {len(missing)} parameter(s) of stage {stage}: "
                    f"{', '.join(local[:3])}{more}"
                )
            axis = self.pipeline.axis  # type: ignore[union-attr]
            raise SpecError(
                f"the model is not stage {stage} of {sp.n_stages} (this rank's coordinate on "
                f"{axis!r}) as spec {self.name!r} splits it:\n  " + "\n  ".join(lines),
                "SS091",
                "build each rank's stage model from stage_layers(mesh) and the first/last modules",
            )
        return out

    # ----------------------------------------------------------------- lookup

    def glob(self, rule: int):
        """The compiled pattern of rule ``rule``."""
        return self._globs[rule]

    def is_ignored(self, fqn: str) -> bool:
        return any(g.regex.match(fqn) for g in self._ignore_globs)

    def match(self, fqn: str) -> tuple[int, dict[str, str]]:
        """The winning rule's index for ``fqn`` and its captures (by precedence)."""
        found = self._winner(fqn)
        if found is None:
            raise SpecError(f"parameter {fqn!r} is matched by no rule of spec {self.name!r}")
        return found

    def _winner(self, fqn: str) -> tuple[int, dict[str, str]] | None:
        """:meth:`match`, with None where no rule matches (rules of equal precedence that
        both match raise)."""
        best: list[tuple[int, dict[str, str]]] = []
        best_key = None
        for i, g in enumerate(self._globs):
            caps = g.match(fqn)
            if caps is None:
                continue
            if best_key is None or g.key > best_key:
                best, best_key = [(i, caps)], g.key
            elif g.key == best_key:
                best.append((i, caps))
        if not best:
            return None
        if len(best) > 1:
            pats = " and ".join(repr(self.rules[i].pattern) for i, _ in best)
            raise SpecError(f"rules {pats} have equal precedence and both match {fqn!r}")
        return best[0]

    def style_of(self, fqn: str) -> dict[str, object]:
        """The tensor-parallel style the spec states for ``fqn``'s rule (empty: derive it).
        A pipeline tie's alias takes its style from a rule for its own name, if any."""
        if self.params is not None and fqn in self.params:
            rule = self.params[fqn].rule
        elif self.pipeline is not None and fqn in dict(self.pipeline.ties):
            try:
                rule, _ = self.match(fqn)
            except SpecError:
                return {}
        else:
            rule, _ = self.match(fqn)
        return dict(self.rule_styles.get(rule, {}))

    def table(self, mesh: object) -> ParamTable[Param] | None:
        """The manifest's per-parameter table, or None where it does not describe the model
        on ``mesh``: no manifest, or local axes sized differently from the manifest's model
        (modules built with other local shapes; rules then match the real tensors)."""
        if self.params is None:
            return None
        if self.built_sizes:
            sizes = self._axis_sizes(self.layout_mesh(mesh))
            if any(sizes[a] != n for a, n in self.built_sizes.items() if a in sizes):
                return None
        return self.params

    def layout(
        self,
        fqn: str,
        mesh: object,
        shape: Iterable[int] | None = None,
        name_indexed_counts: Mapping[str, int] | None = None,
    ) -> ParamLayout:
        """The global layout of ``fqn`` on ``mesh``.

        With a manifest the table gives the rule and the module shape (``shape``, when
        passed, must agree). Without one, the rule is matched by name and ``shape`` (the
        module tensor's shape) is required.
        """
        lm = self.layout_mesh(mesh)
        table = self.table(lm)
        if self.stores_buffer(fqn):
            return self.buffer_layout(fqn, lm, shape, name_indexed_counts)
        if table is not None:
            p = table.get(fqn)
            if p is None:
                raise SpecError(f"parameter {fqn!r} is not in spec {self.name!r}'s manifest")
            if shape is not None and tuple(shape) != p.shape:
                raise SpecError(
                    f"parameter {fqn!r} has shape {list(shape)}, but the manifest says "
                    f"{list(p.shape)}; regenerate the manifest and recompile"
                )
            rule, module_shape = p.rule, p.shape
            counts = self.name_indexed_counts.get(rule)
        else:
            if shape is None:
                why = (
                    "has no manifest"
                    if self.params is None
                    else (f"was compiled for {self.built_sizes}, not this mesh")
                )
                raise SpecError(f"spec {self.name!r} {why}: pass the tensor's shape")
            rule, _ = self.match(fqn)
            module_shape = tuple(shape)
            counts = dict(name_indexed_counts) if name_indexed_counts is not None else None
        vm = self.view_mesh(lm, rule)  # (lm itself without views)
        sizes = dict(zip(vm.names, vm.sizes, strict=True))
        try:
            layout = build_layout(self.rules[rule], module_shape, sizes, counts)
        except LayoutError as e:  # name the parameter; distribute collects SpecErrors
            raise SpecError(f"parameter {fqn!r}: {e}", None, e.hint, e.problem) from None
        layout = self._on_stages(fqn, layout, lm)
        bad = representable(layout, vm)
        if bad is not None:
            raise SpecError(
                f"parameter {fqn!r}: no DTensor placements describe its layout on mesh "
                f"{dict(zip(vm.names, vm.sizes, strict=True))} (rank {vm.rank_of(bad)} differs)",
                "SS031",
            )
        problem = torch_problem(layout, vm)
        if problem is not None:
            message, hint = torch_problem_text(layout, vm, problem)
            raise SpecError(f"parameter {fqn!r}: {message}", "SS031", hint)
        return layout

    def stores_buffer(self, fqn: str) -> bool:
        """Whether ``fqn`` is a persistent buffer of the manifest, which checkpoints and the
        hf block store as a unit of its own, as parameters are."""
        return fqn in self.buffers

    def buffer_layout(
        self,
        fqn: str,
        mesh: object,
        shape: Iterable[int] | None,
        name_indexed_counts: Mapping[str, int] | None = None,
    ) -> ParamLayout:
        """The layout of persistent buffer ``fqn`` whose tensor has ``shape``: its rule's,
        or whole on every rank where no rule matches it (FSDP2 and torch's styles leave
        buffers whole). A rule may hold it as a local shard (``local``), never shard it
        over an axis at run time: lint refuses that (SS087), and so does this."""
        lm = self.layout_mesh(mesh)
        entry = self.buffers[fqn]
        vm = self.view_mesh(lm, entry.rule)
        sizes = dict(zip(vm.names, vm.sizes, strict=True))
        if shape is None and self.table(lm) is not None and entry.shape is not None:
            shape = entry.shape  # the manifest's module tensor shape
        if shape is None:
            raise SpecError(f"buffer {fqn!r}: pass the tensor's shape", None)
        if entry.rule is None:
            return self._on_stages(fqn, build_layout(WHOLE, tuple(shape), sizes), lm)
        rule = entry.rule
        counts = name_indexed_counts
        if self.table(lm) is not None:
            counts = self.name_indexed_counts.get(rule)
        try:
            layout = build_layout(
                self.rules[rule], tuple(shape), sizes, dict(counts) if counts else None
            )
        except LayoutError as e:
            raise SpecError(f"buffer {fqn!r}: {e}", None, e.hint, e.problem) from None
        sharded = sorted({a for d in layout.dims for a in d.axes if a not in layout.local})
        if sharded:
            raise SpecError(
                f"buffer {fqn!r}: rule {self.rules[rule].pattern!r} shards it over "
                f"{', '.join(sharded)}, but FSDP2 and torch's styles keep buffers whole on "
                "every rank",
                "SS087",
                "recompile the spec: lint reports this (SS087)",
            )
        return self._on_stages(fqn, layout, lm)

    def _on_stages(self, fqn: str, layout: ParamLayout, lm: Mesh) -> ParamLayout:
        """``layout`` on the pipeline stages that hold ``fqn`` (itself without a pipeline):
        other stages' ranks hold none of it."""
        sp = self.stage_plan(lm)
        if sp is None:
            return layout
        stages = sp.stages_of(fqn)  # a tied weight: its alias's stage too
        if not stages:
            raise SpecError(f"parameter {fqn!r} is on no pipeline stage", "SS091")
        return dataclasses.replace(
            layout,
            stage_axis=self.pipeline.axis,  # type: ignore[union-attr]
            stages=stages,
        )

    def rank_table(self, fqn: str, mesh: object, shape: Iterable[int] | None = None):
        """Every rank's global indices of ``fqn`` (see :func:`shardspec.core.layout.rank_table`)."""
        lm = self.layout_mesh(mesh)
        return rank_table(self.layout(fqn, lm, shape), self.mesh_of(fqn, lm))

    def abstract_placements(self, fqn: str, mesh: object, shape=None) -> tuple[Placement, ...]:
        lm = self.layout_mesh(mesh)
        return dtensor_placements(self.layout(fqn, lm, shape), self.mesh_of(fqn, lm))

    def name_indexed_counts_of(self, names: Iterable[str]) -> dict[str, dict[str, int]]:
        """Without a manifest: modules per name-indexed dim, counted from the model's names."""
        values: dict[tuple[int, str], set[str]] = defaultdict(set)
        matched: dict[str, int] = {}
        for fqn in names:
            if self.is_ignored(fqn):
                continue
            found = self._winner(fqn) if self.stores_buffer(fqn) else self.match(fqn)
            if found is None:
                continue  # a buffer no rule matches: whole on every rank
            rule, caps = found
            matched[fqn] = rule
            for v in self.rules[rule].name_indexed:
                values[(rule, v)].add(caps[v])
        return {
            fqn: {v: len(values[(rule, v)]) for v in self.rules[rule].name_indexed}
            for fqn, rule in matched.items()
        }
