"""Plain data-parallel training where the gradient AllReduce is a function you pass in.

Each rank computes the gradient of its own shard's mini-batch, the ranks sum the flat gradient with
``all_reduce_fn`` and divide by N, and every rank takes the same SGD step, so the replicas stay equal.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from commlab.train.data import load_digits_split, shard
from commlab.train.model import MLP, flat_grad, set_flat_grad


@dataclasses.dataclass(frozen=True)
class DataParallelResult:
    """Per-step training loss (mean over ranks), final test accuracy, and gradient bytes per step."""

    losses: list[float]
    test_accuracy: float
    grad_nbytes: int


def train_data_parallel(all_reduce_fn: Callable[[torch.Tensor], torch.Tensor], steps: int = 30,
                        batch_size: int = 32, lr: float = 0.5, seed: int = 0) -> DataParallelResult:
    """Train :class:`MLP` on the digits for ``steps`` SGD steps on every rank of the default group.

    Args:
        all_reduce_fn: ``fn(flat_grad) -> summed flat_grad`` (e.g. ``commlab.collectives.ring_all_reduce``).
        steps, batch_size, lr, seed: the run's settings; ``batch_size`` is per rank.

    Returns:
        :class:`DataParallelResult`, identical on every rank.

    Raises:
        ValueError: ``steps`` or ``batch_size`` < 1.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
    rank, n = dist.get_rank(), dist.get_world_size()
    data = load_digits_split(seed=seed)
    x, y = shard(data.x_train, rank, n), shard(data.y_train, rank, n)
    model = MLP(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(y), (batch_size,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        grad = all_reduce_fn(flat_grad(model)) / n
        set_flat_grad(model, grad)
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / n)
    with torch.no_grad():
        acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
    return DataParallelResult(losses, acc, flat_grad(model).numel() * 4)
