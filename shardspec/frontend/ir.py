"""The IR: what a ``.shard`` file says, as typed objects that keep their source spans.

The parser builds these; resolution, checks and code generation read them. Nothing here
computes layouts (that is :mod:`shardspec.core.layout`) or knows about parameters (that is
:mod:`shardspec.resolve.params`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardspec.findings.diagnostics import Span


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """A piece of the spec and where it is written. Every node is a frozen dataclass with
    slots, built by keyword: a field that a node does not have is an error (TypeError),
    never silently dropped. Slots, not pydantic models: a spec of half a million rules holds
    millions of nodes, built by the parser from values it has already checked."""

    span: Span


@dataclass(frozen=True, slots=True, kw_only=True)
class Name(Node):
    """An identifier as written: an axis, a dimension or a component name."""

    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AxisDecl(Node):
    name: Name
    size: int | None  # None: this axis takes the rest of the world size


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshDecl(Node):
    axes: list[AxisDecl]
    world: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Component(Node):
    name: Name
    size: int | None = None  # None: equal parts of the dimension


@dataclass(frozen=True, slots=True, kw_only=True)
class FuseItem(Node):
    dim: Name
    components: list[Component]
    groups: int | None = None
    stored_fused: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class HeadSize(Node):
    """``TARGET SIZE`` in a ``heads`` item: dimension or fused component ``target`` comes
    in heads of ``size`` indices, or of the value of the name ``size_name`` (a factory
    argument of the manifest, or a config.json key of the hf block's HF manifest)."""

    target: Name
    size: int | None = None
    size_name: Name | None = None

    @property
    def size_text(self) -> str:
        """The size as written."""
        return self.size_name.text if self.size_name is not None else str(self.size)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardItem(Node):
    dim: Name
    axes: list[Name]  # outer -> inner


@dataclass(frozen=True, slots=True, kw_only=True)
class StyleItem(Node):
    """``style KIND [input LAYOUT] [output LAYOUT] [dtensor]``: the tensor-parallel style
    of the module holding the parameter, and its activations' layouts."""

    kind: Name
    input: Name | None = None
    output: Name | None = None
    dtensor: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Pattern(Node):
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule(Node):
    """``param PATTERN [dims] { ... }``."""

    index: int  # position in the file, 0-based
    pattern: Pattern
    dims: list[Name]
    dims_given: bool = True  # `param p replicate` may omit the dimension list
    replicate_all: bool = False
    shards: list[ShardItem] = field(default_factory=list)
    fusions: list[FuseItem] = field(default_factory=list)
    local: list[Name] = field(default_factory=list)
    # axes this rule explicitly keeps replicated (opts out of fsdp)
    replicate: list[Name] = field(default_factory=list)
    # `checkpoint shard DIM over AXIS`: stored chunks split further over axes the parameter
    # is replicated on at run time; `checkpoint replicate`: the runtime chunks (the default).
    checkpoint_shards: list[ShardItem] = field(default_factory=list)
    checkpoint_replicate: Span | None = None
    style: StyleItem | None = None
    # `heads kv 128, ...`: head sizes of dims or components
    heads: list[HeadSize] = field(default_factory=list)
    # a second `style` in one rule (an error)
    extra_styles: list[StyleItem] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class IgnoreRule(Node):
    pattern: Pattern


@dataclass(frozen=True, slots=True, kw_only=True)
class HFTransform(Node):
    """``transpose``, or ``rope N`` (``head_dim`` N), on an hf map line."""

    kind: str
    head_dim: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class HFConfigFactor(Node):
    """One factor of a ``config`` product: a config.json key or a whole number."""

    text: str

    @property
    def number(self) -> int | None:
        return int(self.text) if self.text.isdigit() else None


@dataclass(frozen=True, slots=True, kw_only=True)
class HFPart(Node):
    """One part of a split line's ``as`` list: a fused component, an optional stated size
    (a whole number or a product of config.json keys) and the part's own transforms."""

    name: Name
    size: list[HFConfigFactor] | None = None
    size_span: Span | None = None
    transforms: list[HFTransform] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class HFMapItem(Node):
    """``HF_TEMPLATE -> TARGET_TEMPLATE[stack] transform... [grouped] [as PART, ...]`` in
    an ``hf`` block; ``grouped`` is the keyword's span, or None without it."""

    hf: Pattern
    target: Pattern
    stack: Name | None = None
    transforms: list[HFTransform] = field(default_factory=list)
    parts: list[HFPart] | None = None
    grouped: Span | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HFGlob(Node):
    """``drop GLOB`` (HF keys nothing consumes) or ``keep GLOB`` (storage units the HF
    checkpoint does not provide)."""

    pattern: Pattern


@dataclass(frozen=True, slots=True, kw_only=True)
class HFTie(Node):
    """``tie ALIAS = SOURCE``: HF key ``alias`` is the same tensor as HF key ``source``."""

    alias: Pattern
    source: Pattern


@dataclass(frozen=True, slots=True, kw_only=True)
class HFConfig(Node):
    """``config NAME = a * b * 2``: dimension or component ``name`` has that size."""

    name: Name
    factors: list[HFConfigFactor]


@dataclass(frozen=True, slots=True, kw_only=True)
class HFBlock(Node):
    """``hf "manifest.hf.json" { ... }``; each list keeps its items in file order."""

    manifest: str | None = None
    manifest_span: Span | None = None
    maps: list[HFMapItem] = field(default_factory=list)
    drops: list[HFGlob] = field(default_factory=list)
    ties: list[HFTie] = field(default_factory=list)
    keeps: list[HFGlob] = field(default_factory=list)
    configs: list[HFConfig] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSplit(Node):
    """``split PATTERN [as N, N, ...] [local]`` in a pipeline block."""

    pattern: Pattern
    counts: list[int] = field(default_factory=list)
    counts_span: Span | None = None
    local_names: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTie(Node):
    """``tie ALIAS = SOURCE`` in a pipeline block: parameter ``alias`` (global name, on its
    own stage) is the same weight as parameter ``source`` (tied embeddings and head)."""

    alias: Pattern
    source: Pattern


@dataclass(frozen=True, slots=True, kw_only=True)
class Pipeline(Node):
    """``pipeline AXIS { first ...  split ...  last ...  tie ... }``; lists keep file order."""

    axis: Name
    first: list[Pattern] = field(default_factory=list)
    last: list[Pattern] = field(default_factory=list)
    splits: list[StageSplit] = field(default_factory=list)
    ties: list[StageTie] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class Suppression(Node):
    """``# shardspec: ignore[SS121, SS122]`` on the line it silences."""

    codes: list[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Spec:
    """A whole ``.shard`` file."""

    path: str
    source: str
    sha256: str
    manifest: str | None = None
    manifest_span: Span | None = None
    mesh: MeshDecl | None = None
    fsdp: Name | None = None
    rules: list[Rule] = field(default_factory=list)
    ignores: list[IgnoreRule] = field(default_factory=list)
    hf: HFBlock | None = None
    pipeline: Pipeline | None = None
    suppressions: list[Suppression] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The spec's name: its file name without ``.shard``."""
        base = self.path.replace("\\", "/").rsplit("/", 1)[-1]
        return base[: -len(".shard")] if base.endswith(".shard") else base
