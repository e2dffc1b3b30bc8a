"""The labs' digits classifier (a small multilayer perceptron) and helpers to move its gradient as one flat vector."""

from __future__ import annotations

import torch
from torch import nn


class DigitsMLP(nn.Sequential):
    """``in_features -> hidden -> hidden -> classes`` with ReLU; 64-128-128-10 has 26,122 parameters.

    Inputs (batch, in_features) float32; outputs logits (batch, classes).
    """

    def __init__(self, in_features: int = 64, hidden: int = 128, classes: int = 10, seed: int = 0):
        # Build under a fixed seed so every rank starts from identical weights, as DDP's broadcast would ensure.
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            super().__init__(nn.Linear(in_features, hidden), nn.ReLU(),
                             nn.Linear(hidden, hidden), nn.ReLU(),
                             nn.Linear(hidden, classes))


def flat_grad(model: nn.Module) -> torch.Tensor:
    """All parameter gradients concatenated into one 1-D tensor (a zero block where ``.grad`` is None)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def set_flat_grad(model: nn.Module, flat: torch.Tensor) -> None:
    """Write a flat gradient (as produced by :func:`flat_grad`) back into each parameter's ``.grad``.

    Raises:
        ValueError: ``flat`` has the wrong number of elements.
    """
    total = sum(p.numel() for p in model.parameters())
    if flat.numel() != total:
        raise ValueError(f"flat gradient has {flat.numel()} elements, the model has {total} parameters")
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
