"""Where a load's point-to-point chunks travel (``locality.wire_device``): from the tensor's
own device where the default group's backend sends from it, else through host memory.

Seen on one H100 shared by 4 ranks over gloo (bench/gpu_check.py, issue 25): the file-
locality exchange posted ``isend``/``irecv`` of CUDA tensors on a gloo group, gloo wrote
from the device pointer as if it were host memory (``writev ... Bad address``) and the rank
aborted. A CPU machine cannot send a CUDA tensor, so the decision is tested here, and the
exchange itself by every multi-rank load test (host tensors, the same code path)."""

from __future__ import annotations

import pytest
import torch

from shardspec.runtime.checkpoint.locality import wire_device

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("backend", "device", "want"),
    [
        ("nccl", CUDA, CUDA),  # NCCL sends from GPU memory
        ("cpu:gloo,cuda:nccl", CUDA, CUDA),  # the usual mixed default group
        ("gloo", CUDA, CPU),  # gloo would read the device pointer as a host one
        ("cpu:gloo,cuda:gloo", CUDA, CPU),
        ("gloo", CPU, CPU),
        ("cpu:gloo,cuda:nccl", CPU, CPU),
        ("nccl", CPU, CPU),  # a host tensor stays on the host
    ],
)
def test_wire_device(backend: str, device: torch.device, want: torch.device) -> None:
    assert wire_device(backend, device) == want
