"""HSDP: ShardedDataParallel sharding inside a group of 2 and replicating across 2 such groups (a 2 x 2 DeviceMesh),
equal to DDP over all 4 gloo ranks: one job for the module."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from commlab import launch
from commlab.parallel import ShardedDataParallel
from commlab.parallel.sharded import sharded_step_nbytes

from tests.test_sharded import SHAPES, STEPS, _batches, _gap, _loss, mlp


def _hsdp(stage):
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    ref = mlp()
    ddp = DDP(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    sdp = ShardedDataParallel(mlp(), stage=stage, shard_group=shard, replicate_group=replicate)
    opt = sdp.make_optimizer(torch.optim.Adam, lr=1e-2)
    gaps, stats = [], []
    for x in _batches(rank):
        _loss(ddp(x)).backward()
        _loss(sdp(x)).backward()
        grads = _gap(sdp.full_gradients(), [p.grad for p in ref.parameters()])
        ref_opt.step()
        opt.step()
        stats.append(sdp.last_step)
        ref_opt.zero_grad()
        opt.zero_grad()
        gaps.append(max(grads, _gap(sdp.full_parameters(), [p.detach() for p in ref.parameters()])))
    return dict(gaps=gaps, stats=stats, groups=(dist.get_process_group_ranks(shard),
                                                dist.get_process_group_ranks(replicate)),
                shards=[p.detach().clone() for p in sdp.shard_parameters()])


def _job():
    return {stage: _hsdp(stage) for stage in (2, 3)}


@pytest.fixture(scope="module")
def results():
    return launch(_job, 4, timeout=120)


@pytest.mark.parametrize("stage", [2, 3])
def test_hsdp_equals_ddp_over_all_ranks(results, stage):
    for rank, r in enumerate(results):
        run = r[stage]
        assert run["groups"] == ([0, 1] if rank < 2 else [2, 3], [rank % 2, rank % 2 + 2])
        assert len(run["gaps"]) == STEPS and max(run["gaps"]) < 1e-12
        for s in run["stats"]:  # ReduceScatter in the shard group, then AllReduce of the shard across replicas
            assert (s.reduce_scatters, s.all_reduces) == (3, 3)
            # the padded dim-0 shards: 3 rows of each weight (the 5-row one padded to 6), 2 of the 4-row one
            assert s.all_reduce_nbytes == 2 * (2 - 1) / 2 * (24 + 3 + 18 + 3 + 10 + 2) * 8
            assert s.all_reduce_nbytes == sharded_step_nbytes(SHAPES, 2, stage, torch.float64, replicas=2)["all_reduce"]
    for rank in range(4):  # the replicas of a shard (ranks r and r + 2) hold the same values
        for a, b in zip(results[rank % 2][stage]["shards"], results[rank][stage]["shards"]):
            assert torch.equal(a, b)
