"""Small stores and their items, for the writer's tests (test_directory.py) and the format's (test_format.py):
a store of D-wide main + L deepstack taps, and distinct, deterministic tensors to put in it."""

from __future__ import annotations

from pathlib import Path

import torch

from service.store.directory import DirectoryStore

MODEL = "test-model"
D = 8  # out_hidden_size
L = 3  # deepstack levels
W = D * (1 + L)


def make_store(root: Path, capacity: int = 1 << 30, model: str = MODEL, **kw) -> DirectoryStore:
    return DirectoryStore(root, capacity, model_id=model, out_hidden_size=D, deepstack_levels=L, **kw)


def parts_for(seed: int, n: int, dtype=torch.float32) -> list[torch.Tensor]:
    """main + L deepstack taps, each [n, D], distinct and deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, D, generator=g) + 100 * i).to(dtype) for i in range(1 + L)]


def ec_for(seed: int, n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.cat(parts_for(seed, n, dtype), dim=1).contiguous()


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}
