"""The IR: what a ``.shard`` file says, as typed objects that keep their source spans.

The parser builds these; resolution, checks and code generation read them. Nothing here
computes layouts (that is :mod:`shardspec.core.layout`) or knows about parameters (that is
:mod:`shardspec.resolve.params`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from shardspec.findings.diagnostics import Span


class Node(BaseModel):
    """A piece of the spec and where it is written. Nodes are frozen, and their fields exact:
    a field that a node does not have is an error, never silently dropped."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, extra="forbid")

    span: Span


class Name(Node):
    """An identifier as written: an axis, a dimension or a component name."""

    text: str


class AxisDecl(Node):
    name: Name
    size: int | None  # None: this axis takes the rest of the world size


class MeshDecl(Node):
    axes: list[AxisDecl]
    world: int | None = None


class Component(Node):
    name: Name
    size: int | None = None  # None: equal parts of the dimension


class FuseItem(Node):
    dim: Name
    components: list[Component]
    groups: int | None = None
    stored_fused: bool = False


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


class ShardItem(Node):
    dim: Name
    axes: list[Name]  # outer -> inner


class StyleItem(Node):
    """``style KIND [input LAYOUT] [output LAYOUT] [dtensor]``: the tensor-parallel style
    of the module holding the parameter, and its activations' layouts."""

    kind: Name
    input: Name | None = None
    output: Name | None = None
    dtensor: bool = False


class Pattern(Node):
    text: str


class Rule(Node):
    """``param PATTERN [dims] { ... }``."""

    index: int  # position in the file, 0-based
    pattern: Pattern
    dims: list[Name]
    dims_given: bool = True  # `param p replicate` may omit the dimension list
    replicate_all: bool = False
    shards: list[ShardItem] = []
    fusions: list[FuseItem] = []
    local: list[Name] = []
    replicate: list[Name] = []  # axes this rule explicitly keeps replicated (opts out of fsdp)
    # `checkpoint shard DIM over AXIS`: stored chunks split further over axes the parameter
    # is replicated on at run time; `checkpoint replicate`: the runtime chunks (the default).
    checkpoint_shards: list[ShardItem] = []
    checkpoint_replicate: Span | None = None
    style: StyleItem | None = None
    heads: list[HeadSize] = []  # `heads kv 128, ...`: head sizes of dims or components
    extra_styles: list[StyleItem] = []  # a second `style` in one rule (an error)


class IgnoreRule(Node):
    pattern: Pattern


class HFTransform(Node):
    """``transpose``, or ``rope N`` (``head_dim`` N), on an hf map line."""

    kind: str
    head_dim: int = 0


class HFConfigFactor(Node):
    """One factor of a ``config`` product: a config.json key or a whole number."""

    text: str

    @property
    def number(self) -> int | None:
        return int(self.text) if self.text.isdigit() else None


class HFPart(Node):
    """One part of a split line's ``as`` list: a fused component, an optional stated size
    (a whole number or a product of config.json keys) and the part's own transforms."""

    name: Name
    size: list[HFConfigFactor] | None = None
    size_span: Span | None = None
    transforms: list[HFTransform] = []


class HFMapItem(Node):
    """``HF_TEMPLATE -> TARGET_TEMPLATE[stack] transform... [grouped] [as PART, ...]`` in
    an ``hf`` block; ``grouped`` is the keyword's span, or None without it."""

    hf: Pattern
    target: Pattern
    stack: Name | None = None
    transforms: list[HFTransform] = []
    parts: list[HFPart] | None = None
    grouped: Span | None = None


class HFGlob(Node):
    """``drop GLOB`` (HF keys nothing consumes) or ``keep GLOB`` (storage units the HF
    checkpoint does not provide)."""

    pattern: Pattern


class HFTie(Node):
    """``tie ALIAS = SOURCE``: HF key ``alias`` is the same tensor as HF key ``source``."""

    alias: Pattern
    source: Pattern


class HFConfig(Node):
    """``config NAME = a * b * 2``: dimension or component ``name`` has that size."""

    name: Name
    factors: list[HFConfigFactor]


class HFBlock(Node):
    """``hf "manifest.hf.json" { ... }``; each list keeps its items in file order."""

    manifest: str | None = None
    manifest_span: Span | None = None
    maps: list[HFMapItem] = []
    drops: list[HFGlob] = []
    ties: list[HFTie] = []
    keeps: list[HFGlob] = []
    configs: list[HFConfig] = []


class StageSplit(Node):
    """``split PATTERN [as N, N, ...] [local]`` in a pipeline block."""

    pattern: Pattern
    counts: list[int] = []
    counts_span: Span | None = None
    local_names: bool = False


class StageTie(Node):
    """``tie ALIAS = SOURCE`` in a pipeline block: parameter ``alias`` (global name, on its
    own stage) is the same weight as parameter ``source`` (tied embeddings and head)."""

    alias: Pattern
    source: Pattern


class Pipeline(Node):
    """``pipeline AXIS { first ...  split ...  last ...  tie ... }``; lists keep file order."""

    axis: Name
    first: list[Pattern] = []
    last: list[Pattern] = []
    splits: list[StageSplit] = []
    ties: list[StageTie] = []


class Suppression(Node):
    """``# shardspec: ignore[SS121, SS122]`` on the line it silences."""

    codes: list[str]


class Spec(BaseModel):
    """A whole ``.shard`` file."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, extra="forbid")

    path: str
    source: str
    sha256: str
    manifest: str | None = None
    manifest_span: Span | None = None
    mesh: MeshDecl | None = None
    fsdp: Name | None = None
    rules: list[Rule] = []
    ignores: list[IgnoreRule] = []
    hf: HFBlock | None = None
    pipeline: Pipeline | None = None
    suppressions: list[Suppression] = []

    @property
    def name(self) -> str:
        """The spec's name: its file name without ``.shard``."""
        base = self.path.replace("\\", "/").rsplit("/", 1)[-1]
        return base[: -len(".shard")] if base.endswith(".shard") else base
