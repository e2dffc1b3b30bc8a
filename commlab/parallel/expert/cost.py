"""Bytes and α-β time of expert parallelism's AllToAlls, per step and per rank.

Capacity-padded (Switch Transformer, Fedus et al. 2021, §2.2): every AllToAll moves ``[EP, E/EP, C, h]`` with
``C = ceil(capacity_factor * T * k / E)`` slots per expert, whatever the routing; four per layer and
micro-batch (dispatch and combine, forward and backward), each ``(EP-1) α + (EP-1)/EP · B · β`` for
``B = E * C * h * e`` bytes per rank (:func:`moe_alltoall_cost`).

Dropless (Megatron-Core's default, ``moe_expert_capacity_factor=None``; DeepSeek-V3 §2.1.2): each dispatch is
an AllToAllV of exactly the routed rows; :func:`moe_dropless_cost` prices it from every rank's tokens per
expert, the time set by the busiest port and the experts' GEMMs by the busiest rank. A group that spans
nodes is priced two-level (:func:`commlab.collectives.two_level_all_to_all_seconds`). Book: chapter 13, §13.3.
"""

from __future__ import annotations

import dataclasses

from commlab import checks
from commlab.collectives import all_to_all_seconds, two_level_all_to_all_seconds
from commlab.collectives.common import check_cost_args, check_counts
from commlab.parallel.expert.layers import check_ep_size
from commlab.parallel.expert.router import expert_capacity

__all__ = ["MoEAllToAllCost", "moe_alltoall_cost", "MoEDroplessCost", "moe_dropless_cost"]


@dataclasses.dataclass(frozen=True)
class MoEAllToAllCost:
    """What one expert-parallel MoE layer's AllToAlls move per rank, for one micro-batch (forward + backward).

    Attributes:
        capacity: slots per expert, C.
        buffer_nbytes: bytes of one AllToAll's tensor ``[EP, E/EP, C, h]`` on a rank, ``E * C * h * e``.
        sent_per_alltoall_nbytes: bytes a rank sends to the other ranks in one AllToAll, ``(EP-1)/EP`` of it.
        forward_sent_nbytes, backward_sent_nbytes: two AllToAlls each (dispatch + combine).
        step_sent_nbytes: forward + backward, bytes sent per rank.
        step_seconds: four times :func:`commlab.collectives.all_to_all_seconds` of ``buffer_nbytes``.
        useful_fraction: of the slots, the share a perfectly even routing with no drop would fill,
            ``T * k / (E * C)``; the rest is padding (about ``1 / capacity_factor``).
    """

    capacity: int
    buffer_nbytes: int
    sent_per_alltoall_nbytes: int
    forward_sent_nbytes: int
    backward_sent_nbytes: int
    step_sent_nbytes: int
    step_seconds: float
    useful_fraction: float


def moe_alltoall_cost(tokens: int, hidden: int, num_experts: int, k: int, capacity_factor: float, ep: int,
                      element_nbytes: int, alpha_s: float = 0.0, beta_s_per_byte: float = 0.0, *,
                      intra: tuple[int, float, float] | None = None) -> MoEAllToAllCost:
    """Dispatch + combine bytes (and α-β seconds) per step per rank of one expert-parallel MoE layer.

    Args:
        tokens: tokens this rank routes per micro-batch (micro-batch size x sequence length), T.
        hidden: model width h.
        num_experts: E, divisible by ``ep``.
        k: experts per token.
        capacity_factor: > 0.
        ep: expert-parallel group size.
        element_nbytes: bytes per element (4 float32, 2 bf16, 1 fp8).
        alpha_s: α, seconds per message; beta_s_per_byte: β, seconds per byte (per direction).
        intra: None: every peer over (α, β); ``(ranks_per_node, α_intra, β_intra)`` when the EP group spans
            nodes: (α, β) is then the NIC's and each AllToAll :func:`two_level_all_to_all_seconds`.

    Returns:
        :class:`MoEAllToAllCost`.

    Raises:
        ValueError: a size not an int >= 1 (``tokens`` >= 0); E not divisible by ``ep``; k or the capacity factor
            out of range; α or β negative.
    """
    check_counts(hidden=hidden, ep=ep, element_nbytes=element_nbytes)
    check_ep_size(num_experts, ep)
    capacity = expert_capacity(tokens, num_experts, k, capacity_factor)
    buffer = num_experts * capacity * hidden * element_nbytes
    sent = buffer // ep * (ep - 1)
    one = (all_to_all_seconds(buffer, ep, alpha_s, beta_s_per_byte) if intra is None
           else two_level_all_to_all_seconds(buffer, ep, intra[0], intra[1], intra[2], alpha_s, beta_s_per_byte))
    useful = tokens * k / (num_experts * capacity) if capacity else 0.0
    return MoEAllToAllCost(capacity=capacity, buffer_nbytes=buffer, sent_per_alltoall_nbytes=sent,
                           forward_sent_nbytes=2 * sent, backward_sent_nbytes=2 * sent, step_sent_nbytes=4 * sent,
                           step_seconds=4 * one, useful_fraction=useful)


@dataclasses.dataclass(frozen=True)
class MoEDroplessCost:
    """What one dropless expert-parallel MoE layer moves and computes, for one micro-batch (forward + backward).

    Attributes (EP ranks; bytes of one dispatch; the combine is its transpose):
        split_nbytes: EP x EP, ``[i][j]`` bytes rank i sends rank j (its rows routed to j's experts).
        sent_nbytes, received_nbytes: per rank, off the diagonal (a rank's own rows do not move).
        step_sent_nbytes: per rank, forward + backward: ``2 · (sent + received)`` (dispatch sends ``sent``, the
            combine ``received``, and the backward the same).
        alltoall_seconds: one dispatch (or combine): ``(EP-1)·α + β · max_i max(sent_i, received_i)``, the
            busiest port; two-level (``intra``) each rank's node-local and remote bytes on their own links, the
            slower of the two, the slowest rank. With even routing :func:`commlab.collectives.all_to_all_seconds`
            (two-level: :func:`commlab.collectives.two_level_all_to_all_seconds`).
        step_seconds: four of them.
        rows_per_rank: (token, choice) rows each rank's experts process, own rows included.
        compute_slowdown: ``max / mean`` of ``rows_per_rank``: the expert GEMMs wait for the busiest rank.
        alltoall_slowdown: the busiest port's bytes over the port bytes of an even routing of the same rows
            (every rank routing the mean number of rows, ``1/EP`` of them to each rank: ``(EP-1)/EP²`` of all
            rows per port): 2.0 for ``[[0, 8], [8, 0]]``, 0.0 when every row stays local; 1.0 if no row moves
            either way (no rows, or EP = 1).
        no_drop_capacity: the capacity a padded layer would need to drop nothing here, the most rows one rank
            routes to one expert.
    """

    split_nbytes: list[list[int]]
    sent_nbytes: list[int]
    received_nbytes: list[int]
    step_sent_nbytes: list[int]
    alltoall_seconds: float
    step_seconds: float
    rows_per_rank: list[int]
    compute_slowdown: float
    alltoall_slowdown: float
    no_drop_capacity: int


class _Shape(list):
    def __repr__(self):
        return f"shape {list(self)}"


_COUNTS_ALLOWED = "an [EP][E] matrix of counts: EP rows of E ints >= 0 (lists, or an [EP, E] tensor or array)"


def _count_rows(value) -> list[list]:
    """``tokens_per_expert`` as EP lists of E entries (checked one by one by the caller); ValueError naming its
    shape otherwise."""
    if hasattr(value, "shape") and hasattr(value, "tolist"):
        if len(value.shape) != 2 or 0 in tuple(value.shape):
            checks.fail("tokens_per_expert", _Shape(value.shape), _COUNTS_ALLOWED)
        return value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        checks.fail("tokens_per_expert", _Shape([0]) if isinstance(value, (list, tuple)) else value, _COUNTS_ALLOWED)
    if not all(isinstance(r, (list, tuple)) for r in value):
        checks.fail("tokens_per_expert", _Shape([len(value)]), _COUNTS_ALLOWED)
    lengths = [len(r) for r in value]
    if not lengths[0] or len(set(lengths)) != 1:
        checks.fail("tokens_per_expert", value, _COUNTS_ALLOWED, note=f"row lengths {lengths}")
    if any(isinstance(c, (list, tuple)) or hasattr(c, "shape") and len(c.shape) for r in value for c in r):
        checks.fail("tokens_per_expert", _Shape([len(value), lengths[0], "..."]), _COUNTS_ALLOWED)
    return [list(r) for r in value]


def _two_level_seconds(split, ep, intra, alpha_s, beta_s_per_byte) -> float:
    """The slowest rank's dispatch with node-local and remote blocks on their own links, at the same time."""
    g, (_, intra_alpha, intra_beta) = min(ep, intra[0]), intra
    times = []
    for i in range(ep):
        local = [j for j in range(ep) if j != i and j // g == i // g]
        remote = [j for j in range(ep) if j // g != i // g]

        def port(peers):
            return max(sum(split[i][j] for j in peers), sum(split[j][i] for j in peers))

        times.append(max((g - 1) * intra_alpha + port(local) * intra_beta,
                         (ep - g) * alpha_s + port(remote) * beta_s_per_byte))
    return max(times)


def moe_dropless_cost(tokens_per_expert, hidden: int, element_nbytes: int, alpha_s: float = 0.0,
                      beta_s_per_byte: float = 0.0, *,
                      intra: tuple[int, float, float] | None = None) -> MoEDroplessCost:
    """Bytes, α-β seconds and load of a dropless expert-parallel MoE layer from its routing.

    Args:
        tokens_per_expert: EP rows of E ints (a list of lists, or an ``[EP, E]`` tensor): row i is rank i's
            (token, choice) pairs per expert (its :attr:`Routing.tokens_per_expert`); rank j holds experts
            ``j·E/EP .. (j+1)·E/EP - 1``.
        hidden: h. element_nbytes: bytes per element. alpha_s, beta_s_per_byte: the EP group's link.
        intra: None: every peer over (α, β); ``(ranks_per_node, α_intra, β_intra)`` when the EP group spans
            nodes (rank j on node ``j // ranks_per_node``): (α, β) is then the NIC's.

    Returns:
        :class:`MoEDroplessCost`.

    Raises:
        ValueError: ``tokens_per_expert`` not an ``[EP][E]`` matrix (the message gives its shape), a negative or
            non-integer count, E not divisible by EP, a size or rate out of range; as
            :func:`~commlab.collectives.two_level_all_to_all_seconds` for ``intra``.
    """
    rows = _count_rows(tokens_per_expert)
    check_counts(hidden=hidden, element_nbytes=element_nbytes)
    check_cost_args(0, None, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte)
    for i, row in enumerate(rows):
        for e, c in enumerate(row):
            checks.integer(f"tokens_per_expert[{i}][{e}]", c, least=0)
    ep, num_experts = len(rows), len(rows[0])
    per = check_ep_size(num_experts, ep)
    if intra is not None:   # its checks: ranks per node, rates, whole nodes
        two_level_all_to_all_seconds(0, ep, intra[0], intra[1], intra[2], alpha_s, beta_s_per_byte)
    row_nbytes = hidden * element_nbytes
    pairs = [[sum(r[j * per:(j + 1) * per]) for j in range(ep)] for r in rows]
    split = [[p * row_nbytes for p in r] for r in pairs]
    sent = [sum(split[i]) - split[i][i] for i in range(ep)]
    received = [sum(split[i][j] for i in range(ep)) - split[j][j] for j in range(ep)]
    port = max(max(s_, r_) for s_, r_ in zip(sent, received))
    one = ((ep - 1) * alpha_s + port * beta_s_per_byte if intra is None
           else _two_level_seconds(split, ep, intra, alpha_s, beta_s_per_byte))
    load = [sum(pairs[i][j] for i in range(ep)) for j in range(ep)]
    mean_load = sum(load) / ep
    even_port = (ep - 1) * sum(load) * row_nbytes / ep ** 2
    return MoEDroplessCost(split_nbytes=split, sent_nbytes=sent, received_nbytes=received,
                           step_sent_nbytes=[2 * (s_ + r_) for s_, r_ in zip(sent, received)],
                           alltoall_seconds=one, step_seconds=4 * one, rows_per_rank=load,
                           compute_slowdown=max(load) / mean_load if mean_load else 1.0,
                           alltoall_slowdown=port / even_port if even_port else 1.0,
                           no_drop_capacity=max(max(r) for r in rows))
