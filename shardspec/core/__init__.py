"""The torch-free core that the compiler and the runtime share: one copy of the arithmetic.

* :mod:`~shardspec.core.layout`: which part of each parameter every rank holds (shard
  arithmetic, DTensor placements, sampling the mesh).
* :mod:`~shardspec.core.patterns`: parameter-name patterns (``layers.*.wq``, captures).
* :mod:`~shardspec.core.hfmap`: the Hugging Face map model (rules, transforms, parts).
* :mod:`~shardspec.core.stages`: pipeline stages (which layers each stage holds).
* :mod:`~shardspec.core.styles`: tensor-parallel styles (which placements a style implies).
* :mod:`~shardspec.core.paths`: which file names a checkpoint's index may use (inside the
  folder, symlinks followed).

Standard library only: nothing here imports torch, lark, jinja2 or pydantic.
"""
