"""Checkpoints in the spec's canonical layout: DCP planners, and ``save``/``load`` that make
them atomic, verified and file-local. Generated modules use this package as
``_checkpoint.save``, ``_checkpoint.load``, ``_checkpoint.ShardspecSavePlanner`` and
``_checkpoint.ShardspecLoadPlanner``; the names below are its public API.

Modules, each with one job:

* :mod:`~shardspec.runtime.checkpoint.api`: ``save``, ``load``, ``wait_for_saves``, the
  steps of an (asynchronous) save and of a load, and the checkpoint's completion marker.
* :mod:`~shardspec.runtime.checkpoint.planners`: the DCP planners (canonical units, static
  writers, the coordinator's structure check, DCP's plan cache) and ``validate``, which
  compares a state dict with a checkpoint's metadata before a byte is read.
* :mod:`~shardspec.runtime.checkpoint.locality`: the load planner that reads only this
  rank's own files on the mesh a checkpoint was saved with.
* :mod:`~shardspec.runtime.checkpoint.staging`: staging memory (the CPU copies of an
  asynchronous save, the reused buffer pool, the storage-less sinks a load reads into).
* :mod:`~shardspec.runtime.checkpoint.folders`: the crash-proof folder protocol on disk
  (markers that prove ownership, ``<path>.partial`` and ``<path>.old``, recovery of an
  interrupted save; ``export_hf`` uses the same protocol with its own names).
* :mod:`~shardspec.runtime.checkpoint.collectives`: how the ranks of a save agree (the
  coordinator's outcome, which ranks stopped, the checkpoint process group, discarded when
  a rank dies so that no survivor waits out a timeout).
* :mod:`~shardspec.runtime.checkpoint.metadata`: what is checked in DCP's ``.metadata``
  (data files inside the folder, chunks that tile their tensors, DCP's structure).
* :mod:`~shardspec.runtime.checkpoint.failures`: DCP's exceptions as the
  :class:`CheckpointError` a caller sees, with their frames freed.
* :mod:`~shardspec.runtime.checkpoint.integrity` (checksums per stored chunk),
  :mod:`~shardspec.runtime.checkpoint.trust` (loading a checkpoint you did not write) and
  :mod:`~shardspec.runtime.checkpoint.global_plan` (the coordinator's linear-time check).

Imports flow one way (a module imports only modules listed after it): ``api``;
``locality``; ``planners``; ``staging`` and ``global_plan``; ``trust``; ``integrity``;
``metadata``; ``collectives``; ``failures``; ``folders``; then :mod:`shardspec.runtime.units`,
:mod:`shardspec.runtime.canonical` and :mod:`shardspec.runtime.spec`. Only this
``__init__`` imports them all, to re-export the public names; no module imports it.
"""

from __future__ import annotations

from shardspec.runtime.checkpoint.api import load, save, wait_for_saves
from shardspec.runtime.checkpoint.collectives import COLLECTIVE_TIMEOUT, checkpoint_group
from shardspec.runtime.checkpoint.folders import (
    MARKER,
    REPLACED,
    SAVING,
    CheckpointRecoveryWarning,
)
from shardspec.runtime.checkpoint.global_plan import validate_global_plan
from shardspec.runtime.checkpoint.integrity import ChecksumError
from shardspec.runtime.checkpoint.locality import LocalityLoadPlanner
from shardspec.runtime.checkpoint.planners import (
    ShardspecLoadPlanner,
    ShardspecSavePlanner,
    UncoveredEntriesWarning,
    uncovered_message,
    validate,
)
from shardspec.runtime.checkpoint.staging import free_staging_memory, reader_fills_sinks
from shardspec.runtime.units import (
    KEY_LAYOUTS,
    TORCHTITAN,
    CheckpointError,
    KeyLayout,
    Names,
    canonical_plan,
    clear_plan_cache,
    ignored_key,
    mesh_and_rank,
    rename_path,
    unit_commit,
    unit_commit_box,
    unit_data,
)

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "KEY_LAYOUTS",
    "MARKER",
    "REPLACED",
    "SAVING",
    "TORCHTITAN",
    "CheckpointError",
    "CheckpointRecoveryWarning",
    "ChecksumError",
    "KeyLayout",
    "LocalityLoadPlanner",
    "Names",
    "ShardspecLoadPlanner",
    "ShardspecSavePlanner",
    "UncoveredEntriesWarning",
    "canonical_plan",
    "checkpoint_group",
    "clear_plan_cache",
    "free_staging_memory",
    "ignored_key",
    "load",
    "mesh_and_rank",
    "reader_fills_sinks",
    "rename_path",
    "save",
    "uncovered_message",
    "unit_commit",
    "unit_commit_box",
    "unit_data",
    "validate",
    "validate_global_plan",
    "wait_for_saves",
]
