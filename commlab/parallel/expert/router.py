"""Top-k routing with a capacity factor: which token goes to which expert slot, computed once, reused.

:func:`route` takes ``[tokens, E]`` router logits: a softmax over the experts (float64 for float64 logits,
else float32), the top k kept (Shazeer et al. 2017, §2.1); with ``normalize`` (default for k > 1) a token's k
weights are renormalised to sum to 1 (Mixtral, arXiv:2401.04088, §2.1; GShard; DeepSeek-V3 §2.1.2), while
k = 1 keeps the plain probability (Switch, arXiv:2101.03961, Eq. 2), since a normalised single weight is
always 1 and gives the router no gradient. Expert e takes at most :func:`expert_capacity` (token, choice)
pairs, ``ceil(capacity_factor · tokens · k / E)`` (Switch §2.2), filled choice-major (every first choice
before any second, as GShard's Algorithm 1); a pair past capacity is dropped (slot -1) and the token passes
on through its residual connection. NaN or infinite logits raise ``ValueError``. Not modelled: GShard's
random second-choice dispatch, DeepSeek-V3's sigmoid scores, bias balancing and node-limited routing.
:func:`skewed_load_imbalance` measures what a biased router does to the load.

Book: chapter 13, §13.3.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives.common import group_size_and_rank
from commlab.launch.device import group_device

__all__ = ["Routing", "expert_capacity", "check_moe_sizes", "route", "LoadImbalance", "load_imbalance",
           "skewed_load_imbalance", "EPLoad", "ep_load_imbalance"]


def check_moe_sizes(num_experts: int, k: int, capacity_factor: float) -> None:
    """Validate an MoE's sizes.

    Raises:
        ValueError: ``num_experts`` not an int >= 1; ``k`` not an int in 1..num_experts; ``capacity_factor``
            not a finite number > 0.
    """
    checks.integer("num_experts", num_experts)
    checks.integer("k (experts per token)", k, 1, num_experts,
                   note=f"num_experts={num_experts}: a token cannot choose more experts than there are")
    checks.number("capacity_factor", capacity_factor, above=0, note="1.0: each expert has room for exactly its even "
                  "share of tokens x k; Switch Transformer used 1.0-2.0")


def expert_capacity(tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert: ``ceil(capacity_factor * tokens * k / num_experts)`` (Switch Transformer §2.2, with k
    choices per token as in GShard). ``tokens`` is the number this rank routes (its local batch x sequence).

    Raises:
        ValueError: as :func:`check_moe_sizes`; ``tokens`` not an int >= 0.
    """
    check_moe_sizes(num_experts, k, capacity_factor)
    checks.integer("tokens", tokens, least=0)
    # In exact decimal arithmetic (the factor as written, e.g. 1.1), so that 1.1 * 10 / 11 is exactly 1, where the
    # binary float product is 1.0000000000000002 and its ceiling 2.
    return math.ceil(Fraction(repr(float(capacity_factor))) * tokens * k / num_experts)


@dataclasses.dataclass(frozen=True, eq=False)   # eq=False: its fields are tensors (compare them with torch.equal)
class Routing:
    """Where each of ``tokens`` tokens goes: computed once by :func:`route`, reusable by any MoE layer.

    Attributes (``T`` tokens, ``k`` choices each, ``E`` experts):
        expert: ``[T, k]`` int64, the chosen expert of each (token, choice).
        weight: ``[T, k]``, the gate weight (carries the router's autograd graph if the logits had one).
        slot: ``[T, k]`` int64, the position in the expert's buffer, in ``0..capacity-1``; -1 if dropped.
        capacity: slots per expert.
        num_experts: E.
        tokens_per_expert: ``[E]`` int64, (token, choice) pairs that asked for each expert (kept + dropped).
        dropped_per_expert: ``[E]`` int64, of those, how many found the expert full.
    """

    expert: torch.Tensor
    weight: torch.Tensor
    slot: torch.Tensor
    capacity: int
    num_experts: int
    tokens_per_expert: torch.Tensor
    dropped_per_expert: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.expert.shape[0]

    @property
    def k(self) -> int:
        return self.expert.shape[1]

    @property
    def kept(self) -> torch.Tensor:
        """``[T, k]`` bool: the (token, choice) pairs that got a slot."""
        return self.slot >= 0

    @property
    def dropped(self) -> int:
        """(token, choice) pairs dropped, over all experts."""
        return int(self.dropped_per_expert.sum())

    def detached(self) -> "Routing":
        """The same routing with its weights cut from the router's graph (to reuse it without router gradients)."""
        return dataclasses.replace(self, weight=self.weight.detach())


def route(logits: torch.Tensor, k: int, capacity_factor: float, *, normalize: bool | None = None,
          capacity: int | None = None) -> Routing:
    """Top-k softmax routing of ``logits`` ``[T, E]`` into experts of ``capacity`` slots.

    Args:
        logits: ``[T, E]`` router logits (any float dtype; the softmax runs in float64 for float64 logits, else
            float32, and the weights come back in the logits' dtype).
        k: experts per token, 1..E (Switch: 1; GShard, Mixtral: 2).
        capacity_factor: > 0; the capacity is :func:`expert_capacity` of T tokens.
        normalize: renormalise the k weights of a token to sum to 1 (Mixtral, DeepSeek-V3); None: True when
            k > 1, False for k = 1 (Switch; the module docstring says why).
        capacity: override the computed capacity (slots per expert, an int >= 0); the capacity factor is still
            validated.

    Returns:
        A :class:`Routing`.

    Raises:
        ValueError: ``logits`` not 2-D; sizes as :func:`check_moe_sizes`; NaN or infinite logits (the message
            counts them: a diverged router or an overflow upstream; fix the input, routing on it would pick
            arbitrary experts).
    """
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, num_experts], got shape {list(logits.shape)}")
    tokens, num_experts = logits.shape
    check_moe_sizes(num_experts, k, capacity_factor)
    bad = int((~torch.isfinite(logits.detach())).sum())
    if bad:
        raise ValueError(f"router logits hold {bad} NaN or infinite value(s) out of {logits.numel()}: the routing "
                         "is undefined; check the layer's input and the router's weights (a diverged step or an "
                         "overflow upstream)")
    if capacity is None:
        capacity = expert_capacity(tokens, num_experts, k, capacity_factor)
    else:
        checks.integer("capacity", capacity, least=0, note="slots per expert")
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(work), dim=-1)
    weight, expert = torch.topk(probs, k, dim=-1)
    if normalize is None:
        normalize = k > 1
    if normalize:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    weight = weight.to(logits.dtype)
    # Choice-major order: flatten [k, T] so that all first choices precede all second choices.
    order = expert.detach().t().reshape(-1)
    onehot = torch.nn.functional.one_hot(order, num_experts)              # [k*T, E]
    position = (onehot.cumsum(dim=0) - 1).gather(1, order[:, None])[:, 0]  # position at its expert
    slot = torch.where(position < capacity, position, torch.full_like(position, -1))
    slot = slot.view(k, tokens).t().contiguous()
    requested = onehot.sum(dim=0)
    dropped = torch.bincount(order[slot.t().reshape(-1) < 0], minlength=num_experts)
    return Routing(expert=expert, weight=weight, slot=slot, capacity=capacity, num_experts=num_experts,
                   tokens_per_expert=requested.to(torch.int64), dropped_per_expert=dropped.to(torch.int64))


# -- load imbalance ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LoadImbalance:
    """How evenly a routing loads the experts.

    Attributes:
        tokens_per_expert: (token, choice) pairs that asked for each expert, a list of E ints.
        kept_per_expert: of those, how many got a slot.
        dropped_per_expert: how many were dropped.
        max_over_mean: ``max(tokens_per_expert) / mean(tokens_per_expert)``: 1.0 is perfectly even; E is
            everything on one expert. The step waits for the busiest expert, so compute scales with it.
        dropped_fraction: dropped pairs / all pairs (T * k).
        capacity: slots per expert.
    """

    tokens_per_expert: list[int]
    kept_per_expert: list[int]
    dropped_per_expert: list[int]
    max_over_mean: float
    dropped_fraction: float
    capacity: int


def load_imbalance(routing: Routing) -> LoadImbalance:
    """The load numbers of ``routing`` (see :class:`LoadImbalance`)."""
    asked = routing.tokens_per_expert.tolist()
    dropped = routing.dropped_per_expert.tolist()
    pairs = routing.tokens * routing.k
    mean = pairs / routing.num_experts
    return LoadImbalance(tokens_per_expert=asked, kept_per_expert=[a - d for a, d in zip(asked, dropped)],
                         dropped_per_expert=dropped, max_over_mean=max(asked) / mean if pairs else 1.0,
                         dropped_fraction=sum(dropped) / pairs if pairs else 0.0, capacity=routing.capacity)


def skewed_load_imbalance(tokens: int, num_experts: int, k: int, capacity_factor: float, bias: float, *,
                          hidden: int = 16, seed: int = 0) -> LoadImbalance:
    """Load imbalance of a random linear router whose logit of expert 0 is raised by ``bias``.

    Tokens ``x ~ N(0, 1)^[tokens, hidden]`` and router weights ``~ N(0, 1/hidden)`` from ``seed`` (float64, on the
    CPU, the global RNG untouched); logits ``x W^T``, plus ``bias`` on expert 0; then :func:`route`. ``bias = 0``
    is an unbiased random router; a large bias sends most first choices to expert 0, which then drops all but
    ``capacity`` of them.

    Returns:
        :class:`LoadImbalance`.

    Raises:
        ValueError: as :func:`route`; ``bias`` not finite.
    """
    checks.number("bias", bias)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(num_experts, hidden, generator=gen, dtype=torch.float64) / math.sqrt(hidden)
    logits = x @ w.t()
    logits[:, 0] += bias
    return load_imbalance(route(logits, k, capacity_factor))


@dataclasses.dataclass(frozen=True)
class EPLoad:
    """Load of an expert-parallel group: every rank's routing added up.

    Attributes:
        experts: :class:`LoadImbalance` of the summed counts (``capacity`` is the slots an expert has over the
            whole group: every rank's capacity added).
        kept_per_rank: (token, choice) pairs each EP rank's experts process, in group-rank order (rank r holds
            experts ``r * E/EP .. (r+1) * E/EP - 1``).
        rank_max_over_mean: ``max / mean`` of ``kept_per_rank``: how much longer the busiest rank computes than
            an even split would take (padding slots aside, which every rank computes alike).
    """

    experts: LoadImbalance
    kept_per_rank: list[int]
    rank_max_over_mean: float


def ep_load_imbalance(routing: Routing, group: dist.ProcessGroup | None) -> EPLoad:
    """Measure the load of an EP group: one all-reduce of ``2 * E`` int64 (this rank's requested and dropped
    counts per expert) over ``group``. Every rank of the group must call it, with its own routing.

    Raises:
        ValueError: ``num_experts`` not divisible by the group size.
        RuntimeError: this rank is not in ``group``.
    """
    size, _ = group_size_and_rank(group, "ep_load_imbalance")
    if routing.num_experts % size:
        raise ValueError(f"num_experts ({routing.num_experts}) must be divisible by the expert-parallel size ({size})")
    counts = torch.stack([routing.tokens_per_expert, routing.dropped_per_expert]).to(group_device(group))
    if size > 1:
        dist.all_reduce(counts, group=group)
    asked, dropped = counts.cpu().tolist()
    pairs = sum(asked)
    per_rank = routing.num_experts // size
    kept = [a - d for a, d in zip(asked, dropped)]
    by_rank = [sum(kept[r * per_rank:(r + 1) * per_rank]) for r in range(size)]
    mean = pairs / routing.num_experts
    experts = LoadImbalance(tokens_per_expert=asked, kept_per_expert=kept, dropped_per_expert=dropped,
                            max_over_mean=max(asked) / mean if pairs else 1.0,
                            dropped_fraction=sum(dropped) / pairs if pairs else 0.0,
                            capacity=routing.capacity * size)
    rank_mean = sum(by_rank) / size
    return EPLoad(experts=experts, kept_per_rank=by_rank,
                  rank_max_over_mean=max(by_rank) / rank_mean if rank_mean else 1.0)
