"""The package's argument checks (commlab.checks) and its one agreement helper (commlab.collectives.agree)."""

import numpy as np
import pytest
import torch.distributed as dist

from commlab import checks, launch
from commlab.collectives import CollectiveMismatchError, agree


@pytest.mark.parametrize("call, message", [
    (lambda: checks.integer("steps", 0), "steps must be an int >= 1, got 0"),
    (lambda: checks.integer("steps", True), "steps must be an int >= 1, got True"),
    (lambda: checks.integer("steps", 2.0, least=0), "steps must be an int >= 0, got 2.0"),
    (lambda: checks.integer("rank", 4, 0, 3), "rank must be an int in 0..3, got 4"),
    (lambda: checks.integer("n", 0, note="ranks", where="NcclSystem"),
     "NcclSystem: n must be an int >= 1 (ranks), got 0"),
    (lambda: checks.number("lr", 0, above=0), "lr must be a finite number > 0, got 0"),
    (lambda: checks.number("lr", float("nan"), above=0), "lr must be a finite number > 0, got nan"),
    (lambda: checks.number("x", float("inf")), "x must be a finite number, got inf"),
    (lambda: checks.number("r", 1.5, above=0, most=1), "r must be a finite number in (0, 1], got 1.5"),
    (lambda: checks.number("b", False, least=0), "b must be a finite number >= 0, got False"),
    (lambda: checks.seconds("forward_s", -1.0), "forward_s must be finite seconds >= 0, got -1.0"),
    (lambda: checks.share("overlap", 1.5), "overlap must be a share in [0, 1], got 1.5"),
    (lambda: checks.share("reserve", 1.0, one=False), "reserve must be a share in [0, 1), got 1.0"),
    (lambda: checks.flag("warm_start", 1), "warm_start must be True or False, got 1"),
    (lambda: checks.one_of("backend", "mpi", ("gloo", "nccl")), "backend must be one of ['gloo', 'nccl'], got 'mpi'"),
    (lambda: checks.one_of("stage", True, (0, 1, 2, 3)), "stage must be one of [0, 1, 2, 3], got True"),
])
def test_a_check_names_the_argument_its_value_and_the_range(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == message


def test_checks_return_the_value_and_accept_numpy_scalars():
    assert checks.integer("n", np.int64(3)) == 3 and type(checks.integer("n", np.int64(3))) is int
    assert checks.number("x", np.float32(0.5), least=0) == 0.5
    assert checks.share("s", 0) == 0.0 and checks.flag("f", False) is False
    assert checks.one_of("stage", 2, (0, 1, 2, 3)) == 2


def _agree(case):
    rank = dist.get_rank()
    try:
        if case == "same":
            return agree("demo", ("a", 3), what="settings")
        if case == "differ":
            return agree("demo", ("a", rank), what="settings")
        if case == "ints":
            return agree("demo", [7, rank], ints=True, what="sizes")
        if case == "problem":
            return agree("demo", [1], ints=True, problem="x is bad" if rank == 1 else None, rank_word="stage")
    except CollectiveMismatchError as e:
        return str(e)


def test_agree_raises_the_same_message_on_every_rank_naming_what_each_holds():
    assert launch(_agree, 2, "same", timeout=60) == [[("a", 3), ("a", 3)]] * 2
    msgs = launch(_agree, 2, "differ", timeout=60)
    assert msgs[0] == msgs[1] == "demo: ranks hold different settings (rank 0: ('a', 0); rank 1: ('a', 1))"
    msgs = launch(_agree, 2, "ints", timeout=60)
    assert msgs[0] == msgs[1] == "demo: ranks hold different sizes (rank 0: [7, 0]; rank 1: [7, 1])"
    msgs = launch(_agree, 2, "problem", timeout=60)
    assert msgs[0] == msgs[1] == "demo: stage 1: x is bad"
