"""Every hand-written collective gives bit-for-bit the results it gave before its messages were grouped.

Routing the steps through :func:`commlab.collectives.p2p.exchange` must not change which partial sums are
added in which order. Two guards, on random (not integer-valued) data, where any change of order shows in
the last bits:

* **Recorded digests.** ``DIGESTS`` holds the SHA-256 of every output of every algorithm, rank by rank, for
  fixed inputs, as computed by the code *before* the grouped exchange (the point-to-point layer of
  ``isend``/``irecv`` calls). ``_digest_run`` is the same function then and now, so a change in any
  algorithm's summation order, chunking or rounding fails here.
* **A single-process replay of the ring.** The ring's partial sums are recomputed in one process from the
  textbook schedule (Patarasuk & Yuan 2009, §3): in ReduceScatter step s the rank at ring position p adds
  into chunk ``order[(p - s - 2) mod N]`` what its predecessor held of that chunk before the step. The
  distributed result must equal it exactly, for every dtype and ring order.
"""

import hashlib

import pytest
import torch
import torch.distributed as dist

from commlab import launch
from commlab.collectives import (chunk_bounds, hierarchical_all_reduce, make_hierarchy_groups,
                                 recursive_doubling_all_reduce, rhd_all_reduce, ring_all_gather,
                                 ring_all_reduce, ring_reduce_scatter, tree_all_reduce)

pytestmark = pytest.mark.slow  # seconds a test (processes, torchrun or training): not in the fast lane

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
COUNTS = [1, 7, 1000, 4099]
# placement[rank] = node, for the hierarchical AllReduce at each world size.
PLACEMENTS = {2: [0, 1], 3: [0, 0, 0], 4: [0, 1, 0, 1], 5: [0, 1, 2, 3, 4], 6: [0, 0, 0, 1, 1, 1],
              7: [0] * 7, 8: [0, 0, 1, 1, 2, 2, 3, 3]}


def _inputs(numel, dtype, rank):
    g = torch.Generator().manual_seed(31 * numel + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _digest_run(placement):
    """Inside each rank: one SHA-256 per algorithm over all its outputs (every dtype and count)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = make_hierarchy_groups(placement)
    reversed_ring = list(range(n))[::-1]
    algos = {
        "ring_all_reduce": lambda x: ring_all_reduce(x),
        "ring_all_reduce_reversed": lambda x: ring_all_reduce(x, ring=reversed_ring),
        "ring_reduce_scatter": lambda x: ring_reduce_scatter(x),
        "ring_all_gather": lambda x: ring_all_gather(x),
        "rhd": lambda x: rhd_all_reduce(x),
        "recursive_doubling": lambda x: recursive_doubling_all_reduce(x),
        "tree": lambda x: tree_all_reduce(x),
        "tree_root_last": lambda x: tree_all_reduce(x, root=n - 1),
        "hierarchical": lambda x: hierarchical_all_reduce(x, groups),
    }
    out = {}
    for name, fn in algos.items():
        h = hashlib.sha256()
        for dtype in DTYPES:
            for numel in COUNTS:
                y = fn(_inputs(numel, dtype, rank))
                h.update(y.contiguous().view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()[:16]
    return out


# Recorded with the point-to-point layer of isend/irecv calls, before the grouped exchange:
# DIGESTS[world_size][algorithm] = _combined(the digest of each rank, in rank order).
DIGESTS = {2: {'hierarchical': 'cc62778b32fbc2e7',
               'recursive_doubling': 'cc62778b32fbc2e7',
               'rhd': 'cc62778b32fbc2e7',
               'ring_all_gather': '2271871099a5581b',
               'ring_all_reduce': 'cc62778b32fbc2e7',
               'ring_all_reduce_reversed': 'cc62778b32fbc2e7',
               'ring_reduce_scatter': '3db589c4fef9ed1b',
               'tree': 'cc62778b32fbc2e7',
               'tree_root_last': 'cc62778b32fbc2e7'},
           3: {'hierarchical': '42b9c0cb99f19306',
               'recursive_doubling': 'ad0e71301fd9dc59',
               'rhd': 'ad0e71301fd9dc59',
               'ring_all_gather': '6fbbad8fd151f411',
               'ring_all_reduce': '42b9c0cb99f19306',
               'ring_all_reduce_reversed': '42b9c0cb99f19306',
               'ring_reduce_scatter': '8c0cb55e599eec76',
               'tree': 'ad0e71301fd9dc59',
               'tree_root_last': '25ff098d797656c9'},
           4: {'hierarchical': '0368608c8b17353d',
               'recursive_doubling': 'a5ad574451c11f72',
               'rhd': '0368608c8b17353d',
               'ring_all_gather': '5cbbcbec93097ee5',
               'ring_all_reduce': '8af9648c8484c237',
               'ring_all_reduce_reversed': 'c599fd2dab7188ea',
               'ring_reduce_scatter': '68533a1a2608aa22',
               'tree': 'a5ad574451c11f72',
               'tree_root_last': '07d241bc9ba4ffde'},
           5: {'hierarchical': 'c5a622c4352323dc',
               'recursive_doubling': 'c1d355bd76443128',
               'rhd': 'b9f6049bb82b47c0',
               'ring_all_gather': '05821ffe68607e41',
               'ring_all_reduce': 'c5a622c4352323dc',
               'ring_all_reduce_reversed': '307156d4545e6dab',
               'ring_reduce_scatter': '5806ff85c6fd163d',
               'tree': '385f9a0e8b8670e2',
               'tree_root_last': 'c103a745b2f134f6'},
           6: {'hierarchical': '201d484b273eb8b7',
               'recursive_doubling': 'aea8cc3657a05fa8',
               'rhd': '4c6695a292d314c8',
               'ring_all_gather': '8b2ab1526a58ed73',
               'ring_all_reduce': 'b559ee45052f5610',
               'ring_all_reduce_reversed': 'e00f312995c65c6d',
               'ring_reduce_scatter': 'f5e907cc67e36f11',
               'tree': 'aea8cc3657a05fa8',
               'tree_root_last': 'b289c99fd012f379'},
           7: {'hierarchical': '54a32fc2a962cf80',
               'recursive_doubling': '779bd09760d13d23',
               'rhd': '75fa117d1aca7fe1',
               'ring_all_gather': '2a634f29a89d4ba4',
               'ring_all_reduce': '54a32fc2a962cf80',
               'ring_all_reduce_reversed': 'c6f420b67d0d6112',
               'ring_reduce_scatter': '6d6c1aa875cb83df',
               'tree': '779bd09760d13d23',
               'tree_root_last': '45c4df7f4a57e418'},
           8: {'hierarchical': 'a718e4f8d7d931b0',
               'recursive_doubling': 'd30a5b667041dec5',
               'rhd': '246cbfa50afe39a1',
               'ring_all_gather': '8cc03f27e11b67a8',
               'ring_all_reduce': '63ab5ed49869e5d3',
               'ring_all_reduce_reversed': 'c52d62989514f558',
               'ring_reduce_scatter': '519999b56cd63b81',
               'tree': 'd30a5b667041dec5',
               'tree_root_last': '91aee45cbfdc0670'}}


def _combined(per_rank):
    return hashlib.sha256("".join(per_rank).encode()).hexdigest()[:16]


@pytest.mark.parametrize("world_size", sorted(PLACEMENTS))
def test_every_algorithm_gives_the_results_it_gave_before_the_grouped_exchange(world_size):
    got = launch(_digest_run, world_size, PLACEMENTS[world_size], timeout=120)
    per_algo = {name: _combined([g[name] for g in got]) for name in got[0]}
    changed = sorted(name for name in per_algo if per_algo[name] != DIGESTS[world_size].get(name))
    assert not changed, f"{world_size} ranks: these algorithms now give other bits than before: {changed}"


def _replay_ring_all_reduce(inputs, order):
    """One process: the ring AllReduce's partial sums, step by step, as every rank would compute them."""
    n = len(inputs)
    numel = inputs[0].numel()
    bounds = chunk_bounds(numel, n)
    held = [x.clone() for x in inputs]  # held[group rank] = that rank's working buffer
    rank_at = list(order)  # rank_at[position] = group rank

    def chunk(buf, c):
        a, b = bounds[c]
        return buf[a:b]

    for s in range(n - 1):  # ReduceScatter: everything sent in a step is what the sender held before it
        sent = [chunk(held[rank_at[(p - 1) % n]], order[(p - s - 2) % n]).clone() for p in range(n)]
        for p in range(n):
            chunk(held[rank_at[p]], order[(p - s - 2) % n]).add_(sent[p])
    for s in range(n - 1):  # AllGather: the complete chunks travel round, stored as they arrive
        sent = [chunk(held[rank_at[(p - 1) % n]], order[(p - s - 1) % n]).clone() for p in range(n)]
        for p in range(n):
            chunk(held[rank_at[p]], order[(p - s - 1) % n]).copy_(sent[p])
    return held


def _ring_outputs(order):
    rank = dist.get_rank()
    return [ring_all_reduce(_inputs(numel, dtype, rank), ring=order)
            for dtype in DTYPES for numel in COUNTS]


@pytest.mark.parametrize("world_size, order", [(2, None), (3, None), (4, None), (4, [2, 0, 3, 1]),
                                               (5, [4, 3, 2, 1, 0]), (7, None)])
def test_the_ring_all_reduce_equals_a_single_process_replay_of_its_schedule_bit_for_bit(world_size, order):
    ring = list(range(world_size)) if order is None else order
    got = launch(_ring_outputs, world_size, order, timeout=120)
    i = 0
    for dtype in DTYPES:
        for numel in COUNTS:
            expected = _replay_ring_all_reduce([_inputs(numel, dtype, r) for r in range(world_size)], ring)
            for r in range(world_size):
                assert torch.equal(got[r][i], expected[r]), (dtype, numel, r)
                assert got[r][i].dtype == dtype
            i += 1
