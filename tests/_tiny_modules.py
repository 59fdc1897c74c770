"""Tiny ``torch.nn`` modules the tests share: built from a fixed seed, so equal wherever they are built."""

from __future__ import annotations

import torch


class SeededLinear(torch.nn.Module):
    """One ``torch.nn.Linear(features, features)`` initialised right after ``torch.manual_seed(0)``;
    its forward is the layer alone. Subclasses override the forward to branch, scale or reshape."""

    def __init__(self, features: int = 4, device: torch.device | str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(features, features, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)
