"""Data-parallel training of the digits MLP where the gradient AllReduce is a function you pass in.

Each rank computes the gradient of its own shard's mini-batch; the gradients are averaged by commlab's
data-parallel path, :class:`commlab.overlap.BucketedDataParallel`, through the comm hook
:func:`commlab.overlap.all_reduce_fn_hook`, which sums each bucket with ``all_reduce_fn`` and divides by N;
every rank then takes the same SGD step, so the replicas stay equal. Model, data and loss live on the
group's device (:func:`commlab.launch.group_device`: the CPU under gloo, the rank's GPU under NCCL).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from commlab.launch.device import group_device
from commlab.overlap.bucketed import AllReduceFnState, BucketedDataParallel, all_reduce_fn_hook
from commlab.train.data import load_digits_split, shard
from commlab.train.model import DigitsMLP

__all__ = ["DataParallelResult", "train_data_parallel"]


@dataclasses.dataclass(frozen=True)
class DataParallelResult:
    """Per-step training loss (mean over ranks), final test accuracy, and gradient bytes per step.

    Attributes:
        losses: one float per step, the mean over ranks of the ranks' mini-batch losses (nats).
        test_accuracy: the final model's accuracy on the held-out digits.
        grad_nbytes: bytes of one rank's gradient (elements times their dtype's size).
        buckets: gradient buckets per step (1 by default: the whole gradient is one tensor).
    """

    losses: list[float]
    test_accuracy: float
    grad_nbytes: int
    buckets: int = 1


def train_data_parallel(all_reduce_fn: Callable[[torch.Tensor], torch.Tensor], steps: int = 30,
                        batch_size: int = 32, lr: float = 0.5, seed: int = 0,
                        bucket_cap_bytes: int | None = None) -> DataParallelResult:
    """Train :class:`DigitsMLP` on the digits for ``steps`` SGD steps on every rank of the default group.

    Args:
        all_reduce_fn: ``fn(tensor) -> its sum over the ranks`` (e.g. ``commlab.collectives.ring_all_reduce``,
            or :func:`commlab.train.compressed_all_reduce`); it is called once per gradient bucket, in the same
            order on every rank, with a flat 1-D tensor on the group's device.
        steps, batch_size, lr, seed: the run's settings; ``batch_size`` is per rank.
        bucket_cap_bytes: the wrapper's bucket cap; None (default) puts the whole gradient in one bucket, so
            that a compressor sees it as one tensor (chapter 5's global Top-K). The bucket holds the parameters
            in reverse registration order, as DDP's buckets do.

    Returns:
        :class:`DataParallelResult`, identical on every rank.

    Raises:
        ValueError: ``steps`` or ``batch_size`` < 1.
        Whatever ``all_reduce_fn`` raises, out of ``backward()`` on every rank where it raises (the compressed
        sums raise ``FloatingPointError`` on every rank together).
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
    rank, n = dist.get_rank(), dist.get_world_size()
    device = group_device()
    data = load_digits_split(seed=seed)
    x, y = shard(data.x_train, rank, n).to(device), shard(data.y_train, rank, n).to(device)
    model = DigitsMLP(seed=seed).to(device)
    grad_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    wrapped = BucketedDataParallel(model, bucket_cap_bytes=bucket_cap_bytes or max(grad_nbytes, 1))
    wrapped.register_comm_hook(AllReduceFnState(all_reduce_fn), all_reduce_fn_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(y), (batch_size,), generator=g).to(device)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(wrapped(x[idx]), y[idx])
        loss.backward()  # the buckets are averaged inside it
        opt.step()
        losses.append(loss.detach())
    # One AllReduce of all the steps' losses at the end, instead of a host synchronisation per step.
    total_loss = torch.stack(losses)
    dist.all_reduce(total_loss)
    with torch.no_grad():
        acc = (model(data.x_test.to(device)).argmax(1) == data.y_test.to(device)).float().mean().item()
    return DataParallelResult((total_loss.to(torch.float64) / n).tolist(), acc, grad_nbytes, len(wrapped.buckets))
