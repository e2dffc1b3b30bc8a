"""A torchrun job whose rank 1 dies on the first attempt, after the group worked: the restarted attempt must
make a fresh group (commlab.launch.init_from_env keeps each attempt's store keys apart)."""
import os

import torch
import torch.distributed as dist

from commlab.launch import init_from_env

ctx = init_from_env(timeout=30)
t = torch.ones(1)
dist.all_reduce(t)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0 and ctx.rank == 1:
    os._exit(13)
dist.barrier()
print(f"attempt {attempt} rank {ctx.rank}: sum {t.item():g}", flush=True)
# Leave the group before exiting: a process that exits with its gloo group alive can abort in the
# group's destructor ("terminate called without an active exception", seen about once in 10 runs on a
# loaded machine) after its work is done.
dist.destroy_process_group()
