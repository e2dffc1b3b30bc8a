"""AllToAll and AllToAllV by pairwise exchange: block j of every rank's tensor goes to rank j, in one grouped
exchange.

:func:`all_to_all` (equal blocks: row j of an ``[N, ...]`` tensor goes to rank j) and :func:`all_to_all_v`
(MPI's ``MPI_Alltoallv``: ``input_split_sizes[j]`` rows to rank j, ``output_split_sizes[j]`` back from
it) compute what ``dist.all_to_all_single`` computes (tested against it). A rank's N-1 sends and receives
are posted as one group (:func:`commlab.collectives.p2p.exchange`, as NCCL's user guide writes an
all-to-all), in the pairwise order: at step s rank i sends to i+s and receives from i-s. Being built from
point-to-point messages, they can be delayed by an :class:`~commlab.topology.EmulatedTopology` (the
two-phase compressed AllReduce's first phase uses that). Costs: :func:`all_to_all_seconds`,
:func:`all_to_all_v_seconds` (Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1), the pairwise-exchange
Alltoall); busbw factor (n-1)/n.

Book: chapter 3, §3.10 (AllToAll and AllToAllV); chapter 13, §13.3 (expert parallelism's dispatch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import math
from typing import Sequence

from commlab import checks
from commlab.collectives import p2p
from commlab.collectives.common import as_int64, check_cost_args, global_rank, group_size_and_rank
from commlab.collectives.agreement import check_agreement
from commlab.launch.device import group_device
from commlab.topology.emulated import EmulatedTopology

__all__ = ["all_to_all", "all_to_all_v", "all_to_all_seconds", "all_to_all_v_seconds", "two_level_all_to_all_seconds",
           "pairwise_step_nbytes", "all_to_all_v_bytes_sent"]


def all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
               emulate: EmulatedTopology | None = None, check: bool = True) -> torch.Tensor:
    """Send row j of ``tensor`` to group rank j; return the rows received, row j from rank j.

    Args:
        tensor: shape ``[N, ...]`` (N = the group's size), one of the supported dtypes; the same shape and
            dtype on every rank. It is not modified.
        group: process group (None: the world).
        emulate: an :class:`~commlab.topology.EmulatedTopology` whose inter-node link delays each send that
            crosses emulated nodes.
        check: first make every rank agree on element count, dtype and first dimension (one tiny
            all-gather; every rank raises the same error). Pass False only where that is guaranteed.

    Returns:
        A new tensor of ``tensor``'s shape and dtype; row j is row (this rank) of rank j's ``tensor``.
        Row (this rank) is this rank's own row, copied.

    Raises:
        CollectiveMismatchError: the ranks' tensors differ in element count or dtype, or a first dimension is
            not N (on every rank, with ``check``; without it a wrong first dimension raises ``ValueError`` on
            the rank that passed it).
        TypeError: an unsupported dtype.
    """
    size, me = group_size_and_rank(group, "all_to_all")
    rows = tensor.shape[0] if tensor.dim() >= 1 else -1
    problem = None if rows == size else (f"all_to_all needs a tensor whose first dimension is the group size {size} "
                                         f"(one row per destination rank), got shape {list(tensor.shape)}")
    if check:
        check_agreement("all_to_all", tensor, group, (rows,), "first dimension", problem, f"the group size {size}")
    elif problem:
        raise ValueError(problem)
    inp = tensor.detach().contiguous()
    out = torch.empty_like(inp)
    _pairwise_exchange(list(inp), list(out), me, size, group, emulate)
    return out


def _pairwise_exchange(send: list[torch.Tensor], recv: list[torch.Tensor], me: int, size: int,
                       group: dist.ProcessGroup | None, emulate: EmulatedTopology | None) -> None:
    """Copy ``send[me]`` into ``recv[me]`` and swap the other blocks in one grouped exchange: ``send[j]`` goes to
    group rank j, ``recv[j]`` is filled from group rank j (contiguous blocks; empty ones are left out on both
    sides, by :func:`~commlab.collectives.p2p.exchange`)."""
    recv[me].copy_(send[me])
    if size > 1:
        steps = range(1, size)  # step s: send to me+s, receive from me-s (the pairwise schedule)
        sends = [(send[(me + s) % size], global_rank(group, (me + s) % size)) for s in steps]
        recvs = [(recv[(me - s) % size], global_rank(group, (me - s) % size)) for s in steps]
        p2p.exchange(sends, recvs, group, emulate=emulate).wait()


# The agreement check carries a fixed number of trailing dimensions (it is one all-gather of equal-length
# rows); dimensions beyond the last slot are folded into it as their product, which still catches every
# mismatch in bytes per row.
_TRAILING_SLOTS = 6


def _splits_layout(tensor: torch.Tensor, output_split_sizes, input_split_sizes, size: int,
                   out_fits: bool | None = None) -> tuple[int, ...]:
    """This rank's AllToAllV arguments as ints of a fixed length (``5 + 2N + _TRAILING_SLOTS``), for the
    agreement check: ``[len(input splits), len(output splits), rows, ndim, *input splits, *output splits,
    *trailing dims, out]`` (``out``: -1 none given, 1 it fits, 0 it does not). A split list given as None
    has length -1 and holds the equal split ``rows // N``; one that is not a sequence has length -2;
    entries that are not ints (or do not fit in int64) show as -1; missing entries pad with 0 and surplus ones
    are cut (the length says so); unused trailing slots hold -1."""
    ndim = tensor.dim()
    rows = tensor.shape[0] if ndim >= 1 else 0

    def splits(given) -> list[int]:
        if given is None:
            return [-1] + [rows // size] * size
        try:
            entries = [as_int64(v) for v in given]
        except TypeError:  # not iterable: found here, raised on every rank by the check
            return [-2] + [0] * size
        return [len(entries)] + (entries + [0] * size)[:size]

    trailing = list(tensor.shape[1:])
    if len(trailing) > _TRAILING_SLOTS:
        trailing = trailing[:_TRAILING_SLOTS - 1] + [math.prod(trailing[_TRAILING_SLOTS - 1:])]
    trailing += [-1] * (_TRAILING_SLOTS - len(trailing))
    ins, outs = splits(input_split_sizes), splits(output_split_sizes)
    return (ins[0], outs[0], rows, ndim, *ins[1:], *outs[1:], *trailing, -1 if out_fits is None else int(out_fits))


def _unpack(layout: Sequence[int], size: int):
    len_in, len_out, rows, ndim = layout[:4]
    ins, outs = list(layout[4:4 + size]), list(layout[4 + size:4 + 2 * size])
    trailing = list(layout[4 + 2 * size:4 + 2 * size + _TRAILING_SLOTS])[:max(0, min(ndim - 1, _TRAILING_SLOTS))]
    return len_in, len_out, rows, ndim, ins, outs, trailing, layout[4 + 2 * size + _TRAILING_SLOTS]


def _local_problems(rank: int, layout: Sequence[int], size: int) -> list[str]:
    """What is wrong with one rank's own AllToAllV arguments (each a sentence naming the rank)."""
    len_in, len_out, rows, ndim, ins, outs, _, out_fits = _unpack(layout, size)
    if ndim == 0:
        return [f"rank {rank} passed a 0-dimensional tensor (AllToAllV splits the first dimension; pass at least "
                "a 1-D tensor)"]
    found = []
    for what, length, entries in (("input_split_sizes", len_in, ins), ("output_split_sizes", len_out, outs)):
        if length == -2:
            found.append(f"rank {rank}'s {what} is not a sequence of ints; pass one int per rank ({size}) or None")
        elif length >= 0 and length != size:
            found.append(f"rank {rank}'s {what} has {length} entries, but needs one per rank of the group ({size})")
        elif any(v < 0 for v in entries):
            found.append(f"rank {rank}'s {what} {entries} has an entry that is negative or not an int "
                         "(entries that are not ints show as -1); every split must be an int >= 0")
        elif length < 0 and rows % size:
            found.append(f"rank {rank} passed {what}=None, which splits the first dimension ({rows} rows) "
                         f"equally, but {rows} is not divisible by the group size {size}; pass the split sizes")
    if len_in == size and all(v >= 0 for v in ins) and sum(ins) != rows:
        found.append(f"rank {rank}'s input_split_sizes {ins} sum to {sum(ins)}, but its tensor's first dimension is "
                     f"{rows}; the splits must add up to the rows of the tensor")
    if out_fits == 0 and not found:
        found.append(f"rank {rank}'s out does not fit: it must be a contiguous tensor of {sum(outs)} rows "
                     "(the sum of output_split_sizes) with the input's trailing dimensions, dtype and device")
    return found


def _splits_verdict(layouts: list[tuple[int, ...]]) -> str | None:
    """Every rank's AllToAllV arguments (group-rank order) -> the one sentence every rank raises, or None.

    Each rank's own arguments first (:func:`_local_problems`); then the ranks together: the same trailing
    dimensions everywhere, and rank i's ``input_split_sizes[j]`` equal to rank j's ``output_split_sizes[i]``
    (what i sends j is what j expects from i; both sides leave out an empty message, so a disagreement
    would otherwise hang or read the wrong bytes).
    """
    size = len(layouts)
    own = [p for r, lay in enumerate(layouts) for p in _local_problems(r, lay, size)]
    if own:
        return "; ".join(own)
    unpacked = [_unpack(lay, size) for lay in layouts]
    shapes = [(u[3], tuple(u[6])) for u in unpacked]
    if len(set(shapes)) > 1:
        who = "; ".join(f"rank {r}: {list(trailing)}" for r, (_, trailing) in enumerate(shapes))
        return (f"ranks passed rows of different shapes (the dimensions after the first: {who}); every rank's "
                "tensor must have the same trailing dimensions")
    wrong = [(i, j, unpacked[i][4][j], unpacked[j][5][i]) for i in range(size) for j in range(size)
             if unpacked[i][4][j] != unpacked[j][5][i]]
    if wrong:
        shown = "; ".join(f"rank {i} sends {sent} rows to rank {j} (its input_split_sizes[{j}]) but rank {j} expects "
                          f"{expected} from rank {i} (its output_split_sizes[{i}])"
                          for i, j, sent, expected in wrong[:6])
        more = f"; and {len(wrong) - 6} more pairs" if len(wrong) > 6 else ""
        return (f"the split sizes do not match ({shown}{more}); rank i's input_split_sizes[j] must equal rank j's "
                "output_split_sizes[i] for every pair of ranks")
    return None


def all_to_all_v(tensor: torch.Tensor, output_split_sizes: Sequence[int] | None,
                 input_split_sizes: Sequence[int] | None, group: dist.ProcessGroup | None = None, *,
                 out: torch.Tensor | None = None, emulate: EmulatedTopology | None = None,
                 check: bool = True) -> torch.Tensor:
    """AllToAllV, as ``dist.all_to_all_single`` (same argument order): send ``input_split_sizes[j]`` rows of
    ``tensor`` to group rank j; return the rows received, ``output_split_sizes[j]`` from rank j, in rank order.

    Args:
        tensor: shape ``[R, ...]``, a supported dtype, the same dtype and ``shape[1:]`` on every rank (R may
            differ, and be 0), on the group's device. Not modified.
        output_split_sizes, input_split_sizes: N ints >= 0, rows to receive from / send to each group rank
            (the inputs sum to R); None: split equally. Rank i's ``input_split_sizes[j]`` must equal rank j's
            ``output_split_sizes[i]``.
        group, out: process group (None: the world); where to receive (None: a new one), contiguous,
            ``[sum(output_split_sizes), *tensor.shape[1:]]``, ``tensor``'s dtype and device, not overlapping it.
        emulate: an :class:`~commlab.topology.EmulatedTopology` whose inter-node link delays crossing sends.
        check: first make every rank agree (one all-gather of ``17 + 2N`` int64 per rank). Without it a
            mismatch between ranks is not caught (the exchange hangs or reads the wrong bytes).

    Returns:
        ``out`` or a new tensor of that shape; rows ``sum(output_split_sizes[:j]) ...`` hold rank j's block.

    Raises:
        TypeError: some rank's dtype is not supported (with ``check``, on every rank).
        CollectiveMismatchError (a ``ValueError``): with ``check``, on every rank, naming what each passed:
            bad split lists or sums, trailing dimensions or dtypes that differ, a tensor off the group's device,
            an ``out`` that does not fit, or splits that do not match between ranks.
        ValueError: without ``check``, the mistakes a rank can see alone, on that rank.
    """
    size, me = group_size_and_rank(group, "all_to_all_v")
    device = tensor.device if tensor.numel() else group_device(group)
    layout = _splits_layout(tensor, output_split_sizes, input_split_sizes, size)
    if out is not None:
        rows_out = sum(_unpack(layout, size)[5])
        fits = (tuple(out.shape) == (rows_out, *tensor.shape[1:]) and out.dtype == tensor.dtype
                and out.is_contiguous() and out.device == device)
        layout = _splits_layout(tensor, output_split_sizes, input_split_sizes, size, fits)
    if check:
        check_agreement("all_to_all_v", tensor, group, layout, "split sizes", same_numel=False,
                        layout_verdict=_splits_verdict)
    else:
        problems = _local_problems(me, layout, size)
        if problems:
            raise ValueError("all_to_all_v: " + "; ".join(problems))
    _, _, _, _, ins, outs, _, _ = _unpack(layout, size)
    inp = tensor.detach().contiguous()
    if out is None:
        out = torch.empty((sum(outs), *inp.shape[1:]), dtype=inp.dtype, device=device)
    # Blocks along the first dimension of contiguous tensors are contiguous views.
    _pairwise_exchange(list(inp.split(ins)), list(out.detach().split(outs)), me, size, group, emulate)
    return out


def all_to_all_seconds(nbytes: float, n: int, alpha_s: float, beta_s_per_byte: float) -> float:
    """α-β time of a pairwise-exchange AllToAll of ``nbytes`` per rank (the whole ``[N, ...]`` input):
    ``(n-1)·α + (n-1)/n · nbytes · β``.

    Each rank sends n-1 blocks of ``nbytes/n`` through one port (its NIC sends one message at a time, the
    single-port model of the ring's cost functions), each paying α; its own block does not move.

    Raises:
        ValueError: as the other cost functions (:func:`commlab.collectives.common.check_cost_args`).
    """
    check_cost_args(nbytes, n, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte)
    return (n - 1) * alpha_s + (n - 1) / n * nbytes * beta_s_per_byte


def two_level_all_to_all_seconds(nbytes: float, n: int, ranks_per_node: int, intra_alpha_s: float,
                                 intra_beta_s_per_byte: float, inter_alpha_s: float,
                                 inter_beta_s_per_byte: float) -> float:
    """α-β time of an AllToAll of ``nbytes`` per rank over ``n`` ranks placed ``ranks_per_node`` to a node.

    Each rank sends ``nbytes / n`` to each peer: ``g - 1`` peers share its node (``g = min(n,
    ranks_per_node)``), ``n - g`` do not. The intra-node blocks go over the intra-node link and the others
    over the NIC at the same time (NCCL posts all of an AllToAll's sends in one group), so

    ``max((g-1)·α_intra + (g-1)/n·B·β_intra,  (n-g)·α_inter + (n-g)/n·B·β_inter)``.

    One node gives :func:`all_to_all_seconds` on the intra link; were every byte to cross
    the NIC, it would be ``(n-1)·α_inter + (n-1)/n·B·β_inter``.

    Raises:
        ValueError: ``nbytes`` or a rate negative or not finite; ``n`` or ``ranks_per_node`` not an int >= 1;
            ``n`` more than one node and not a multiple of ``ranks_per_node`` (ranks fill whole nodes).
    """
    check_cost_args(nbytes, n, intra_alpha_s=intra_alpha_s, intra_beta_s_per_byte=intra_beta_s_per_byte,
                    inter_alpha_s=inter_alpha_s, inter_beta_s_per_byte=inter_beta_s_per_byte)
    checks.integer("ranks_per_node", ranks_per_node)
    if n > ranks_per_node and n % ranks_per_node:
        raise ValueError(f"n ({n}) must be a multiple of ranks_per_node ({ranks_per_node}) when the group spans "
                         "nodes (every node holds the same number of the group's ranks)")
    g = min(n, ranks_per_node)
    intra = (g - 1) * intra_alpha_s + (g - 1) / n * nbytes * intra_beta_s_per_byte
    inter = (n - g) * inter_alpha_s + (n - g) / n * nbytes * inter_beta_s_per_byte
    return max(intra, inter)


def all_to_all_v_seconds(split_nbytes: Sequence[Sequence[float]], alpha_s: float, beta_s_per_byte: float) -> float:
    """α-β time of a pairwise-exchange AllToAllV: ``Σ_{s=1}^{N-1} (α + β · max_i split_nbytes[i][(i+s) mod N])``.

    At step s every rank i sends its block for rank i+s; the model assumes a step ends when its largest
    message has arrived (Thakur, Rabenseifner & Gropp 2005 price the schedule with equal blocks). A rank's own
    block does not move; an all-empty step still pays α. Equal blocks give :func:`all_to_all_seconds`. Since
    :func:`all_to_all_v` posts all steps as one group, this is an upper bound where the transport overlaps
    them; a lower bound is ``(N-1)·α + β · max_i max(bytes sent by i, bytes received by i)`` (one port per
    rank). Book §3.10.

    Args:
        split_nbytes: an N x N matrix (N >= 1): ``split_nbytes[i][j]`` bytes rank i sends to rank j
            (``input_split_sizes[j]`` rows times the bytes per row); the diagonal is ignored.
        alpha_s: latency per message, seconds. beta_s_per_byte: seconds per byte of one link direction.

    Returns:
        Seconds.

    Raises:
        ValueError: ``split_nbytes`` is not a non-empty square matrix, or an entry is not a finite number
            >= 0; a rate as :func:`commlab.collectives.common.check_cost_args`.
    """
    check_cost_args(0, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte)
    return sum(alpha_s + beta_s_per_byte * largest for largest in pairwise_step_nbytes(split_nbytes))


def _split_matrix(split_nbytes: Sequence[Sequence[float]]) -> list[list[float]]:
    matrix = [list(row) for row in split_nbytes]
    if not matrix or any(len(row) != len(matrix) for row in matrix):
        raise ValueError(f"split_nbytes must be a square N x N matrix (bytes rank i sends rank j), got rows of "
                         f"lengths {[len(row) for row in matrix]}")
    for row in matrix:
        for v in row:
            check_cost_args(v)
    return matrix


def pairwise_step_nbytes(split_nbytes: Sequence[Sequence[float]]) -> list[float]:
    """The largest message of each step s = 1 .. N-1 of the pairwise schedule (rank i sends to i+s mod N):
    ``[max_i split_nbytes[i][(i+s) mod N] for s in 1..N-1]``, bytes (or whatever unit the matrix is in; an
    empty list for N = 1). The step times of :func:`all_to_all_v_seconds` are ``α + β·`` these.

    Raises:
        ValueError: as :func:`all_to_all_v_seconds`.
    """
    matrix = _split_matrix(split_nbytes)
    n = len(matrix)
    return [max(matrix[i][(i + s) % n] for i in range(n)) for s in range(1, n)]


def all_to_all_v_bytes_sent(split_nbytes: Sequence[Sequence[float]]) -> list[float]:
    """What each rank sends in an AllToAllV: row i of the matrix without its diagonal entry, the block rank i
    keeps (``sum_j split_nbytes[i][j] - split_nbytes[i][i]``). What rank j receives is column j without
    its diagonal entry.

    Raises:
        ValueError: as :func:`all_to_all_v_seconds`.
    """
    matrix = _split_matrix(split_nbytes)
    return [sum(row) - row[i] for i, row in enumerate(matrix)]
