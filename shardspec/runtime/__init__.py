"""What generated modules import at train time. Needs torch; never lark, jinja2 or pydantic.

The layout arithmetic comes from :mod:`shardspec.layout`, shared with the compiler.
"""

from shardspec.layout import Dim, Fusion, LayoutError, Mesh, ParamLayout, RuleSpec
from shardspec.runtime.spec import CompiledSpec, Param, SpecError, require

__all__ = [
    "CompiledSpec",
    "Dim",
    "Fusion",
    "LayoutError",
    "Mesh",
    "Param",
    "ParamLayout",
    "RuleSpec",
    "SpecError",
    "require",
]
