"""The capstone's GPT: one readable decoder-only transformer, and the two cuts 3D parallelism makes of it.

GPT-2's layout at toy size (Radford et al. 2019, §2.3: pre-norm blocks, a final LayerNorm, learned positions),
on characters of the course's corpus. Its attention and MLP are commlab's own blocks, so that :func:`apply_tp`
swaps them for Megatron's tensor-parallel layers (Shoeybi et al. 2019, §3: heads and ``ffn`` split; the
embeddings, LayerNorms and head stay replicated) and :func:`pipeline_stages` cuts the blocks into ``pp``
stages for :func:`commlab.parallel.pipeline.pipeline_step`. Every rank builds the whole model from one seed
and keeps its shard, so the parallel model is checkable against the single-process one.

Entry points: :class:`GPTConfig`, :func:`build_gpt`, :func:`check_layout`, :func:`apply_tp`,
:func:`pipeline_stages`, :func:`lm_loss`; chapter 14 §14.1 explains them. Shapes: token ids ``(batch, seq)``
int64 -> logits ``(batch, seq, vocab)``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as Fn

from commlab import checks
from commlab.experiments.corpus import VOCAB
from commlab.parallel.tensor import ParallelMLP, ParallelSelfAttention, SelfAttention, TransformerMLP

__all__ = ["GPTConfig", "GPT", "Block", "Embedding", "Head", "PARAM_DTYPE", "MATMUL_DTYPE", "build_gpt",
           "check_layout", "apply_tp", "pipeline_stages", "lm_loss"]

#: ``--dtype`` -> the dtype of the parameters, their gradients and Adam's moments. ``bfloat16`` is mixed
#: precision: float32 parameters, the passes under bfloat16 autocast, as large runs train.
PARAM_DTYPE = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.float32}

#: ``--dtype`` -> the dtype the matrix multiplications run in (TP's activations travel in it too).
MATMUL_DTYPE = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of the capstone GPT, named as the planner's :class:`~commlab.parallel.planner.ModelConfig` names them.

    Attributes:
        vocab: tokens in the vocabulary (default: the corpus's characters).
        seq: the longest sequence (positions learned).
        layers: transformer blocks.
        hidden: the model width; ``hidden % heads == 0``.
        heads: attention heads.
        ffn: the MLP's inner width (4 x hidden in GPT-2).
    """

    vocab: int = len(VOCAB)
    seq: int = 32
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    ffn: int = 256

    def __post_init__(self):
        for name in ("vocab", "seq", "layers", "hidden", "heads", "ffn"):
            checks.integer(f"GPTConfig.{name}", getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"GPTConfig: hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    def planner_config(self) -> "ModelConfig":
        """The same model as the planner describes models (:class:`commlab.parallel.planner.ModelConfig`), for its
        FLOP, memory and step-time formulas: GPT-style (biases, LayerNorm, learned positions), untied head."""
        from commlab.parallel.planner import ModelConfig
        return ModelConfig(name="capstone", layers=self.layers, hidden=self.hidden, heads=self.heads, ffn=self.ffn,
                           vocab=self.vocab, seq=self.seq, tied_embeddings=False, source="labs/capstone/model.py")

    @property
    def params(self) -> int:
        """Parameters of the whole (unsharded) model: the planner's count
        (:func:`commlab.parallel.planner.parameter_count`), so the two cannot drift apart."""
        from commlab.parallel.planner import parameter_count
        return parameter_count(self.planner_config())


def check_layout(config: GPTConfig, tp: int, pp: int, dp: int, world_size: int | None = None) -> None:
    """Refuse a layout that does not divide the model or the world, naming the numbers; pure, no process group.

    Call it before creating any group, so that a bad command line fails at once on every rank.

    Raises:
        ValueError: ``tp``, ``pp`` or ``dp`` not an int >= 1; ``heads % tp`` (a head's softmax needs all of its
            dimensions), ``ffn % tp`` (column-parallel ``fc1``), ``layers % pp`` (every stage gets the same number
            of blocks), or ``world_size != tp * pp * dp``.
    """
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        checks.integer(f"--{name}", value)
    problems = []
    if config.heads % tp:
        problems.append(f"heads ({config.heads}) is not divisible by tp ({tp}): each TP rank computes whole heads")
    if config.ffn % tp:
        problems.append(f"ffn ({config.ffn}) is not divisible by tp ({tp}): fc1's columns are split evenly")
    if config.layers % pp:
        problems.append(f"layers ({config.layers}) is not divisible by pp ({pp}): each stage gets the same number "
                        "of blocks")
    if world_size is not None and world_size != tp * pp * dp:
        problems.append(f"the world has {world_size} rank{'s' if world_size != 1 else ''} but tp x pp x dp = "
                        f"{tp} x {pp} x {dp} = {tp * pp * dp}")
    if problems:
        raise ValueError(f"layout tp={tp} pp={pp} dp={dp} does not fit the model: " + "; ".join(problems))


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(batch, seq)`` int64 -> ``(batch, seq, hidden)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.seq = config.seq
        self.tok = nn.Embedding(config.vocab, config.hidden)
        self.pos = nn.Embedding(config.seq, config.hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[-1]
        if seq > self.seq:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's seq ({self.seq})")
        return self.tok(idx) + self.pos(torch.arange(seq, device=idx.device))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; ``(b, s, h) -> (b, s, h)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn: nn.Module = SelfAttention(config.hidden, config.heads, causal=True)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.mlp: nn.Module = TransformerMLP(config.hidden, config.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the output projection (no bias): ``(b, s, hidden) -> (b, s, vocab)`` logits."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(config.hidden)
        self.out = nn.Linear(config.hidden, config.vocab, bias=False)  # GPT-2's output layer has no bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(nn.Module):
    """The whole model: :class:`Embedding`, ``config.layers`` :class:`Block` s, :class:`Head`."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.head = Head(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_gpt(config: GPTConfig, seed: int, dtype: torch.dtype = torch.float32) -> GPT:
    """The full model with weights drawn from ``seed`` (the same on every rank), without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    return model.to(dtype)


def apply_tp(model: GPT, tp_group: dist.ProcessGroup | None) -> GPT:
    """Shard every block's attention and MLP over ``tp_group``, in place; returns ``model``.

    Each rank of the group must hold the same full model (:func:`build_gpt` with one seed). With a group of one
    rank the layers are swapped all the same (and communicate nothing), so every layout runs the same code.
    The embeddings, LayerNorms and head stay replicated (a vocabulary-parallel embedding would only add
    communication at this vocabulary's size); their gradients are equal on every TP rank, as their inputs are.

    Raises:
        ValueError: heads or ffn not divisible by the group's size (from the TP layers).
    """
    for block in model.blocks:
        block.attn = ParallelSelfAttention(block.attn, tp_group)
        block.mlp = ParallelMLP(block.mlp, tp_group)
    return model


def pipeline_stages(model: GPT, pp: int) -> list[nn.Sequential]:
    """Cut ``model`` into ``pp`` stages of ``layers / pp`` consecutive blocks each, for ``pipeline_step``.

    Stage 0 starts with the embedding (its input is the int64 token ids), the last stage ends with the head (its
    output the logits). The stages share the model's modules (no copy).

    Raises:
        ValueError: ``pp`` not an int >= 1, or ``layers % pp`` (see :func:`check_layout`).
    """
    layers = len(model.blocks)
    checks.integer("pp", pp, note="pipeline stages")
    if layers % pp:
        raise ValueError(f"layers ({layers}) must be divisible by pp ({pp})")
    per = layers // pp
    stages = []
    for s in range(pp):
        parts: list[nn.Module] = [model.embed] if s == 0 else []
        parts += list(model.blocks[s * per:(s + 1) * per])
        if s == pp - 1:
            parts.append(model.head)
        stages.append(nn.Sequential(*parts))
    return stages


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats): logits ``(b, s, vocab)``, targets ``(b, s)`` int64."""
    return Fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
