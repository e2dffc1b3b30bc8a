"""ShardedDataParallel used as FSDP2's fully_shard is, against fully_shard itself on 2 and 3 real gloo ranks (3:
uneven dim-0 shards, one of them empty): the same per-parameter shards, the optimizer built on the wrapped
model's own parameters, the same losses and parameters after a few steps, with and without a bf16 mixed-precision
policy; the bytes of each collective in its dtype; and the errors for bad policies and parameters."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard

from commlab import launch
from commlab.collectives import CollectiveMismatchError
from commlab.parallel import ShardedDataParallel
from commlab.parallel.sharded import MixedPrecisionPolicy, dim0_shard_rows, sharded_step_nbytes

slow = pytest.mark.slow  # seconds a test (processes on 2 and 3 ranks): not in the fast lane

STEPS = 3
WIDTHS = (8, 6, 5, 4)          # weights of 6, 5 and 4 rows: on 3 ranks 2+2+2, 2+2+1 and 2+2+0 rows
SHAPES = [(6, 8), (6,), (5, 6), (5,), (4, 5), (4,)]
POLICIES = {"fp32": (None, None), "bf16/fp32": (torch.bfloat16, torch.float32)}
#: |ours - fully_shard| allowed, on losses, shards and their gradients. Both reduce in float32 with the same layout
#: (on this machine they agree to the bit); float32: a few float32 roundings; bf16 compute: one bf16 rounding step
#: (2^-8) of a value below 1, should the two reductions round one float32 gradient differently.
TOLERANCE = {"fp32": 1e-6, "bf16/fp32": 2 ** -8}


def mlp(seed=0, frozen_first=False):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers = []
        for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
    if frozen_first:
        model[0].requires_grad_(False)
    return model


def _gap(xs, ys):
    return max([float((a - b).abs().max()) for a, b in zip(xs, ys) if a.numel()] + [0.0])


def _against_fully_shard(policy_name, stage, frozen_first=False):
    """Per step: |loss gap|, |shard gap| after the step, |shard-gradient gap|; and what the wrapped model looks
    like to a user of fully_shard."""
    rank, n = dist.get_rank(), dist.get_world_size()
    param_dtype, reduce_dtype = POLICIES[policy_name]
    ref = mlp(frozen_first=frozen_first)
    torch_policy = TorchPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in ref:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=torch_policy, reshard_after_forward=stage == 3)
    fully_shard(ref, mp_policy=torch_policy, reshard_after_forward=stage == 3)
    model = mlp(frozen_first=frozen_first)
    sdp = ShardedDataParallel(model, stage=stage, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))
    during = []   # inside unit 1's forward the module holds its unsharded parameters; the accessors do not move
    model[2].register_forward_pre_hook(lambda m, a: during.append(
        ([tuple(p.shape) for p in sdp.shard_parameters()], tuple(m.weight.shape))))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)   # built after wrapping, on the model itself
    g = torch.Generator().manual_seed(100 + rank)
    losses, shard_gaps, grad_gaps = [], [], []
    for _ in range(STEPS):
        x = torch.randn(5, WIDTHS[0], generator=g)
        ref_loss = ref(x).float().pow(2).mean()
        loss = sdp(x).float().pow(2).mean()
        ref_loss.backward()
        loss.backward()
        losses.append((float(ref_loss.detach()), float(loss.detach())))
        grad_gaps.append(_gap([p.grad for p in model.parameters() if p.requires_grad],
                              [p.grad.to_local() for p in ref.parameters() if p.requires_grad]))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        shard_gaps.append(_gap([p.detach() for p in model.parameters()],
                               [p.detach().to_local() for p in ref.parameters()]))
    full_gap = _gap(sdp.full_parameters(), [p.detach().full_tensor() for p in ref.parameters()])
    return dict(losses=losses, shard_gaps=shard_gaps, grad_gaps=grad_gaps, full_gap=full_gap,
                shapes=[tuple(p.shape) for p in model.parameters()],
                ref_shapes=[tuple(p.to_local().shape) for p in ref.parameters()],
                shard_dtypes={p.dtype for p in model.parameters()},
                compute_dtypes={p.dtype for p in sdp.unsharded_parameters()},
                is_shard=[p is s for p, s in zip(model.parameters(), sdp.shard_parameters())],
                during=during, stats=sdp.last_step, moved=_gap(sdp.full_parameters(), list(mlp().parameters())))


def _errors():
    rank = dist.get_rank()
    errors = {}

    def catch(key, fn):
        try:
            fn()
            errors[key] = None
        except (ValueError, RuntimeError) as exc:
            errors[key] = (type(exc).__name__, str(exc))

    catch("int_param_dtype", lambda: ShardedDataParallel(mlp(), mp_policy=MixedPrecisionPolicy(torch.int32)))
    catch("torch_int", lambda: ShardedDataParallel(mlp(), mp_policy=TorchPolicy(reduce_dtype=torch.int64)))
    catch("not_a_policy", lambda: ShardedDataParallel(mlp(), mp_policy="bf16"))
    catch("output_dtype", lambda: ShardedDataParallel(mlp(), mp_policy=TorchPolicy(output_dtype=torch.bfloat16)))
    scalar = nn.Sequential(nn.Linear(2, 2))
    scalar[0].register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
    catch("scalar", lambda: ShardedDataParallel(scalar))
    catch("policies_differ", lambda: ShardedDataParallel(
        mlp(), mp_policy=MixedPrecisionPolicy(torch.bfloat16 if rank == 0 else None)))
    return errors


def _job():
    out = {(p, s): _against_fully_shard(p, s) for p in POLICIES for s in (3, 2)}
    out["frozen"] = _against_fully_shard("fp32", 3, frozen_first=True)
    out["errors"] = _errors()
    return out


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    return request.param, launch(_job, request.param, timeout=180)


@slow
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("stage", [3, 2])
def test_equal_to_fully_shard_with_the_same_policy(results, policy, stage):
    """Losses, the shards after each optimizer step, their gradients and the whole model, within TOLERANCE."""
    n, per_rank = results
    tol = TOLERANCE[policy]
    for rank, r in enumerate(per_rank):
        run = r[(policy, stage)]
        assert len(run["losses"]) == STEPS
        assert max(abs(a - b) for a, b in run["losses"]) <= tol
        assert max(run["shard_gaps"]) <= tol and max(run["grad_gaps"]) <= tol and run["full_gap"] <= tol
        assert run["moved"] > 1e-2   # the steps changed the model: not the equality of two idle runs
        # the module's parameters are FSDP2's local shards: dim-0 rows, the same shapes (an empty one past the end)
        assert run["shapes"] == run["ref_shapes"]
        assert run["shapes"] == [(dim0_shard_rows(s[0], n, rank)[1], *s[1:]) for s in SHAPES]
        assert all(run["is_shard"])
        assert run["during"] == [(run["shapes"], SHAPES[2])] * STEPS
        assert run["shard_dtypes"] == {torch.float32}
        assert run["compute_dtypes"] == {POLICIES[policy][0] or torch.float32}


@slow
def test_three_ranks_shard_unevenly_and_one_is_empty(results):
    n, per_rank = results
    if n == 3:
        assert [r[("fp32", 3)]["shapes"] for r in per_rank] == [
            [(2, 8), (2,), (2, 6), (2,), (2, 5), (2,)],
            [(2, 8), (2,), (2, 6), (2,), (2, 5), (2,)],
            [(2, 8), (2,), (1, 6), (1,), (0, 5), (0,)]]


@slow
@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_allgather_moves_param_dtype_and_the_reducescatter_reduce_dtype(results, policy):
    """Bytes per rank per step as counted by the wrapper, equal to sharded_step_nbytes: under the bf16 policy the
    AllGathers move half the bytes of float32, the ReduceScatters the same."""
    n, per_rank = results
    param_dtype, reduce_dtype = POLICIES[policy]
    for stage in (3, 2):
        want = sharded_step_nbytes(SHAPES, n, stage, param_dtype or torch.float32, reduce_dtype)
        for r in per_rank:
            s = r[(policy, stage)]["stats"]
            assert (s.all_gathers, s.reduce_scatters) == (6 if stage == 3 else 3, 3)
            assert s.all_gather_nbytes == want["all_gather"] and s.reduce_scatter_nbytes == want["reduce_scatter"]
    padded = sum(n * dim0_shard_rows(s[0], n, 0)[2] * (s[1] if len(s) > 1 else 1) for s in SHAPES)
    assert padded == {2: 120, 3: 6 * 8 + 6 + 6 * 6 + 6 + 6 * 5 + 6}[n]
    bf16 = sharded_step_nbytes(SHAPES, n, 3, torch.bfloat16, torch.float32)
    fp32 = sharded_step_nbytes(SHAPES, n, 3, torch.float32)
    assert bf16["all_gather"] == fp32["all_gather"] / 2 and bf16["reduce_scatter"] == fp32["reduce_scatter"]


@slow
def test_frozen_parameters_are_sharded_and_not_reduced(results):
    """A frozen first layer (FSDP2 shards it with the rest; only the trainable ones have gradients to reduce)."""
    n, per_rank = results
    for r in per_rank:
        run = r["frozen"]
        assert max(run["shard_gaps"]) <= TOLERANCE["fp32"] and run["full_gap"] <= TOLERANCE["fp32"]
        padded_first = n * dim0_shard_rows(6, n, 0)[2] * (8 + 1)
        full = sharded_step_nbytes(SHAPES, n, 3)
        assert run["stats"].reduce_scatter_nbytes == full["reduce_scatter"] - (n - 1) / n * padded_first * 4


@slow
def test_bad_policies_and_parameters_are_named(results):
    _, per_rank = results
    for r in per_rank:
        e = r["errors"]
        assert e["int_param_dtype"] == ("ValueError", "MixedPrecisionPolicy: param_dtype must be a floating-point "
                                        "torch.dtype (torch.bfloat16, torch.float16, torch.float32, torch.float64) "
                                        "or None, got torch.int32")
        assert "reduce_dtype must be a floating-point torch.dtype" in e["torch_int"][1] and "torch.int64" in \
            e["torch_int"][1]
        assert "mp_policy must be None, a commlab.parallel.sharded.MixedPrecisionPolicy or a " \
               "torch.distributed.fsdp.MixedPrecisionPolicy" in e["not_a_policy"][1]
        assert e["not_a_policy"][1].endswith("got 'bf16'")
        assert "output_dtype=None and cast_forward_inputs=True" in e["output_dtype"][1]
        assert "parameters ['0.scale'] have no dim 0 to shard (0-dim)" in e["scalar"][1]
        assert e["policies_differ"][0] == "CollectiveMismatchError"
        assert "'mp_policy', 'bfloat16', 'None'" in e["policies_differ"][1]
    assert issubclass(CollectiveMismatchError, ValueError)


def test_policy_and_cost_model_arguments_are_checked():
    with pytest.raises(ValueError, match=r"param_dtype must be a floating-point torch.dtype .* got 'bf16'"):
        MixedPrecisionPolicy("bf16")
    with pytest.raises(ValueError, match=r"reduce_dtype must be .* got torch.int8"):
        MixedPrecisionPolicy(torch.bfloat16, torch.int8)
    assert MixedPrecisionPolicy.of(TorchPolicy(param_dtype=torch.bfloat16)) == MixedPrecisionPolicy(torch.bfloat16)
    assert MixedPrecisionPolicy.of(None) == MixedPrecisionPolicy()
    with pytest.raises(ValueError, match=r"shapes must be a tuple of sizes >= 0 with a dim 0, got \(\)"):
        sharded_step_nbytes([()], 2)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        sharded_step_nbytes(SHAPES, 0)
    with pytest.raises(ValueError, match=r"stage must be one of \[2, 3\]"):
        sharded_step_nbytes(SHAPES, 2, stage=1)
    with pytest.raises(ValueError, match="param_dtype must be a floating-point torch.dtype"):
        sharded_step_nbytes(SHAPES, 2, param_dtype=None)
    # FSDP2's rule: chunks of ceil(d0/N) rows, the last ones shorter or empty, every input padded to ceil(d0/N)
    assert [dim0_shard_rows(5, 4, r) for r in range(4)] == [(0, 2, 2), (2, 2, 2), (4, 1, 2), (5, 0, 2)]
    assert [tuple(c.shape[0] for c in torch.chunk(torch.zeros(5), 4))] == [(2, 2, 1)]
