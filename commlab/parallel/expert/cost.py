"""Bytes and α-β time of expert parallelism's AllToAlls, per step and per rank.

With capacity-padded buffers (Switch Transformer, Fedus et al. 2021, §2.2 and Figure 3) every AllToAll of an
expert-parallel MoE layer moves a tensor of the same shape whatever the routing: ``[EP, E/EP, C, h]`` with
``C = ceil(capacity_factor * T * k / E)`` slots per expert for the ``T`` tokens a rank routes. Per layer and
micro-batch, each rank runs four of them:

* forward: dispatch (tokens to the experts' ranks) and combine (outputs back);
* backward: the combine's gradient (to the experts' ranks) and the dispatch's gradient (back).

Each AllToAll of ``B = E * C * h * e`` bytes per rank (``e`` bytes per element) sends ``(EP-1)/EP * B`` from
every rank (its own row stays) and costs :func:`commlab.collectives.all_to_all_seconds`
``(EP-1) α + (EP-1)/EP · B · β`` in the single-port α-β model.
"""

from __future__ import annotations

import dataclasses

from commlab.collectives import all_to_all_seconds
from commlab.collectives.common import check_counts
from commlab.parallel.expert.layers import check_ep_size
from commlab.parallel.expert.router import expert_capacity

__all__ = ["MoEAllToAllCost", "moe_alltoall_cost"]


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
                      element_nbytes: int, alpha_s: float = 0.0, beta_s_per_byte: float = 0.0) -> MoEAllToAllCost:
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
    one = all_to_all_seconds(buffer, ep, alpha_s, beta_s_per_byte)
    useful = tokens * k / (num_experts * capacity) if capacity else 0.0
    return MoEAllToAllCost(capacity=capacity, buffer_nbytes=buffer, sent_per_alltoall_nbytes=sent,
                           forward_sent_nbytes=2 * sent, backward_sent_nbytes=2 * sent, step_sent_nbytes=4 * sent,
                           step_seconds=4 * one, useful_fraction=useful)
