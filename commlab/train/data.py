"""scikit-learn's bundled handwritten digits (UCI ML hand-written digits, 1,797 images of 8x8 pixels).

The data ships inside scikit-learn, so nothing is downloaded. Source: Alpaydin & Kaynak, "Optical
Recognition of Handwritten Digits", UCI Machine Learning Repository (1998); ``sklearn.datasets.load_digits``.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Digits:
    """Train/test tensors. ``x_*``: float32 (samples, 64), pixels scaled to [0, 1]; ``y_*``: int64 (samples,)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> Digits:
    """Load the digits and split them with a fixed permutation (same on every rank for a given seed).

    Raises:
        ValueError: ``test_fraction`` outside (0, 1).
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(bunch.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(len(y) * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    return Digits(x[train], y[train], x[test], y[test])


def shard(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of the first dimension (``torch.tensor_split`` rule).

    Raises:
        ValueError: ``rank`` outside ``range(world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in range({world_size}), got {rank}")
    return torch.tensor_split(x, world_size)[rank]
