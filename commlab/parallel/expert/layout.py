"""How expert parallelism is carved out of data parallelism, and DeepSeek-V3's layout as a worked example.

An MoE transformer has two kinds of layers on the same GPUs. The attention (and every dense part: embeddings,
norms, the shared expert, the router) is *data parallel*: replicated on ``dp`` ranks, each with its own tokens,
gradients all-reduced. The routed experts are *expert parallel*: the ``dp`` ranks are cut into ``dp / ep``
groups of ``ep`` consecutive ranks; inside a group, each rank holds ``E / ep`` experts and the tokens travel to
them by AllToAll (:mod:`commlab.parallel.expert.layers`). Rank ``i`` of every EP group holds the same experts,
so each expert has ``dp / ep`` replicas, one per EP group: the ranks holding them form an *expert-data-parallel*
group (strided: ``i, i + ep, i + 2 ep, ...``) whose members all-reduce that expert's gradients. No GPU is
added: EP ranks are a subset of the DP ranks, and every GPU is in one DP group, one EP group and one
expert-DP group. (Megatron-Core and DeepSpeed-MoE call the last one the expert-data-parallel group.)

DeepSeek-V3 (arXiv:2412.19437): the figures are in ``commlab/data/deepseek_v3.json``, each with its section; this
module derives the rest and marks what it derived.
"""

from __future__ import annotations

from pathlib import Path

from commlab import data
from commlab.collectives.common import check_counts
from commlab.parallel.expert.layers import check_ep_size

__all__ = ["ep_groups", "DEEPSEEK_V3_PATH", "deepseek_v3_figures", "deepseek_v3_layout",
           "deepseek_v3_alltoall_nbytes_per_token"]

DEEPSEEK_V3_PATH = data.path("deepseek_v3.json")


def ep_groups(dp: int, ep: int) -> dict[str, list[list[int]]]:
    """The EP groups and the expert-data-parallel groups of ``dp`` data-parallel ranks (their DP ranks 0..dp-1).

    Returns:
        ``{"ep": [[0..ep-1], [ep..2ep-1], ...], "expert_dp": [[0, ep, 2ep, ...], [1, ep+1, ...], ...]}``:
        ``dp / ep`` EP groups of consecutive ranks (inside a node first, when ranks are numbered node by node),
        and ``ep`` expert-DP groups of ``dp / ep`` ranks each.

    Raises:
        ValueError: ``dp`` or ``ep`` not an int >= 1, or ``dp`` not divisible by ``ep`` (an EP group is made of DP
            ranks, so ``ep`` must divide ``dp``).
    """
    check_counts(dp=dp, ep=ep)
    if dp % ep:
        raise ValueError(f"the data-parallel size ({dp}) must be divisible by the expert-parallel size ({ep}): EP "
                         f"groups are cut out of the DP ranks, {ep} at a time")
    return {"ep": [list(range(g * ep, (g + 1) * ep)) for g in range(dp // ep)],
            "expert_dp": [list(range(i, dp, ep)) for i in range(ep)]}


def deepseek_v3_figures(path: str | Path | None = None) -> dict:
    """DeepSeek-V3's published figures, ``{name: value}``, from ``commlab/data/deepseek_v3.json`` (each entry there
    gives its section of arXiv:2412.19437 and the sentence it comes from)."""
    table = data.load_table(path, "deepseek_v3.json")
    return {name: entry["value"] for name, entry in table["figures"].items()}


def deepseek_v3_layout(path: str | Path | None = None) -> dict:
    """DeepSeek-V3's training layout: the published figures and what follows from them.

    Derived (not stated in the report): ``gpus_per_stage = gpus / pp`` (no TP, so these are the data-parallel
    ranks of the attention and dense layers: ``dp``), ``ep_groups_per_stage = dp / ep`` (so every routed expert
    has that many replicas: the expert-DP size), ``experts_per_gpu = routed_experts / ep``, ``nodes_per_stage``,
    ``moe_layers = layers - dense_layers``, and ``tokens_per_step = global_batch_sequences * sequence_length``,
    ``tokens_per_gpu_per_step = tokens_per_step / dp``.

    Raises:
        ValueError: the figures are inconsistent (``ep`` GPUs do not fill ``ep_nodes`` nodes, or do not divide
            the stage), which would mean the data file was edited wrongly.
    """
    f = deepseek_v3_figures(path)
    if f["ep"] != f["ep_nodes"] * f["gpus_per_node"]:
        raise ValueError(f"EP {f['ep']} is not {f['ep_nodes']} nodes x {f['gpus_per_node']} GPUs; check the data file")
    dp = f["gpus"] // (f["pp"] * f["tp"])
    groups = ep_groups(dp, f["ep"])
    tokens = f["global_batch_sequences"] * f["sequence_length"]
    return {**f, "dp": dp, "gpus_per_stage": dp, "nodes_per_stage": dp // f["gpus_per_node"],
            "ep_groups_per_stage": len(groups["ep"]), "expert_dp": len(groups["expert_dp"][0]),
            "experts_per_gpu": check_ep_size(f["routed_experts"], f["ep"]),
            "moe_layers": f["layers"] - f["dense_layers"], "tokens_per_step": tokens,
            "tokens_per_gpu_per_step": tokens // dp}


def deepseek_v3_alltoall_nbytes_per_token(path: str | Path | None = None) -> dict:
    """All-to-all bytes one token causes in one DeepSeek-V3 MoE layer, forward and backward, from the figures.

    Model (each line from the report's text, §3.2.2 and §3.3.3): dispatch carries the token's ``hidden``
    activations in FP8 (1 byte each) to each of its ``top_k`` routed experts; over InfiniBand it goes once per
    target node (it is then forwarded inside the node over NVLink), to at most ``max_nodes_per_token`` nodes.
    Combine returns ``top_k`` expert outputs in BF16 (2 bytes), accumulated inside each node before crossing IB,
    so again at most one per node crosses IB. The backward pass repeats both with the same formats (the
    gradient before the down-projection goes out in FP8, the backward combine stays in BF16). Left out: the
    FP8 scale factors (one per 128 channels; their size is not in the report), and the shared expert (no
    communication: it runs where the token is).

    Returns:
        ``{"dispatch_nbytes", "combine_nbytes", "dispatch_ib_max_nbytes", "combine_ib_max_nbytes",
        "forward_nbytes", "forward_ib_max_nbytes", "step_nbytes", "step_ib_max_nbytes"}``: bytes delivered
        to or from experts per token per MoE layer (each of the ``top_k`` copies counted; a copy whose expert
        is on the token's own GPU does not move, so this is an upper bound too), and the most of it that
        crosses IB. ``step`` = forward + backward.
    """
    f = deepseek_v3_figures(path)
    h, k, m = f["hidden"], f["top_k"], f["max_nodes_per_token"]
    dispatch, combine = k * h * f["dispatch_element_nbytes"], k * h * f["combine_element_nbytes"]
    dispatch_ib, combine_ib = m * h * f["dispatch_element_nbytes"], m * h * f["combine_element_nbytes"]
    return {"dispatch_nbytes": dispatch, "combine_nbytes": combine, "dispatch_ib_max_nbytes": dispatch_ib,
            "combine_ib_max_nbytes": combine_ib, "forward_nbytes": dispatch + combine,
            "forward_ib_max_nbytes": dispatch_ib + combine_ib, "step_nbytes": 2 * (dispatch + combine),
            "step_ib_max_nbytes": 2 * (dispatch_ib + combine_ib)}
