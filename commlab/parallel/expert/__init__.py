"""Expert parallelism: a top-k mixture-of-experts layer whose experts are spread over an EP group, tokens
dispatched to them and combined back by AllToAll (GShard, Lepikhin et al. 2020, §2.2; Switch Transformer,
Fedus et al. 2021, §2.2).

* :mod:`~commlab.parallel.expert.router` -- top-k routing with a capacity factor, as an explicit
  :class:`Routing` (computed once, reusable), dropped tokens counted per expert, load imbalance (of one
  routing, of a skewed random router, and of a whole EP group).
* :mod:`~commlab.parallel.expert.communications` -- the AllToAll and AllToAllV as autograd functions (each
  one's backward is its inverse), and a counter of the bytes they send.
* :mod:`~commlab.parallel.expert.layers` -- :class:`MoE` (single process) and :class:`ExpertParallelMoE`.
* :mod:`~commlab.parallel.expert.cost` -- dispatch + combine bytes and α-β seconds per step per rank,
  capacity-padded and dropless (an AllToAllV: the busiest rank sets the time).
* :mod:`~commlab.parallel.expert.layout` -- EP carved out of DP; DeepSeek-V3's layout as a worked example.
"""

from commlab.parallel.expert.communications import AllToAllCounter, all_to_all_autograd, all_to_all_v_autograd
from commlab.parallel.expert.cost import MoEAllToAllCost, MoEDroplessCost, moe_alltoall_cost, moe_dropless_cost
from commlab.parallel.expert.layers import ExpertParallelMoE, MoE, check_ep_size
from commlab.parallel.expert.layout import (deepseek_v3_alltoall_nbytes_per_token, deepseek_v3_figures,
                                            deepseek_v3_layout, ep_groups)
from commlab.parallel.expert.router import (EPLoad, LoadImbalance, Routing, ep_load_imbalance, expert_capacity,
                                            load_imbalance, route, skewed_load_imbalance)

__all__ = ["AllToAllCounter", "all_to_all_autograd", "all_to_all_v_autograd", "MoEAllToAllCost", "MoEDroplessCost",
           "moe_alltoall_cost", "moe_dropless_cost", "ExpertParallelMoE", "MoE",
           "check_ep_size", "deepseek_v3_alltoall_nbytes_per_token", "deepseek_v3_figures", "deepseek_v3_layout",
           "ep_groups", "EPLoad", "ep_load_imbalance", "LoadImbalance", "Routing", "expert_capacity",
           "load_imbalance", "route", "skewed_load_imbalance"]
