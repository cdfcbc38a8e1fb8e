"""``shardspec.runtime.hf.load._read_box``: a box of the model's tensor read from a safetensors
file through the mapping's transforms, against the same box cut from the whole tensor
transformed by hand; and no safetensors slice (so no mmap of the file) outlives the call
waiting for the garbage collector."""

from __future__ import annotations

import gc
import itertools
import types
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardspec.core.hfmap import Transform, rope_row
from shardspec.runtime.hf.load import _read_box

ROPE = Transform("rope", 4)
TRANSPOSE = Transform("transpose")

# HF tensor shape, transforms (HF -> model), boxes of the model's tensor (offsets, sizes).
CASES: list[tuple[str, tuple[int, ...], tuple[Transform, ...]]] = [
    ("plain", (12, 10), ()),
    ("rope", (12, 10), (ROPE,)),
    ("transpose", (10, 12), (TRANSPOSE,)),
    ("transpose_rope", (10, 12), (TRANSPOSE, ROPE)),
    ("vector", (12,), ()),
    ("int_rope", (8, 6), (ROPE,)),
]


def model_tensor(hf: torch.Tensor, transforms: Sequence[Transform]) -> torch.Tensor:
    """The whole model tensor from the whole HF tensor, by hand."""
    t = hf
    for tr in transforms:
        if tr.kind == "transpose":
            t = t.t()
        else:
            t = t[[rope_row(m, tr.head_dim) for m in range(t.shape[0])]]
    return t


def boxes(shape: Sequence[int]) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Whole, halves, quarters, odd boxes (rows cutting heads) and an empty box."""
    per_dim = []
    for n in shape:
        opts = {(0, n), (0, n // 2), (n // 2, n - n // 2), (n // 4, n // 2), (1, n - 3)}
        opts.add((n // 2, 0))
        per_dim.append(sorted(opts))
    for combo in itertools.product(*per_dim):
        yield tuple(o for o, _ in combo), tuple(s for _, s in combo)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("read_box")
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape, _ in CASES:
        if name.startswith("int"):
            tensors[name] = torch.randint(-1000, 1000, shape, generator=gen, dtype=torch.int32)
        else:
            tensors[name] = torch.randn(shape, generator=gen)
    save_file(tensors, str(root / "t.safetensors"))
    return root


@pytest.mark.parametrize("name,shape,transforms", CASES, ids=[c[0] for c in CASES])
def test_read_box_equals_the_box_of_the_transformed_tensor(
    files: Path, name: str, shape: tuple[int, ...], transforms: tuple[Transform, ...]
) -> None:
    with safe_open(str(files / "t.safetensors"), framework="pt") as f:
        full = model_tensor(f.get_tensor(name), transforms)
        n = 0
        for offsets, sizes in boxes(full.shape):
            got = _read_box(f, name, transforms, offsets, sizes)
            want = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (
                offsets,
                sizes,
            )
            assert torch.equal(got, want), (name, offsets, sizes)
            n += 1
    assert n >= 6


def _mapped(path: Path) -> int | None:
    """Mappings of ``path`` in this process (None: no /proc here)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            return sum(1 for line in f if str(path) in line)
    except OSError:
        return None


def _live_readers() -> int:
    return sum(
        1
        for o in gc.get_objects()
        if type(o) is types.FunctionType and o.__qualname__.startswith("_read_box.<locals>")
    )


def test_read_box_leaves_nothing_for_the_garbage_collector(files: Path) -> None:
    """The recursive reader used to be a self-referencing closure: each call left a cycle
    holding its safetensors slice, which kept the file mapped (and its pages pinned in the
    page cache, out of reach of ``posix_fadvise(DONTNEED)``) until a garbage collection."""
    path = files / "t.safetensors"
    gc.collect()
    assert _mapped(path) in (0, None)
    enabled = gc.isenabled()
    gc.disable()
    try:
        f = safe_open(str(path), framework="pt")
        for transforms, name in (((ROPE,), "rope"), ((), "plain")):
            box = _read_box(f, name, transforms, (4, 2), (4, 5))
            out = box.clone()
            del box
        del f
        assert _live_readers() == 0
        assert _mapped(path) in (0, None)
    finally:
        if enabled:
            gc.enable()
    assert out.shape == (4, 5)
