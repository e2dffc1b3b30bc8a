"""The two training tasks of chapter 8's experiments, behind one small interface.

* ``digits``: the 64-128-128-10 MLP of the earlier chapters on scikit-learn's handwritten digits, SGD;
  quality = test accuracy (higher is better).
* ``charlm``: :class:`~commlab.experiments.charlm.CharTransformer` on the pydoc corpus
  (:mod:`commlab.experiments.corpus`), Adam; quality = validation perplexity per character, ``exp`` of the
  mean cross-entropy in nats (lower is better).

Each rank draws its own mini-batches (from its shard of the digits, or from random windows of the
corpus under a rank-specific generator, on the CPU; the caller moves them to the model's device), so the
global batch is ``world_size * batch_size``. Evaluation is
split across ranks: each rank scores its share of the held-out set and returns (sum, count), which the
caller adds up, so that no rank waits for another.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from commlab.experiments.charlm import CharLMConfig, CharTransformer
from commlab.experiments.corpus import load_corpus
from commlab.train.data import load_digits_split, shard
from commlab.train.model import DigitsMLP

__all__ = ["Task", "TaskDefaults", "OPTIMIZERS", "make_optimizer", "DigitsTask", "CharLMTask", "TASKS", "get_task"]


@dataclasses.dataclass(frozen=True)
class TaskDefaults:
    """A task's default run: optimizer steps, per-rank batch, learning rate, steps between evaluations, optimizer."""

    steps: int
    batch_size: int
    lr: float
    eval_every: int
    optimizer: str


#: Optimizer names a run can ask for: plain SGD, SGD with momentum 0.9, Adam (PyTorch's defaults otherwise).
OPTIMIZERS = ("sgd", "sgd-momentum", "adam")


def make_optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) over ``model``'s parameters.

    Raises:
        ValueError: an unknown name.
    """
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    if name == "sgd-momentum":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")


class Task(Protocol):
    name: str
    metric: str             # "accuracy" or "perplexity"
    higher_is_better: bool
    defaults: TaskDefaults

    def build(self, seed: int) -> nn.Module: ...
    def batch(self, rank: int, world_size: int, batch_size: int, generator: torch.Generator): ...
    def loss(self, model: nn.Module, batch) -> torch.Tensor: ...
    def evaluate(self, model: nn.Module, rank: int, world_size: int) -> tuple[float, int]: ...
    def quality(self, total: float, count: int) -> float: ...


class DigitsTask:
    """The digits MLP (26,122 parameters) with plain SGD, as in chapters 4-7."""

    name = "digits"
    metric = "accuracy"
    higher_is_better = True
    defaults = TaskDefaults(steps=150, batch_size=32, lr=0.5, eval_every=10, optimizer="sgd")

    def __init__(self):
        # One fixed train/test split for every run, so that runs differ only in their seed's init and batches.
        self.data = load_digits_split(seed=0)

    def build(self, seed: int) -> nn.Module:
        return DigitsMLP(seed=seed)

    def batch(self, rank, world_size, batch_size, generator):
        x, y = shard(self.data.x_train, rank, world_size), shard(self.data.y_train, rank, world_size)
        idx = torch.randint(len(y), (batch_size,), generator=generator)
        return x[idx], y[idx]

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model, rank, world_size):
        device = next(model.parameters()).device
        x, y = shard(self.data.x_test, rank, world_size), shard(self.data.y_test, rank, world_size)
        return float((model(x.to(device)).argmax(1) == y.to(device)).sum()), len(y)

    @staticmethod
    def quality(total, count):
        """Accuracy from the summed shares of :meth:`evaluate` (correct predictions, samples)."""
        return total / count


class CharLMTask:
    """A 2-layer character transformer (116,705 parameters by default) on the pydoc corpus, with Adam.

    Args:
        config: the model's size (the default is chapter 8's model; its measured step times are in the
            grid's records, ``compute_s`` of ``commlab/data/experiments/full.jsonl``).
        val_windows: validation windows of ``config.seq`` characters scored at each evaluation (taken
            at a fixed stride from the start of the validation text, the same for every run).
    """

    name = "charlm"
    metric = "perplexity"
    higher_is_better = False
    # Adam at 3e-3 reached a validation loss of 1.88 nats/char in 300 steps of 64 windows on one process;
    # 1e-2 stalled near 2.27; SGD with momentum 0.9 reached 2.41 at lr 0.3 and diverged at 1.0 (measured
    # while choosing these defaults).
    defaults = TaskDefaults(steps=300, batch_size=16, lr=3e-3, eval_every=25, optimizer="adam")

    def __init__(self, config: CharLMConfig = CharLMConfig(), val_windows: int = 256):
        self.config = config
        corpus = load_corpus()
        if config.vocab != corpus.vocab_size:
            raise ValueError(f"config.vocab must be {corpus.vocab_size} (the corpus vocabulary), got {config.vocab}")
        self.train_ids, t = corpus.train, config.seq
        starts = torch.arange(0, len(corpus.val) - t - 1, t)[:val_windows]
        self.val_x = torch.stack([corpus.val[s:s + t] for s in starts])
        self.val_y = torch.stack([corpus.val[s + 1:s + t + 1] for s in starts])

    def build(self, seed):
        return CharTransformer(self.config, seed=seed)

    def batch(self, rank, world_size, batch_size, generator):
        t = self.config.seq
        starts = torch.randint(len(self.train_ids) - t - 1, (batch_size,), generator=generator)
        x = torch.stack([self.train_ids[s:s + t] for s in starts])
        y = torch.stack([self.train_ids[s + 1:s + t + 1] for s in starts])
        return x, y

    def loss(self, model, batch):
        # Computed from model(x), not model.loss(...), so that it runs through a data-parallel wrapper's forward.
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model, rank, world_size):
        x, y = shard(self.val_x, rank, world_size), shard(self.val_y, rank, world_size)
        if len(x) == 0:
            return 0.0, 0
        device = next(model.parameters()).device
        x, y = x.to(device), y.to(device)
        logits = model(x)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        return float(nll), y.numel()

    @staticmethod
    def quality(total, count):
        """Perplexity from the summed shares of :meth:`evaluate` (nats, characters): exp(mean nats per character);
        inf when that overflows a float (a diverging run) or the loss is not finite."""
        mean = total / count
        return math.exp(mean) if math.isfinite(mean) and mean < 700 else math.inf


TASKS = {"digits": DigitsTask, "charlm": CharLMTask}


def get_task(name: str) -> Task:
    """A fresh task object by name.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]()
