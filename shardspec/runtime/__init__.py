"""What generated modules import at train time. Needs torch; never lark, jinja2 or pydantic.

The layout arithmetic and the Hugging Face map model come from :mod:`shardspec.core`, shared
with the compiler; they are re-exported here so that a generated module imports only torch and
``shardspec.runtime``.
"""

from shardspec.core.hfmap import BlockQuant, HFMap, MapRule, Part, Transform
from shardspec.core.layout import Dim, Fusion, LayoutError, Mesh, ParamLayout, RuleSpec
from shardspec.core.paramtable import ParamTable
from shardspec.core.stages import PipelineSpec
from shardspec.runtime.spec import (
    Buffer,
    CompiledSpec,
    Hook,
    MeshViews,
    Param,
    RuntimeModule,
    SpecError,
    require,
)

__all__ = [
    "BlockQuant",
    "Buffer",
    "CompiledSpec",
    "Dim",
    "Fusion",
    "HFMap",
    "Hook",
    "LayoutError",
    "MapRule",
    "Mesh",
    "MeshViews",
    "Param",
    "ParamLayout",
    "ParamTable",
    "Part",
    "PipelineSpec",
    "RuleSpec",
    "RuntimeModule",
    "SpecError",
    "Transform",
    "require",
]
