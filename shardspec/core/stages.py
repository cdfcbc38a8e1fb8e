"""Pipeline stages: which stage holds each parameter, and stage-local names.

Pure Python (``re`` via :mod:`shardspec.core.patterns`, nothing else): the compiler checks a
spec's ``pipeline`` block with these functions and the runtime places parameters on stages
with the very same ones, at whatever pipeline size the mesh has.

A pipeline declaration names the mesh axis whose coordinate is the stage index, and sorts
every parameter (always by its *global* name, the manifest's) onto a stage:

* ``first PATTERN, ...``: modules of the first stage (embeddings);
* ``last PATTERN, ...``: modules of the last stage (final norm, output head);
* ``split PATTERN``: a layer-indexed family (``layers.{layer}``), in consecutive runs of
  layers per stage, sorted by the capture's integer value: an even split, or explicit
  counts per stage (``as 3, 5``). With ``local`` each stage numbers its own layers from 0
  (Megatron); otherwise stage models keep global names (torchtitan).

Patterns are module prefixes: ``output`` places ``output.weight`` and ``output.bias``.

Persistent buffers are placed as parameters are, by their module prefix (a router's
``layers.3.mlp.gate.e_score_correction_bias`` lives with layer 3). A buffer that no
declaration covers (a model-level ``freqs_cis``) is held by every stage, as a stage model
keeps the modules no stage drops; it is stored once, by the first stage.

``tie ALIAS = SOURCE`` names a weight used on two stages (embeddings tied to the output
head): the whole model holds one tensor under ``SOURCE`` (the manifest's name); the stage
that ``first``/``last`` gives ``ALIAS`` holds a copy under the name ``ALIAS``. Both copies
have the source's layout and are stored once, under the source's name. Where the two
stages are one (a single stage), the model keeps the tie itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache

from shardspec.core.patterns import Glob, compile_glob


class StageProblem(Enum):
    """What keeps a pipeline declaration from placing the parameters. The compiler reports
    each under a check code of its own (``shardspec.checks.pipeline.STAGE_CODES``)."""

    SPLIT = "split"  # the layers do not split over the stages as declared
    NAMES = "names"  # stage-local names cannot be mapped to global ones
    UNPLACED = "unplaced"  # a parameter on no stage
    PLACED_TWICE = "placed-twice"  # a parameter claimed by two patterns
    EMPTY_STAGE = "empty-stage"  # a stage holds no parameter
    BAD_TIE = "bad-tie"  # a tie that does not fit the parameters


class StageError(ValueError):
    """A pipeline declaration that does not place the parameters; ``problem`` says what."""

    def __init__(
        self, message: str, problem: StageProblem = StageProblem.SPLIT, hint: str = ""
    ) -> None:
        super().__init__(message)
        self.problem, self.hint = problem, hint


@dataclass(frozen=True)
class PipelineSpec:
    """A ``pipeline AXIS { ... }`` block in plain data (the generated module's table)."""

    axis: str
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    split: str | None = None  # a pattern with one capture: the layer index
    counts: tuple[int, ...] = ()  # explicit layers per stage; () is an even split
    local_names: bool = False  # stage models number their split layers from 0
    ties: tuple[tuple[str, str], ...] = ()  # (alias, source): global parameter names


@lru_cache(maxsize=256)
def prefix_glob(pattern: str) -> Glob:
    """A module-prefix pattern as a parameter glob: the pattern, then any segments."""
    return compile_glob(pattern + ".**")


def places(pattern: str, fqn: str) -> bool:
    """Whether module pattern ``pattern`` covers parameter ``fqn``."""
    return prefix_glob(pattern).match(fqn) is not None


def layer_of(spec: PipelineSpec, fqn: str) -> str | None:
    """The split capture's value in ``fqn`` (its layer), or None when the split does not
    cover it."""
    if spec.split is None:
        return None
    g = prefix_glob(spec.split)
    caps = g.match(fqn)
    if caps is None or not g.captures:
        return None
    return caps[g.captures[0]]


def claims(spec: PipelineSpec, fqn: str) -> list[str]:
    """Which declarations cover ``fqn``: ``"first"``, ``"last"``, ``"split"`` (in that
    order; several is a conflict)."""
    out = []
    if any(places(p, fqn) for p in spec.first):
        out.append("first")
    if any(places(p, fqn) for p in spec.last):
        out.append("last")
    if layer_of(spec, fqn) is not None:
        out.append("split")
    return out


def is_layer_number(value: str) -> bool:
    """Whether a split capture is a layer number: ASCII digits (``str.isdigit`` also takes
    ``'²'``, which ``int`` refuses)."""
    return value.isascii() and value.isdigit()


def _layer_key(value: str) -> tuple[int, str]:
    if not is_layer_number(value):
        raise StageError(
            f"the split's capture is {value!r}, not a layer number",
            StageProblem.NAMES,
            "split a family indexed by whole numbers, such as `layers.{layer}`",
        )
    # The text breaks ties (``1`` and ``01``), so every process sorts the same way
    # whatever its hash seed.
    return int(value), value


def layers(spec: PipelineSpec, names: Iterable[str]) -> tuple[str, ...]:
    """The split's layer values among ``names`` (global), in layer order."""
    found = {v for v in (layer_of(spec, n) for n in names) if v is not None}
    return tuple(sorted(sorted(found), key=_layer_key))  # the first bad capture by text


def layer_counts(spec: PipelineSpec, n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Layers per stage: the explicit counts, or an even split."""
    if n_stages < 1:
        raise StageError(f"the pipeline axis {spec.axis!r} has size {n_stages}", StageProblem.SPLIT)
    if spec.counts:
        if len(spec.counts) != n_stages:
            raise StageError(
                f"the split gives {len(spec.counts)} stage(s) layers "
                f"({', '.join(map(str, spec.counts))}), but {spec.axis!r} has "
                f"{n_stages} stage(s)",
                StageProblem.SPLIT,
                f"give one count per stage, or drop `as ...` for an even split of {n_layers}",
            )
        if sum(spec.counts) != n_layers:
            raise StageError(
                f"the split's counts add up to {sum(spec.counts)} layers, but the model has "
                f"{n_layers}",
                StageProblem.SPLIT,
                "the counts must add up to the number of layers",
            )
        return spec.counts
    if n_layers % n_stages:
        lo = n_layers // n_stages
        return _raise_uneven(spec, n_layers, n_stages, lo)
    return (n_layers // n_stages,) * n_stages


def _raise_uneven(spec: PipelineSpec, n_layers: int, n_stages: int, lo: int) -> tuple[int, ...]:
    if lo == 0:
        raise StageError(
            f"{n_layers} layers cannot fill {n_stages} stages of {spec.axis!r}",
            StageProblem.SPLIT,
            f"use at most {n_layers} stages",
        )
    extra = n_layers - lo * n_stages
    example = ", ".join(str(lo + (1 if s >= n_stages - extra else 0)) for s in range(n_stages))
    raise StageError(
        f"{n_layers} layers do not split evenly over {n_stages} stages of {spec.axis!r}",
        StageProblem.SPLIT,
        f"give each stage's count, e.g. `split {spec.split} as {example}`",
    )


def tie_problems(
    spec: PipelineSpec, names: Iterable[str], tied_to: Mapping[str, str] | None = None
) -> list[tuple[int, str, str, str]]:
    """Ties that do not fit the parameters ``names`` (global, the manifest's): ``(index of
    the tie, "alias" or "source", message, hint)``. The source must be a parameter, the
    alias must not be one of its own (the whole model holds the tied weight once), neither
    may be in the split family, and ``first`` or ``last`` must place the alias, once.

    ``tied_to``: the manifest's record of tied parameters (name -> the first name of the
    same tensor, ``tied_to``). A manifest that lists a tied weight under both names (as
    ``shardspec manifest`` does) may list the alias, tied to the tie's source."""
    have = set(names)
    tied_to = tied_to or {}
    out = []
    for i, (alias, source) in enumerate(spec.ties):
        if source not in have:
            out.append(
                (
                    i,
                    "source",
                    f"the tie's source {source!r} is not a parameter of the manifest",
                    "the source is the name the whole model holds the tied weight under "
                    "(its named_parameters() lists it, the alias not)",
                )
            )
        if alias in have and tied_to.get(alias) != source:
            out.append((i, "alias", *_untied_alias(alias, source, tied_to)))
        for role, name in (("alias", alias), ("source", source)):
            what = claims(spec, name)
            if "split" in what:
                out.append(
                    (
                        i,
                        role,
                        f"the tie's {role} {name!r} is in the split family",
                        "tie weights of the first or last stage (place them with `first` "
                        "or `last`)",
                    )
                )
            elif role == "alias" and not what:
                out.append(
                    (
                        i,
                        role,
                        f"the tie's alias {name!r} is on no pipeline stage",
                        f"place its module with `first` or `last` (e.g. `last "
                        f"{name.rpartition('.')[0] or name}`)",
                    )
                )
            elif role == "alias" and len(what) > 1:
                out.append(
                    (
                        i,
                        role,
                        f"the tie's alias {name!r} is placed by both {' and '.join(what)}",
                        "place its module once",
                    )
                )
    return out


def _untied_alias(alias: str, source: str, tied_to: Mapping[str, str]) -> tuple[str, str]:
    """The message and hint for a tie whose alias is a parameter of the manifest that the
    manifest does not tie to the tie's source."""
    other = tied_to.get(alias)
    if other is not None:
        return (
            f"the tie's alias {alias!r} is tied to {other!r} in the manifest, not to {source!r}",
            f"tie it to the tensor the model shares it with: `tie {alias} = {other}`",
        )
    if tied_to.get(source) == alias:
        return (
            f"the manifest ties {source!r} to {alias!r}: the whole model holds the tensor "
            f"under {alias!r} (its first name), so {alias!r} is the tie's source",
            f"swap the names: `tie {source} = {alias}`",
        )
    return (
        f"the tie's alias {alias!r} is a parameter of its own in the manifest: the model "
        "does not tie it",
        f"tie the weights in the model ({alias} = {source}) and regenerate the manifest, or "
        "drop the tie",
    )


def tied_aliases(spec: PipelineSpec, tied_to: Mapping[str, str] | None) -> frozenset[str]:
    """The ties' aliases that the manifest lists as parameters tied to the tie's source:
    the same tensor as the source, placed as the tie's alias, not as parameters of their
    own."""
    tied_to = tied_to or {}
    return frozenset(a for a, src in spec.ties if tied_to.get(a) == src)


def _tie_stage(spec: PipelineSpec, alias: str, n_stages: int) -> int:
    return 0 if claims(spec, alias) == ["first"] else n_stages - 1


@dataclass(frozen=True)
class StagePlan:
    """Where every parameter lives at one pipeline size."""

    spec: PipelineSpec
    n_stages: int
    stage: dict[str, int]  # global name -> stage (a tied weight: its source's stage)
    stage_layers: tuple[tuple[str, ...], ...]  # per stage, its layer values in order
    tie_stage: dict[str, int] = field(default_factory=dict)  # tie alias -> its stage
    # Persistent buffers (global names) -> the stages holding them: their module's, or
    # every stage for a buffer no declaration covers.
    buffer_stages: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def tie_source(self) -> dict[str, str]:
        """Tie alias -> source (global names)."""
        return dict(self.spec.ties)

    def stages_of(self, fqn: str) -> tuple[int, ...]:
        """Every stage that holds global parameter ``fqn``: its own, and those of the
        aliases tied to it (() for a name the plan does not place). A buffer's: its
        module's stage, or every stage."""
        if fqn in self.buffer_stages:
            return self.buffer_stages[fqn]
        own = self.stage_of(fqn)
        if own is None:
            return ()
        ties = self.spec.ties
        more = {self.tie_stage[a] for a, src in ties if src == fqn and a in self.tie_stage}
        return tuple(sorted({own} | more))

    def alias_on(self, fqn: str, stage: int) -> str | None:
        """The alias under which stage ``stage`` holds tied weight ``fqn``, where that
        stage is not the source's own (None otherwise)."""
        if self.stage.get(fqn) == stage:
            return None
        for a, src in self.spec.ties:
            if src == fqn and self.tie_stage.get(a) == stage:
                return a
        return None

    def stage_of(self, fqn: str) -> int | None:
        """The stage of global name ``fqn``, also for names the manifest lacks (modules
        built for other local sizes); None when no declaration covers it once. A tied
        weight's stage is its source's; an alias's is its own. A buffer every stage holds
        has no one stage (None)."""
        if fqn in self.stage:
            return self.stage[fqn]
        if fqn in self.tie_stage:
            return self.tie_stage[fqn]
        if fqn in self.buffer_stages:
            on = self.buffer_stages[fqn]
            return on[0] if len(on) == 1 else None
        what = claims(self.spec, fqn)
        if len(what) != 1:
            return None
        if what[0] == "first":
            return 0
        if what[0] == "last":
            return self.n_stages - 1
        value = layer_of(self.spec, fqn)
        for s, held in enumerate(self.stage_layers):
            if value in held:
                return s
        return None

    def params_of(self, stage: int) -> list[str]:
        """The global names stage ``stage`` holds, sorted (tied weights on every stage
        that holds them)."""
        out = {f for f, s in self.stage.items() if s == stage}
        out.update(src for a, src in self.spec.ties if self.tie_stage.get(a) == stage)
        return sorted(out & set(self.stage))

    def stored_of(self, stage: int) -> list[str]:
        """The global names of the parameters and persistent buffers stage ``stage``
        holds, sorted."""
        held = [b for b, on in self.buffer_stages.items() if stage in on]
        return sorted([*self.params_of(stage), *held])

    def local_name(self, fqn: str, stage: int | None = None) -> str:
        """The name stage models give global parameter ``fqn`` (on ``stage``: a tied
        weight is its alias on the alias's stage)."""
        if stage is not None:
            alias = self.alias_on(fqn, stage)
            if alias is not None:
                return alias
        if not self.spec.local_names:
            return fqn
        value = layer_of(self.spec, fqn)
        if value is None:
            return fqn
        stage = self.stage_of(fqn)
        if stage is None:
            return fqn
        return _replace_capture(self.spec, fqn, str(self.stage_layers[stage].index(value)))

    def global_name(self, name: str, stage: int, ties: bool = True) -> str | None:
        """The global name of stage ``stage``'s parameter ``name`` (None: no such one).
        A tie's alias, on its own stage, is its source's (``ties=False``: the alias, the
        whole model's name of the module that holds it)."""
        if not 0 <= stage < self.n_stages:
            return None
        if name in self.tie_stage:
            source = self.tie_source[name]
            if self.tie_stage[name] != stage or self.stage.get(source) == stage:
                return None  # another stage's, or tied within the stage (one tensor)
            return source if ties else name
        if name in self.buffer_stages and (
            not self.spec.local_names or layer_of(self.spec, name) is None
        ):
            return name if stage in self.buffer_stages[name] else None
        if not self.spec.local_names:
            return name if self.stage_of(name) == stage else None
        value = layer_of(self.spec, name)
        if value is None:
            return name if self.stage_of(name) == stage else None
        held = self.stage_layers[stage]
        if not is_layer_number(value) or int(value) >= len(held) or str(int(value)) != value:
            return None
        return _replace_capture(self.spec, name, held[int(value)])


def _replace_capture(spec: PipelineSpec, fqn: str, value: str) -> str:
    g = prefix_glob(spec.split or "")
    m = g.regex.match(fqn)
    assert m is not None and g.captures
    a, b = m.span(g.captures[0])
    return fqn[:a] + value + fqn[b:]


def plan(
    spec: PipelineSpec,
    names: Sequence[str],
    n_stages: int,
    *,
    buffers: Iterable[str] = (),
    tied_to: Mapping[str, str] | None = None,
) -> StagePlan:
    """Place every global parameter name on a stage, and every persistent buffer in
    ``buffers`` on its module's stage (or every stage: see the module's docstring). Raises
    :class:`StageError` for the first problem (the compiler's checks report every one,
    with locations).

    ``tied_to`` (see :func:`tie_problems`): a tie's alias that the manifest lists tied to
    the tie's source is the tie's alias, not a parameter of its own."""
    aliases = tied_aliases(spec, tied_to)
    if aliases:
        names = [n for n in names if n not in aliases]
    buffers = list(buffers)
    problems = [("parameter", *p) for p in assignment_problems(spec, names)]
    problems += [("buffer", *p) for p in assignment_problems(spec, buffers) if p[1]]
    if problems:
        kind, fqn, what = problems[0]
        raise StageError(
            f"{kind} {fqn!r} is "
            + (f"placed by both {' and '.join(what)}" if what else "on no pipeline stage"),
            StageProblem.PLACED_TWICE if what else StageProblem.UNPLACED,
        )
    order = layers(spec, [*names, *buffers])
    counts = layer_counts(spec, len(order), n_stages) if order else (0,) * n_stages
    stage_layers, start = [], 0
    of_layer: dict[str, int] = {}
    for s, n in enumerate(counts):
        run = order[start : start + n]
        stage_layers.append(tuple(run))
        of_layer.update((v, s) for v in run)
        start += n
    stage = {fqn: _claimed_stage(spec, fqn, n_stages, of_layer) for fqn in names}
    bad_ties = tie_problems(spec, names, tied_to)
    if bad_ties:
        _, _, message, hint = bad_ties[0]
        raise StageError(message, StageProblem.BAD_TIE, hint)
    tie_stage = {a: _tie_stage(spec, a, n_stages) for a, _ in spec.ties}
    held = set(stage.values()) | set(tie_stage.values())
    empty = [s for s in range(n_stages) if s not in held]
    if empty:
        raise StageError(
            f"stage {empty[0]} of {n_stages} holds no parameter",
            StageProblem.EMPTY_STAGE,
            "give every stage at least one layer, or use a smaller pipeline",
        )
    every = tuple(range(n_stages))
    buffer_stages = {
        b: (_claimed_stage(spec, b, n_stages, of_layer),) if claims(spec, b) else every
        for b in buffers
    }
    return StagePlan(spec, n_stages, stage, tuple(stage_layers), tie_stage, buffer_stages)


def _claimed_stage(spec: PipelineSpec, fqn: str, n_stages: int, of_layer: Mapping[str, int]) -> int:
    """The stage of ``fqn``, which exactly one declaration covers."""
    (claim,) = claims(spec, fqn)
    if claim == "first":
        return 0
    if claim == "last":
        return n_stages - 1
    value = layer_of(spec, fqn)
    assert value is not None
    return of_layer[value]


def assignment_problems(spec: PipelineSpec, names: Iterable[str]) -> list[tuple[str, list[str]]]:
    """Parameters on no stage (``(fqn, [])``) or claimed twice (``(fqn, claims)``)."""
    out = []
    for fqn in names:
        what = claims(spec, fqn)
        if len(what) != 1:
            out.append((fqn, what))
    return out
