"""Shared fixtures: deterministic seeds and a recorder of what autograd saves."""

from __future__ import annotations

import pytest
import torch
from typing_extensions import Self


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class SavedRecorder:
    """Records every tensor autograd saves inside the ``with`` block (no dedup, no filtering)."""

    def __init__(self) -> None:
        self.saved: list[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(t)
        return t

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self.saved}


@pytest.fixture
def recorder() -> type[SavedRecorder]:
    return SavedRecorder
