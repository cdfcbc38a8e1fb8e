"""Hugging Face safetensors checkpoints in and out of a sharded model, from the spec's
``hf`` block (see :mod:`shardspec.core.hfmap`).

``load_hf`` reads, on each rank, exactly the bytes of that rank's shards: it cuts the
model's state into canonical storage units (the same units checkpoints use, see
:mod:`shardspec.runtime.canonical`), maps each unit's chunk through the declared
transforms to slices of Hugging Face tensors, and reads those slices with safetensors'
slicing. It calls no ``torch.distributed`` collective: every rank knows every rank's
shards from the spec. Everything is checked before the model changes (missing,
unexpected and mis-shaped keys, files outside the checkpoint directory, missing or
truncated files), and the slices are read into staging buffers that are copied into the
model only when every read succeeded.

Block-scaled FP8 tensors (``HFMap.quants``, DeepSeek-V3's ``weight_scale_inv`` format):
a rank reads the FP8 bytes of its own box and only the scale blocks that cover it, and
dequantizes them before the line's transforms; ``export_hf`` quantizes each such tensor per
block on the rank that writes it (:mod:`~shardspec.runtime.hf.fp8`).

``export_hf`` writes the model as sharded safetensors files with an index. Each stored
chunk is sent once, by the replica the checkpoint writer balancing chose, to the rank
that writes the tensor (through host memory, over the export's gloo group:
:mod:`~shardspec.runtime.hf.exchange`); tensors are spread over the ranks by bytes, so no
rank gathers the whole model.

Pipeline stages (a spec with a ``pipeline`` block): each rank's model is its stage's
model, under its stage's names (global, or numbered from 0 per stage with ``split ...
local``); Hugging Face keys and storage units always use the whole model's (global)
names. The whole model's units come from the manifest, so every rank validates the whole
checkpoint alike (a key missing for another stage fails every rank) while reading only
its own stage's bytes, still without a collective. ``export_hf`` on a pipeline first
shares each rank's parameter dtypes (one ``all_gather_object`` on the export's group),
then every rank computes every stage's chunk senders from a canonical plan of that
stage's structure (meta tensors), so all ranks agree on who sends what.
"""

from shardspec.runtime.hf.common import (
    EXPORT_MARKER,
    INDEX,
    SINGLE,
    HFError,
    HFExportReport,
    HFLoadReport,
)
from shardspec.runtime.hf.export import export_hf
from shardspec.runtime.hf.folders import EXPORT_DONE, EXPORT_REPLACED, ExportRecoveryWarning
from shardspec.runtime.hf.load import load_hf

__all__ = [
    "EXPORT_DONE",
    "EXPORT_MARKER",
    "EXPORT_REPLACED",
    "INDEX",
    "SINGLE",
    "ExportRecoveryWarning",
    "HFError",
    "HFExportReport",
    "HFLoadReport",
    "export_hf",
    "load_hf",
]
