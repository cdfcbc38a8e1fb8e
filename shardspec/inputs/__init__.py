"""Files the compiler reads besides the spec, and the commands that write them.

* :mod:`~shardspec.inputs.manifest`: the model manifest (parameter names and shapes).
* :mod:`~shardspec.inputs.manifest_build`: ``shardspec manifest``, a manifest from a model.
* :mod:`~shardspec.inputs.hfmanifest`: the Hugging Face manifest (checkpoint names,
  shapes, config).
* :mod:`~shardspec.inputs.load`: the manifests a spec names, loaded for the checks (or the
  SS002/SS003 finding).
"""
