"""Run by tests/test_capstone_train.py under torchrun: the capstone's train.py, whose rank R exits (code 13,
no cleanup, as a crashed process would) before step K on the job's first attempt only, so that torchrun's
``--max-restarts`` runs the job again from its newest checkpoint.

    torchrun ... -m tests.jobs.capstone_crash_job --fail-at-step K [--fail-rank R] TRAIN_FLAGS

(the checkout's root on PYTHONPATH).
"""

import argparse
import os
import sys

import torch.distributed as dist

from commlab.launch.env import exit_process, read_env
from labs.capstone import train


def crash_before(fail_step: int, fail_rank: int) -> None:
    """Make ``train.Trainer.step`` end rank ``fail_rank`` before step ``fail_step`` while
    TORCHELASTIC_RESTART_COUNT is 0."""
    run_step = train.Trainer.step

    def step_or_crash(trainer, step):
        if (step == fail_step and dist.get_rank() == fail_rank
                and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0):
            print(f"rank {fail_rank}: exiting before step {step} (--fail-at-step, a test of restarts)",
                  file=sys.stderr, flush=True)
            os._exit(13)
        return run_step(trainer, step)

    train.Trainer.step = step_or_crash


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tests/jobs/capstone_crash_job.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--fail-at-step", type=int, required=True, metavar="K", help="the step rank R does not start")
    p.add_argument("--fail-rank", type=int, default=0, metavar="R", help="the rank that exits (default 0)")
    args, train_argv = p.parse_known_args(argv)
    world = dist.get_world_size() if dist.is_initialized() else read_env().world_size
    if not 0 <= args.fail_rank < world:
        p.error(f"--fail-rank {args.fail_rank} is not a rank of this world of {world}")
    crash_before(args.fail_at_step, args.fail_rank)
    return train.main(train_argv)


if __name__ == "__main__":
    exit_process(main())
