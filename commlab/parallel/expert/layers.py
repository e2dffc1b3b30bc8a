"""A small mixture-of-experts layer, and the same layer with its experts spread over an expert-parallel group.

:class:`MoE` is the single-process reference: a linear router (:func:`commlab.parallel.expert.router.route`)
and E experts, each a :class:`commlab.parallel.tensor.TransformerMLP`. :class:`ExpertParallelMoE` is made from
a full :class:`MoE` held identically on every EP rank: each rank keeps the router and its ``E / EP`` experts,
dispatches its tokens by AllToAll in capacity-padded ``[EP, E/EP, C, h]`` buffers (Switch, Fedus et al. 2021,
§2.1-2.2; GShard, Lepikhin et al. 2020, §2.2), runs its experts and combines by the inverse AllToAll, so its
output is exactly :class:`MoE` on its tokens. With ``dropless=True`` nothing is dropped or padded: the rows go
sorted by expert in an AllToAllV whose split sizes come from the routing, as Megatron-Core's AllToAll
dispatcher does by default. Bytes: :mod:`commlab.parallel.expert.cost`.

Book: chapter 13, §13.3 (*Dispatch and combine*).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from commlab import checks
from commlab.collectives.common import group_size_and_rank
from commlab.collectives.agreement import check_agreement
from commlab.collectives import all_to_all
from commlab.parallel.expert.communications import AllToAllCounter, all_to_all_autograd, all_to_all_v_autograd
from commlab.parallel.expert.router import Routing, check_moe_sizes, expert_capacity, route
from commlab.parallel.tensor.layers import TransformerMLP

__all__ = ["MoE", "ExpertParallelMoE", "check_ep_size"]


def check_ep_size(num_experts: int, ep: int) -> int:
    """Experts per EP rank, ``num_experts // ep``.

    Raises:
        ValueError: ``ep`` not an int >= 1, or ``num_experts`` not divisible by it.
    """
    checks.integer("ep", ep, note="the expert-parallel size")
    if num_experts % ep:
        fits = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert-parallel size ({ep}), so that "
                         f"every EP rank holds the same number of experts; EP sizes that divide it: {fits}")
    return num_experts // ep


class MoE(nn.Module):
    """Single-process top-k mixture of experts: ``(..., hidden) -> (..., hidden)``.

    Args:
        hidden: model width h.
        ffn_hidden: each expert's inner width.
        num_experts: E.
        k: experts per token (1..E).
        capacity_factor: > 0; slots per expert ``ceil(capacity_factor * T * k / E)`` for T tokens.
        normalize: renormalise the top-k weights (None: for k > 1), see :mod:`~commlab.parallel.expert.router`.
        dtype: parameter dtype.

    Attributes:
        router: ``nn.Linear(hidden, num_experts, bias=False)``.
        experts: ``nn.ModuleList`` of E :class:`~commlab.parallel.tensor.TransformerMLP`.
        last_routing: the :class:`Routing` of the latest forward (its dropped counts), or None.

    Raises:
        ValueError: as :func:`~commlab.parallel.expert.router.check_moe_sizes`.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, k: int = 2, capacity_factor: float = 1.25,
                 *, normalize: bool | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        check_moe_sizes(num_experts, k, capacity_factor)
        self.hidden, self.num_experts, self.k = hidden, num_experts, k
        self.capacity_factor, self.normalize = capacity_factor, normalize
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.experts = nn.ModuleList(TransformerMLP(hidden, ffn_hidden, dtype=dtype) for _ in range(num_experts))
        self.last_routing: Routing | None = None

    @classmethod
    def from_seed(cls, *args, seed: int, **kwargs) -> "MoE":
        """Build the layer from ``seed`` (identically on every rank; the global RNG is left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(*args, **kwargs)

    def route(self, x: torch.Tensor) -> Routing:
        """The routing of ``x`` ``(..., hidden)`` (its tokens flattened in order), for reuse in :meth:`forward`.

        Raises:
            ValueError: the last dimension of ``x`` is not ``hidden``; as :func:`route`.
        """
        return route(self.router(_tokens(x, self.hidden)), self.k, self.capacity_factor, normalize=self.normalize)

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        """``x`` ``(..., hidden)`` through the experts; ``routing`` (None: :meth:`route` of ``x``) says where.

        Raises:
            ValueError: the last dimension of ``x`` is not ``hidden``; ``routing`` was made for another number of
                tokens, experts or k.
        """
        x2 = _tokens(x, self.hidden)
        routing = self.route(x2) if routing is None else routing
        _check_routing(routing, x2.shape[0], self.num_experts, self.k)
        self.last_routing = routing
        out = torch.zeros_like(x2)
        for e, expert in enumerate(self.experts):
            t, j = ((routing.expert == e) & routing.kept).nonzero(as_tuple=True)
            if t.numel():
                out = out.index_add(0, t, routing.weight[t, j, None] * expert(x2[t]))
        return out.view(x.shape)


def _hidden_problem(x: torch.Tensor, hidden: int) -> str | None:
    if x.dim() == 0 or x.shape[-1] != hidden:
        return f"the input must be (..., hidden={hidden}), got shape {list(x.shape)}"
    return None


def _tokens(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """``x`` ``(..., hidden)`` as ``[tokens, hidden]``; ValueError for another last dimension."""
    problem = _hidden_problem(x, hidden)
    if problem:
        raise ValueError(problem)
    return x.reshape(-1, hidden)


def _routing_problem(routing: Routing, tokens: int, num_experts: int, k: int) -> str | None:
    if (routing.tokens, routing.num_experts, routing.k) != (tokens, num_experts, k):
        return (f"the routing was made for {routing.tokens} tokens, {routing.num_experts} experts, k={routing.k}, "
                f"but this layer got {tokens} tokens and has {num_experts} experts, k={k}; route this input "
                "with this layer's router (layer.route(x))")
    return None


def _check_routing(routing: Routing, tokens: int, num_experts: int, k: int) -> None:
    problem = _routing_problem(routing, tokens, num_experts, k)
    if problem:
        raise ValueError(problem)


# Every agreement message starts with this name, so it also says what the signature's entries are.
_AGREEMENT_NAME = ("expert-parallel MoE (signature = [tokens, hidden, experts, k, capacity, non-finite router logits, "
                   "input and routing fit])")
_AGREEMENT_RULE = ("the same on every rank, with 0 non-finite router logits (a NaN or infinity makes the routing "
                   "undefined: check the layer's input and router) and an input (..., hidden) with a routing made for "
                   "it (1)")


class ExpertParallelMoE(nn.Module):
    """:class:`MoE` with its experts spread over an expert-parallel group; dispatch and combine by AllToAll.

    Args:
        moe: the full layer, identical on every rank of ``group``, on the group's device
            (:func:`commlab.launch.device.group_device`: the rank's GPU under NCCL).
        group: the EP process group (None: the world); EP = its size.
        counter: an :class:`~commlab.parallel.expert.communications.AllToAllCounter` that adds up the bytes
            the AllToAlls of this layer send (forward and backward), or None.
        dropless: route with room for every (token, choice) pair (capacity ``tokens * k``; the capacity factor
            is ignored) and dispatch exactly the routed rows by AllToAllV; False: capacity-padded buffers.

    Attributes:
        router: this rank's copy of the router (replicated: its gradient is a partial sum, to be all-reduced
            over the data-parallel ranks like any replicated parameter).
        experts: this rank's ``E / EP`` experts; ``expert_ids`` their indices in the full layer.
        last_routing: the :class:`Routing` of this rank's tokens in the latest forward.

    Raises:
        ValueError: ``num_experts`` not divisible by EP.
        RuntimeError: this rank is not in ``group``.
    """

    def __init__(self, moe: MoE, group: dist.ProcessGroup | None, *, counter: AllToAllCounter | None = None,
                 dropless: bool = False):
        super().__init__()
        self.dropless = checks.flag("dropless", dropless)
        self.ep, rank = group_size_and_rank(group, "ExpertParallelMoE")
        per_rank = check_ep_size(moe.num_experts, self.ep)
        self.group, self.counter = group, counter
        self.hidden, self.num_experts, self.k = moe.hidden, moe.num_experts, moe.k
        self.capacity_factor, self.normalize = moe.capacity_factor, moe.normalize
        self.expert_ids = list(range(rank * per_rank, (rank + 1) * per_rank))
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in self.expert_ids)
        self.last_routing: Routing | None = None

    def route(self, x: torch.Tensor) -> Routing:
        """The routing of this rank's ``x`` ``(..., hidden)``. Local: no communication.

        Raises:
            ValueError: the last dimension of ``x`` is not ``hidden``; as :func:`route`.
        """
        x2 = _tokens(x, self.hidden)
        return route(self.router(x2), self.k, self.capacity_factor, normalize=self.normalize,
                     capacity=x2.shape[0] * self.k if self.dropless else None)

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        """This rank's tokens ``x`` ``(..., hidden)`` through the experts of the whole group.

        Every rank of the group must call it together, with the same hidden size and dtype, and (capacity-padded
        only) the same number of tokens; dropless, each rank may pass any number of tokens, 0 included.
        ``routing`` (None: routed here by this rank's router) can be one computed earlier by :meth:`route`.

        Raises:
            CollectiveMismatchError: on every rank (the message names the ranks and shows each one's signature
                ``[tokens, hidden, experts, k, capacity, non-finite router logits, input and routing fit]``), when
                the ranks disagree on tokens (padded only: dropless shows -1 for tokens and capacity), hidden size
                or dtype; when some rank's router logits hold NaN or
                infinite values (sixth entry: how many); when some rank's input is not ``(..., hidden)`` or its
                ``routing`` was made for other tokens (seventh entry 0); when some rank's input is not on the
                group's device. A one-rank group raises it with the problem in words. It is a ValueError.
        """
        problem = _hidden_problem(x, self.hidden)
        x2 = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
        tokens = x2.shape[0]
        logits = self.router(x2) if routing is None and problem is None else None
        bad_logits = int((~torch.isfinite(logits.detach())).sum()) if logits is not None else 0
        if routing is not None and problem is None:
            problem = _routing_problem(routing, tokens, self.num_experts, self.k)
        capacity = (routing.capacity if routing is not None else tokens * self.k if self.dropless
                    else expert_capacity(tokens, self.num_experts, self.k, self.capacity_factor))
        if bad_logits and not problem:
            problem = f"{bad_logits} NaN or infinite router logit(s) (check the layer's input and router)"
        # One agreement for the whole call: a rank that stopped here alone would leave its peers waiting inside
        # the AllToAll; this way every rank raises the same error instead.
        # Dropless, the AllToAllV takes any split sizes: ranks may route different numbers of tokens (shown -1).
        sized = (-1, -1) if self.dropless else (tokens, capacity)
        check_agreement(_AGREEMENT_NAME, x2, self.group,
                        (sized[0], x2.shape[1], self.num_experts, self.k, sized[1], bad_logits, int(problem is None)),
                        "signature", problem, _AGREEMENT_RULE, same_numel=not self.dropless)
        if routing is None:
            routing = route(logits, self.k, self.capacity_factor, normalize=self.normalize, capacity=capacity)
        self.last_routing = routing
        if self.dropless:
            return self._dropless(x2, routing).view(x.shape)
        per_rank = len(self.experts)
        t, j = routing.kept.nonzero(as_tuple=True)
        e, s = routing.expert[t, j], routing.slot[t, j]
        # Dispatch: [E, C, h] with expert e's rows at e, so rows r*E/EP .. are EP rank r's experts.
        buffer = x2.new_zeros(self.num_experts, capacity, self.hidden).index_put((e, s), x2[t])
        received = all_to_all_autograd(buffer.view(self.ep, per_rank, capacity, self.hidden), self.group,
                                       self.counter)
        outputs = torch.stack([expert(received[:, i].reshape(-1, self.hidden)).view(self.ep, capacity, self.hidden)
                               for i, expert in enumerate(self.experts)], dim=1)
        # Combine: the inverse exchange returns each slot's output to the rank that filled it.
        returned = all_to_all_autograd(outputs, self.group, self.counter).reshape(self.num_experts, capacity,
                                                                                  self.hidden)
        out = x2.new_zeros(tokens, self.hidden).index_add(0, t, routing.weight[t, j, None] * returned[e, s])
        return out.view(x.shape)

    def _dropless(self, x2: torch.Tensor, routing: Routing) -> torch.Tensor:
        # The kept (token, choice) pairs sorted by expert: rank r's experts' rows are then one contiguous run.
        t, j = routing.kept.nonzero(as_tuple=True)
        order = torch.argsort(routing.expert[t, j], stable=True)
        t, j = t[order], j[order]
        per_rank = len(self.experts)
        counts = torch.bincount(routing.expert[t, j], minlength=self.num_experts).view(self.ep, per_rank)
        # Rank i's row of received counts: the rows it sends this rank, per local expert (what all_to_all_single
        # callers exchange first to size the output).
        received_counts = (all_to_all(counts.to(x2.device).contiguous(), self.group, check=False).cpu()
                           if self.ep > 1 else counts)
        send_splits, recv_splits = counts.sum(1).tolist(), received_counts.sum(1).tolist()
        received = all_to_all_v_autograd(x2[t], recv_splits, send_splits, self.group, self.counter)
        # Received rows come source-major, each source's rows by local expert.
        local = torch.arange(per_rank).repeat(self.ep).repeat_interleave(received_counts.reshape(-1)).to(x2.device)
        # Every expert runs, on no rows if none came: the combine's input is then in the autograd graph on every
        # rank (through the received rows and the expert weights), so every rank runs both AllToAllV backwards
        # even when its experts got nothing; skipping them there would leave its peers waiting in theirs.
        outputs = received.new_zeros(received.shape)
        for i, expert in enumerate(self.experts):
            rows = (local == i).nonzero(as_tuple=True)[0]
            outputs = outputs.index_copy(0, rows, expert(received[rows]))
        returned = all_to_all_v_autograd(outputs, send_splits, recv_splits, self.group, self.counter)
        return x2.new_zeros(x2.shape[0], self.hidden).index_add(0, t, routing.weight[t, j, None] * returned)
