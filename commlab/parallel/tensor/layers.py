"""Tensor-parallel layers (Megatron-LM style), each built from a full single-process module.

Shoeybi et al. 2019 (arXiv:1909.08053), §3, Figure 3, with the operators of
:mod:`commlab.parallel.tensor.communications`. :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
:class:`ParallelMLP` and :class:`ParallelSelfAttention` are each *made from* a full ``nn.Linear``,
:class:`TransformerMLP` or :class:`SelfAttention` that every TP rank holds identically; each keeps only its shard, so
outputs and gradients can be compared with the full module's, and ``full_weight()`` reassembles a
parameter. Shapes are ``(batch, seq, hidden)``; ``t`` is the TP group's size. A block makes one all-reduce
of ``batch·seq·hidden·e`` bytes forward (g) and one backward (f) per micro-batch
(:func:`block_allreduce_nbytes`). With ``sequence_parallel=True`` (Korthikanti et al. 2022, §4.2.2) a
block's input and output are ``(batch, seq / t, hidden)``, rank r holding tokens ``r·seq/t ..``, f and g
become an all-gather and a reduce-scatter along the sequence, and the row-parallel bias's gradient is
all-reduced (``hidden`` elements) so that the bias stays replicated.

Book: chapter 10, §10.2 and §10.9; chapter 13, §13.1.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as Fn

from commlab import checks
from commlab.parallel.tensor.communications import (f, g, gather_last_dim, gather_sequence, group_rank, group_size,
                                                    reduce_scatter_sequence, split_last_dim)

__all__ = ["TransformerMLP", "SelfAttention", "ParallelLinear", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelMLP", "ParallelSelfAttention", "block_allreduce_nbytes"]


def block_allreduce_nbytes(batch: int, seq: int, hidden: int, element_nbytes: int, tp: int) -> dict[str, int]:
    """Payload of the all-reduces one tensor-parallel block (MLP or attention) makes per micro-batch.

    Args:
        batch, seq, hidden: activation shape ``(batch, seq, hidden)``.
        element_nbytes: bytes per element (4 for float32, 2 for bfloat16).
        tp: TP group size; with 1 there is no communication.

    Returns:
        ``{"forward": nbytes, "backward": nbytes}``: ``batch * seq * hidden * element_nbytes`` each when
        ``tp > 1`` (g forward, f backward), else 0. This is the all-reduce's *payload*; a ring sends
        ``2 (tp - 1) / tp`` times it per rank.
    """
    for name, v in (("batch", batch), ("seq", seq), ("hidden", hidden), ("element_nbytes", element_nbytes), ("tp", tp)):
        checks.integer(name, v)
    nbytes = batch * seq * hidden * element_nbytes if tp > 1 else 0
    return {"forward": nbytes, "backward": nbytes}


# -- the single-process references -------------------------------------------------------------------------

class TransformerMLP(nn.Module):
    """The transformer MLP: ``fc2(gelu(fc1(x)))``, ``(batch, seq, hidden) -> (batch, seq, hidden)``.

    ``fc1``: hidden -> ffn_hidden, ``fc2``: ffn_hidden -> hidden (both with bias). GeLU is the exact (erf) one.
    """

    def __init__(self, hidden: int, ffn_hidden: int, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden, dtype=dtype)
        self.fc2 = nn.Linear(ffn_hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(Fn.gelu(self.fc1(x)))


class SelfAttention(nn.Module):
    """Multi-head self-attention: ``(batch, seq, hidden) -> (batch, seq, hidden)``.

    ``qkv``: one linear hidden -> 3 * hidden whose output is ``[Q | K | V]``, each split into ``heads`` heads of
    ``hidden / heads``; scaled dot-product attention per head (causal if ``causal``); ``proj``: hidden -> hidden.

    Raises:
        ValueError: ``hidden`` not divisible by ``heads``.
    """

    def __init__(self, hidden: int, heads: int, *, causal: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.hidden, self.heads, self.causal = hidden, heads, causal
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(_attend(self.qkv(x), self.heads, self.causal))


def _attend(qkv: torch.Tensor, heads: int, causal: bool) -> torch.Tensor:
    """``(b, s, 3 * heads * d)`` laid out ``[Q | K | V]`` -> attention output ``(b, s, heads * d)``."""
    b, s, three_hd = qkv.shape
    q, k, v = qkv.split(three_hd // 3, dim=-1)
    q, k, v = (t.reshape(b, s, heads, -1).transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
    out = Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.transpose(1, 2).reshape(b, s, -1)


# -- sharding helpers ----------------------------------------------------------------------------------------

def _check_divisible(what: str, value: int, t: int, hint: str = "") -> None:
    if value % t:
        raise ValueError(f"{what} ({value}) must be divisible by the tensor-parallel size ({t}) to shard it "
                         f"evenly{hint}")


def _rows(weight: torch.Tensor, t: int, r: int, fused: int) -> torch.Tensor:
    """Rank ``r``'s rows of a ``(fused * m, ...)`` tensor: the r-th of t blocks of each of the ``fused`` parts."""
    return torch.cat([part.chunk(t, dim=0)[r] for part in weight.chunk(fused, dim=0)], dim=0)


def _unrows(shards: list[torch.Tensor], fused: int) -> torch.Tensor:
    """Inverse of :func:`_rows` given every rank's shard in group-rank order."""
    pieces = [s.chunk(fused, dim=0) for s in shards]
    return torch.cat([torch.cat([p[i] for p in pieces], dim=0) for i in range(fused)], dim=0)


def _gather_all(x: torch.Tensor, group) -> list[torch.Tensor]:
    x = x.detach().contiguous()
    if group_size(group) == 1:
        return [x.clone()]
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous())


# -- the parallel linear layers -------------------------------------------------------------------------------

class ParallelLinear(nn.Module):
    """What :class:`ColumnParallelLinear` and :class:`RowParallelLinear` share: :meth:`from_seed`, and the full
    weight and bias reassembled over the group by the subclass's :meth:`gather_full`."""

    @classmethod
    def from_seed(cls, in_features: int, out_features: int, group, *, seed: int, bias: bool = True,
                  dtype: torch.dtype = torch.float32, **kwargs) -> "ParallelLinear":
        """Build the full ``nn.Linear`` from ``seed`` (identically on every rank), then shard it."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            full = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
        return cls(full, group, **kwargs)

    def full_weight(self, grad: bool = False) -> torch.Tensor:
        """The full ``(out, in)`` weight (or its gradient) reassembled over the group; every rank must call it."""
        return self.gather_full(self.weight.grad if grad else self.weight, "weight")

    def full_bias(self, grad: bool = False) -> torch.Tensor | None:
        """The full ``(out,)`` bias (or its gradient) as :meth:`gather_full` gives it; None without a bias. Every
        rank must call it."""
        if self.bias is None:
            return None
        return self.gather_full(self.bias.grad if grad else self.bias, "bias")


class ColumnParallelLinear(ParallelLinear):
    """``y = x A^T + b`` with ``A``'s output rows (the columns of ``A^T``) split across the TP group.

    Rank ``r`` keeps rows ``r * out/t .. (r+1) * out/t - 1`` of the weight and of the bias. Forward: ``f`` on the
    input (identity), then the local linear: ``(..., in) -> (..., out / t)``; with ``gather_output`` the shards
    are all-gathered into ``(..., out)``. Backward: ``f`` all-reduces the input gradient.

    Communication (input ``(b, s, in)``, ``e`` bytes per element): forward none (``gather_output``: an all-gather,
    ``b * s * out / t * e`` bytes contributed per rank); backward one all-reduce of ``b * s * in * e`` bytes.

    Args:
        linear: the full layer, identical on every rank of ``group``.
        group: the TP process group (e.g. ``mesh.get_group("tp")``).
        gather_output: return the full output instead of this rank's shard.
        fused: the weight's rows are ``fused`` stacked matrices (3 for a fused ``[Q | K | V]`` projection); each
            is split across ranks separately, so that a rank gets matching rows (heads) of Q, K and V.
        sequence_parallel: the input is this rank's ``(b, s / t, in)`` sequence shard, all-gathered along the
            sequence at the entry (Korthikanti et al. 2022's g) instead of f; backward reduce-scatters its gradient.

    Raises:
        ValueError: ``out_features`` not divisible by ``fused * t``; ``fused`` not an int >= 1.
    """

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None, *, gather_output: bool = False,
                 fused: int = 1, sequence_parallel: bool = False):
        super().__init__()
        t, r = group_size(group), group_rank(group)
        checks.integer("fused", fused)
        if linear.out_features % (fused * t):
            raise ValueError(f"out_features ({linear.out_features}) must be divisible by fused ({fused}) x the "
                             f"tensor-parallel size ({t}) = {fused * t}, so that each of the {fused} stacked "
                             "matrices splits evenly across the group")
        self.group, self.gather_output, self.fused = group, gather_output, fused
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _param(_rows(linear.weight, t, r, fused))
        self.bias = _param(_rows(linear.bias, t, r, fused)) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_sequence(x, self.group) if self.sequence_parallel else f(x, self.group)
        y = Fn.linear(x, self.weight, self.bias)
        return gather_last_dim(y, self.group) if self.gather_output else y

    def gather_full(self, local: torch.Tensor, name: str) -> torch.Tensor:
        """Any tensor laid out as this rank's ``weight`` or ``bias`` shard (``name``; e.g. an optimizer's moment of
        it), reassembled to the full layer's shape over the group. Every rank of the group must call it."""
        return _unrows(_gather_all(local, self.group), self.fused)

    def take_shard(self, full: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's shard of a full-layer-shaped ``weight`` or ``bias`` tensor (the inverse of :meth:`gather_full`)."""
        return _rows(full, group_size(self.group), group_rank(self.group), self.fused)

    def is_sharded(self, name: str) -> bool:
        """Whether parameter ``name`` (``"weight"`` or ``"bias"``) differs across the group's ranks: both do."""
        return group_size(self.group) > 1


class RowParallelLinear(ParallelLinear):
    """``y = x A^T + b`` with ``A``'s input columns split across the TP group; the partial sums all-reduced (g).

    Rank ``r`` keeps columns ``r * in/t .. (r+1) * in/t - 1`` of the weight and the whole bias (added once, after
    the all-reduce). Forward: ``(..., in / t) -> (..., out)``; with ``input_is_parallel=False`` the input is the
    full ``(..., in)`` and this rank takes its slice first. Backward: the gradient of the output passes through g
    unchanged (it is the same on every rank); with ``input_is_parallel=False`` the input gradient is all-gathered.

    Communication (output ``(b, s, out)``, ``e`` bytes per element): forward one all-reduce of ``b * s * out * e``
    bytes; backward none (``input_is_parallel=False``: an all-gather, ``b * s * in / t * e`` contributed per rank).

    Args:
        linear: the full layer, identical on every rank of ``group``.
        group: the TP process group.
        input_is_parallel: the input is already this rank's shard of the last dimension (as after a
            :class:`ColumnParallelLinear`); if False the full input is split here.
        sequence_parallel: reduce-scatter the partial sums along the sequence (Korthikanti et al. 2022's ḡ) instead
            of all-reducing them: the output is this rank's ``(b, s / t, out)``; the bias, added to it, has its
            gradient all-reduced over the group (f on the bias), as every rank adds it to other tokens.

    Raises:
        ValueError: ``in_features`` not divisible by ``t``.
    """

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        t, r = group_size(group), group_rank(group)
        _check_divisible("in_features", linear.in_features, t)
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _param(linear.weight.chunk(t, dim=1)[r])
        self.bias = _param(linear.bias) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_last_dim(x, self.group)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(Fn.linear(x, self.weight), self.group)
            # Each rank adds the bias to its own tokens: its gradient is the sum over the group's (f).
            return y + f(self.bias, self.group) if self.bias is not None else y
        y = g(Fn.linear(x, self.weight), self.group)
        # The bias after g: added once, not t times.
        return y + self.bias if self.bias is not None else y

    def gather_full(self, local: torch.Tensor, name: str) -> torch.Tensor:
        """Any tensor laid out as this rank's ``weight`` or ``bias`` (``name``), reassembled to the full layer's
        shape: the weight's columns gathered over the group, the bias (not sharded) copied. Every rank of the
        group must call it."""
        if name == "bias":
            return local.detach().clone()
        return torch.cat(_gather_all(local, self.group), dim=1)

    def take_shard(self, full: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's part of a full-layer-shaped ``weight`` or ``bias`` (the inverse of :meth:`gather_full`)."""
        if name == "bias":
            return full.detach().clone()
        return full.chunk(group_size(self.group), dim=1)[group_rank(self.group)].clone()

    def is_sharded(self, name: str) -> bool:
        """Whether parameter ``name`` differs across the group's ranks: the weight does, the bias (replicated,
        added after the AllReduce) does not."""
        return name == "weight" and group_size(self.group) > 1


def tp_sharded_parameters(module: nn.Module) -> set[str]:
    """Names (as ``module.named_parameters()`` gives them) of the parameters that are TP shards, different on
    each rank of their TP group; every other parameter is replicated, the same on every TP rank (embeddings,
    LayerNorms, a row-parallel layer's bias), and so is its gradient.

    A data-parallel wrapper keeps the two kinds in separate buckets
    (:class:`commlab.overlap.BucketedDataParallel`'s ``bucket_key``), so that a compressor whose output depends
    on the whole bucket (Top-K's selection, a quantiser's scale) sees the same replicated buckets on every TP
    rank and keeps those parameters identical.
    """
    out = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, ParallelLinear):
            for name, _ in sub.named_parameters(recurse=False):
                if sub.is_sharded(name):
                    out.add(f"{prefix}.{name}" if prefix else name)
    return out


# -- the parallel blocks -------------------------------------------------------------------------------------

class ParallelMLP(nn.Module):
    """:class:`TransformerMLP` split across the TP group: column-parallel ``fc1``, GeLU on the shard, row-parallel ``fc2``.

    ``(batch, seq, hidden) -> (batch, seq, hidden)``, the input and output replicated on every rank of the group.
    f at the entry (inside ``fc1``) and g at the exit (inside ``fc2``): one all-reduce of
    ``batch * seq * hidden * e`` bytes forward and one backward (Shoeybi et al. 2019, §3, Fig. 3a). GeLU needs no
    communication because each rank holds whole columns of ``x A^T`` (the reason ``fc1`` is split by columns).

    Args:
        mlp: the full block, identical on every rank of ``group``.
        group: the TP process group.
        sequence_parallel: input and output are ``(batch, seq / t, hidden)`` sequence shards (module docstring).

    Raises:
        ValueError: ``ffn_hidden`` not divisible by the TP size.
    """

    def __init__(self, mlp: TransformerMLP, group: dist.ProcessGroup | None, *, sequence_parallel: bool = False):
        super().__init__()
        t = group_size(group)
        _check_divisible("ffn_hidden", mlp.fc1.out_features, t)
        self.group = group
        self.hidden = mlp.fc1.in_features
        self.sequence_parallel = sequence_parallel
        self.fc1 = ColumnParallelLinear(mlp.fc1, group, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(mlp.fc2, group, input_is_parallel=True, sequence_parallel=sequence_parallel)

    @classmethod
    def from_seed(cls, hidden: int, ffn_hidden: int, group, *, seed: int,
                  dtype: torch.dtype = torch.float32, sequence_parallel: bool = False) -> "ParallelMLP":
        """Build the full :class:`TransformerMLP` from ``seed`` (identically on every rank), then shard it."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            full = TransformerMLP(hidden, ffn_hidden, dtype=dtype)
        return cls(full, group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(Fn.gelu(self.fc1(x)))

    def allreduce_nbytes(self, batch: int, seq: int, element_nbytes: int) -> dict[str, int]:
        """All-reduce payload per micro-batch, see :func:`block_allreduce_nbytes`."""
        return block_allreduce_nbytes(batch, seq, self.hidden, element_nbytes, group_size(self.group))


class ParallelSelfAttention(nn.Module):
    """:class:`SelfAttention` with its heads split across the TP group.

    Rank ``r`` holds heads ``r * heads/t .. (r+1) * heads/t - 1``: their rows of Q, K and V (a column-parallel
    ``qkv`` with ``fused=3``) and their columns of the output projection (a row-parallel ``proj``). Attention is
    per head, so it needs no communication in between. ``(batch, seq, hidden) -> (batch, seq, hidden)``, replicated
    on the group. f at the entry, g at the exit: one all-reduce of ``batch * seq * hidden * e`` bytes forward and
    one backward (Shoeybi et al. 2019, §3, Fig. 3b).

    Args:
        attn: the full block, identical on every rank of ``group`` (its ``causal`` flag is kept).
        group: the TP process group.
        sequence_parallel: input and output are ``(batch, seq / t, hidden)`` sequence shards (module docstring);
            attention itself runs on the gathered whole sequence.

    Raises:
        ValueError: ``heads`` not divisible by the TP size (a head cannot be split: its softmax needs all of its
            dimensions).
    """

    def __init__(self, attn: SelfAttention, group: dist.ProcessGroup | None, *, sequence_parallel: bool = False):
        super().__init__()
        t = group_size(group)
        if attn.heads % t:
            raise ValueError(f"heads ({attn.heads}) must be divisible by the tensor-parallel size ({t}): each rank "
                             "computes whole heads, since a head's softmax needs all of its dimensions; choose a tp "
                             f"that divides {attn.heads}")
        self.group, self.causal = group, attn.causal
        self.hidden, self.heads, self.local_heads = attn.hidden, attn.heads, attn.heads // t
        self.sequence_parallel = sequence_parallel
        self.qkv = ColumnParallelLinear(attn.qkv, group, fused=3, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(attn.proj, group, input_is_parallel=True, sequence_parallel=sequence_parallel)

    @classmethod
    def from_seed(cls, hidden: int, heads: int, group, *, seed: int, causal: bool = True,
                  dtype: torch.dtype = torch.float32, sequence_parallel: bool = False) -> "ParallelSelfAttention":
        """Build the full :class:`SelfAttention` from ``seed`` (identically on every rank), then shard it."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            full = SelfAttention(hidden, heads, causal=causal, dtype=dtype)
        return cls(full, group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(_attend(self.qkv(x), self.local_heads, self.causal))

    def allreduce_nbytes(self, batch: int, seq: int, element_nbytes: int) -> dict[str, int]:
        """All-reduce payload per micro-batch, see :func:`block_allreduce_nbytes`."""
        return block_allreduce_nbytes(batch, seq, self.hidden, element_nbytes, group_size(self.group))
