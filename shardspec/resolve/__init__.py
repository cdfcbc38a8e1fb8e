"""Resolution: the IR against the model manifest (and the Hugging Face manifest).

* :mod:`~shardspec.resolve.params`: which rule places each parameter, with what layout.
* :mod:`~shardspec.resolve.hf`: the spec's ``hf`` block as a :class:`shardspec.core.hfmap.HFMap`.
"""
