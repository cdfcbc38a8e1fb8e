"""shardspec: a declarative sharding-spec compiler for PyTorch distributed training.

This package's top level imports nothing heavy: the compiler (lark, pydantic, jinja2) and
the runtime (torch) are imported only by the modules that need them.
"""

__version__ = "0.1.0"

# The contract between generated modules and ``shardspec.runtime``. A generated module
# states the API version it was rendered for; the runtime refuses a different one.
# 2: generated modules pass buffers= and hook_keys= (manifest format 2).
# 3: "name-indexed" for what was "virtual": RuleSpec(name_indexed=...), NAME_INDEXED_COUNTS,
#    CompiledSpec(name_indexed_counts=...).
# 4: MapRule(grouped=..., dtypes=...): grouped split lines, the HF manifest's dtypes per line.
# 5: PARAMS is a ParamTable of folded rows (names that differ only in numbers share one),
#    imported from shardspec.runtime.
# 6: BUFFERS is a ParamTable of Buffer(rule, shape, dtype) rows and HOOK_KEYS one of Hook rows
#    (names relative to their key), both folded like PARAMS; pipeline stages place buffers.
# 7: specs with views (named meshes): CompiledSpec(views=, view_fsdp=, rule_views=), and
#    build_mesh() returns MeshViews (view -> DeviceMesh) for them.
# 8: CompiledSpec(checkpoint_keys=) (`checkpoint keys NAME`), the default key layout of save
#    and load, which (and their planners) take keys=; `stored fused` is stored whole.
RUNTIME_API = 8
