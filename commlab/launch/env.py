"""The cluster door of :mod:`commlab.launch`: initialise ``torch.distributed`` from what the launcher exported.

:func:`init_from_env` reads and checks torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or, under a plain ``srun``, Slurm's
(``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_NODEID``;
``MASTER_ADDR`` from the first host of the node list and ``MASTER_PORT`` from the job id unless exported), binds
``cuda:LOCAL_RANK`` under NCCL and initialises the default group with its ``timeout``. With no launcher it makes
a world of one. A missing, non-integer or out-of-range value raises :class:`LauncherEnvError` naming the
variable, its value and the allowed range, before anything connects; :func:`read_env` and
:func:`detect_launcher` only read. Under ``srun`` task 0 hosts the store, so ``MASTER_ADDR`` must be its host:
with ``--distribution=arbitrary``, or two jobs that could share a head node and port, export ``MASTER_ADDR``
and ``MASTER_PORT`` yourself. The README's cluster section shows the commands.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import re
import sys
from typing import Mapping, NoReturn

import torch
import torch.distributed as dist

__all__ = ["DistContext", "LauncherEnv", "LauncherEnvError", "init_from_env", "read_env", "detect_launcher",
           "cpu_thread_share",
           "DEFAULT_ENV_TIMEOUT_S",
           "slurm_first_host", "slurm_tasks_on_node", "slurm_default_port", "CHILD_MARKER", "BACKENDS",
           "check_timeout", "exit_process", "TIMEOUT_MARGIN_S"]

#: Seconds a rank waits for its peers, in the rendezvous and in every collective, unless ``timeout=`` says
#: otherwise. torch's own default is 30 minutes (gloo) or 10 (NCCL): that long, a crashed peer or a rank that
#: skipped a collective looks like a slow job. Under torchrun the agents have already gathered every node
#: before the workers start, so the workers' rendezvous waits for process start-up only (seconds). Pass a
#: larger ``timeout`` for a step in which one rank works alone for longer (a checkpoint written by rank 0
#: while the others wait in a collective).
DEFAULT_ENV_TIMEOUT_S = 120.0

#: Seconds the collectives of a :func:`commlab.launch.launch` outlast its deadline, so that what watches the
#: deadline (the parent of forked ranks, or a rank that finished) names the stalled ranks before a collective's
#: own timeout says only that it waited.
TIMEOUT_MARGIN_S = 2.0

#: Set by :func:`commlab.launch.launch` in every rank it forks (the value is the rank): such a process runs
#: under commlab's own launcher, whatever else its environment inherited.
CHILD_MARKER = "COMMLAB_LAUNCH_RANK"

#: The backends commlab runs on: gloo (CPU tensors) and NCCL (one GPU per rank).
BACKENDS = ("gloo", "nccl")
_DECIMAL = re.compile(r"[+-]?[0-9]+")


class LauncherEnvError(ValueError):
    """A launcher variable is missing, not an integer, or out of its allowed range (the message names it)."""


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job, as :func:`init_from_env` found it.

    Attributes:
        rank: global rank, ``0 .. world_size - 1``.
        world_size: number of processes in the job.
        local_rank: index of this process on its node, ``0 .. local_world_size - 1``; under NCCL also the
            index of its GPU.
        local_world_size: processes on this node (None where the launcher does not say).
        node_rank: index of this node, ``0 .. nodes - 1`` (None where the launcher does not say).
        backend: ``"gloo"`` or ``"nccl"``.
        device: the device this rank's tensors travel on: ``cpu`` under gloo, ``cuda:local_rank`` under NCCL.
        launcher: ``"torchrun"``, ``"slurm"`` (srun without torchrun), ``"env"`` (RANK/WORLD_SIZE exported by
            something else), ``"commlab.launch"`` (a rank forked by :func:`commlab.launch.launch`) or ``"none"``
            (no launcher: a world of one).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    node_rank: int | None
    backend: str
    device: torch.device
    launcher: str

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that prints)."""
        return self.rank == 0


# ------------------------------------------------------------------------------------------ reading

def detect_launcher(environ: Mapping[str, str] | None = None) -> str:
    """Which launcher started this process, judged from its environment alone (no process is contacted).

    Returns:
        ``"commlab.launch"`` (``COMMLAB_LAUNCH_RANK`` set: a rank forked by :func:`commlab.launch.launch`),
        ``"torchrun"`` (``TORCHELASTIC_RUN_ID`` set), ``"slurm"`` (an ``srun`` task: ``SLURM_PROCID`` with
        ``SLURM_STEP_NUM_TASKS`` or ``SLURM_STEP_ID``), ``"env"`` (``RANK`` or ``WORLD_SIZE`` set by something
        else) or ``"none"``.
    """
    env = os.environ if environ is None else environ
    if env.get(CHILD_MARKER) is not None:
        return "commlab.launch"
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        return "torchrun"
    if env.get("SLURM_PROCID") is not None and (env.get("SLURM_STEP_NUM_TASKS") is not None
                                                 or env.get("SLURM_STEP_ID") is not None):
        return "slurm"
    if env.get("RANK") is not None or env.get("WORLD_SIZE") is not None:
        return "env"
    return "none"


def _int_var(env: Mapping[str, str], name: str, low: int, high: int | None, what: str,
             default: int | None = None, hint: str = "") -> int:
    """``int(env[name])`` checked against ``low <= value <= high``; LauncherEnvError names what is wrong."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is not None:
            return default
        raise LauncherEnvError(f"{name} is not set: it must hold {what}" + (f"; {hint}" if hint else ""))
    # Decimal digits only: int() would also read "1_0" as 10 and non-ASCII digits, which no launcher writes.
    if not _DECIMAL.fullmatch(raw.strip()):
        raise LauncherEnvError(f"{name}={raw!r} is not an integer (decimal digits): it must hold {what}")
    value = int(raw.strip())
    if value < low or (high is not None and value > high):
        allowed = f"{low}..{high}" if high is not None else f">= {low}"
        raise LauncherEnvError(f"{name}={value} is out of range: {what}, allowed {allowed}"
                               + (f" ({hint})" if hint else ""))
    return value


def slurm_first_host(nodelist: str) -> str:
    """The first host of a Slurm host list, e.g. ``"gpu[007-010,12],login1"`` -> ``"gpu007"``.

    Slurm's compressed syntax: comma-separated entries, each a name with bracketed ranges (zero padding kept),
    possibly several bracket groups (``"rack[1-2]-n[01-04]"`` -> ``"rack1-n01"``). This is what
    ``scontrol show hostnames LIST | head -n 1`` prints, without needing ``scontrol``.

    Raises:
        ValueError: an empty list or unbalanced brackets.
    """
    text = (nodelist or "").strip()
    if not text:
        raise ValueError("the Slurm node list is empty")
    depth, end = 0, len(text)
    for i, ch in enumerate(text):  # the first entry ends at the first comma outside brackets
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                break
        elif ch == "," and depth == 0:
            end = i
            break
    if depth != 0:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}: unbalanced brackets")
    first = text[:end]

    def first_of_range(match: re.Match) -> str:
        return re.split(r"[,-]", match.group(1))[0]

    host = re.sub(r"\[([^\]]*)\]", first_of_range, first)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    return host


def slurm_tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """Tasks on node ``node_index`` from Slurm's ``SLURM_STEP_TASKS_PER_NODE`` syntax, e.g. ``"4(x2),3"``.

    Raises:
        ValueError: text that is not Slurm's syntax, or ``node_index`` beyond the nodes it describes.
    """
    counts: list[int] = []
    for part in (tasks_per_node or "").split(","):
        m = re.fullmatch(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot read tasks per node {tasks_per_node!r} (Slurm's syntax is e.g. '4(x2),3')")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_index < len(counts):
        raise ValueError(f"node {node_index} is not among the {len(counts)} nodes of tasks per node "
                         f"{tasks_per_node!r}")
    return counts[node_index]


def slurm_default_port(job_id: int) -> int:
    """The rendezvous port every task of Slurm job ``job_id`` derives alike: ``20000 + job_id % 10000``.

    In 20000..29999: above the well-known services and below Linux's ephemeral range (32768 and up), from
    which the kernel picks the local ports of outgoing connections. Two jobs whose ids differ by a multiple of
    10000 and share a head node would collide: export ``MASTER_PORT`` then.
    """
    return 20000 + int(job_id) % 10000


@dataclasses.dataclass(frozen=True)
class LauncherEnv:
    """What the launcher's variables say, read and checked by :func:`read_env` before anything connects.

    Attributes:
        launcher: as :func:`detect_launcher` returns.
        rank, world_size, local_rank, local_world_size, node_rank: as in :class:`DistContext` (a world of one
            for ``"none"`` and ``"commlab.launch"``, whose ranks are initialised by the launcher itself).
        exports: variables ``env://`` needs that the launcher did not set (``srun`` without torchrun:
            ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, maybe ``MASTER_ADDR``/``MASTER_PORT``).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    node_rank: int | None
    exports: Mapping[str, str] = dataclasses.field(default_factory=dict)


def read_env(environ: Mapping[str, str] | None = None) -> LauncherEnv:
    """Read and check the launcher's variables (default ``os.environ``); a pure function: nothing connects.

    Raises:
        LauncherEnvError: a variable missing, not an integer or out of range (named, with its value and the
            allowed range); MASTER_ADDR or MASTER_PORT that can be neither read nor derived (with what to
            export).
    """
    env = os.environ if environ is None else environ
    launcher = detect_launcher(env)
    if launcher in ("none", "commlab.launch"):
        return LauncherEnv(launcher, 0, 1, 0, 1, 0, {})
    if launcher == "slurm":
        return _read_slurm(env)
    hint = "torchrun sets it for every worker" if launcher == "torchrun" else ""
    world = _int_var(env, "WORLD_SIZE", 1, None, "the number of processes in the job", hint=hint)
    rank = _int_var(env, "RANK", 0, world - 1, f"this process's global rank (WORLD_SIZE={world})", hint=hint)
    local_world = None
    if env.get("LOCAL_WORLD_SIZE") is not None:
        local_world = _int_var(env, "LOCAL_WORLD_SIZE", 1, world,
                               f"the number of processes on this node (WORLD_SIZE={world})")
    local_rank = _int_var(env, "LOCAL_RANK", 0, (local_world - 1) if local_world else world - 1,
                          "this process's index on its node" +
                          (f" (LOCAL_WORLD_SIZE={local_world})" if local_world else f" (WORLD_SIZE={world})"),
                          default=0 if world == 1 else None,
                          hint=hint or "export it (0 .. processes on this node - 1)")
    node_rank = None
    if env.get("GROUP_RANK") is not None:
        nodes = -(-world // local_world) if local_world else world
        node_rank = _int_var(env, "GROUP_RANK", 0, nodes - 1, "this node's index", hint=f"{nodes} nodes")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not (env.get(name) or "").strip():
            raise LauncherEnvError(f"{name} is not set: env:// rendezvous needs the address and port of the "
                                   "process with RANK=0" + (f" ({hint})" if hint else "; export both"))
    _int_var(env, "MASTER_PORT", 1, 65535, "the TCP port of the rendezvous store")
    return LauncherEnv(launcher, rank, world, local_rank, local_world, node_rank, {})


def _read_slurm(env: Mapping[str, str]) -> LauncherEnv:
    world_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") is not None else "SLURM_NTASKS"
    world = _int_var(env, world_var, 1, None, "the number of tasks in the step", hint="run the job with srun")
    rank = _int_var(env, "SLURM_PROCID", 0, world - 1, f"this task's rank ({world_var}={world})")
    node = _int_var(env, "SLURM_NODEID", 0, world - 1, "this node's index in the job", default=0)
    local_world = None
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(var):
            try:
                local_world = slurm_tasks_on_node(env[var], node)
            except ValueError as e:
                raise LauncherEnvError(f"{var}={env[var]!r} with SLURM_NODEID={node}: {e}") from None
            break
    if local_world is None and env.get("SLURM_NTASKS_PER_NODE"):
        local_world = _int_var(env, "SLURM_NTASKS_PER_NODE", 1, world, "tasks per node")
    local_rank = _int_var(env, "SLURM_LOCALID", 0, (local_world or world) - 1,
                          "this task's index on its node", default=0 if world == 1 else None)
    export = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank)}
    if local_world is not None:
        export["LOCAL_WORLD_SIZE"] = str(local_world)
    if not (env.get("MASTER_ADDR") or "").strip():
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        try:
            export["MASTER_ADDR"] = slurm_first_host(nodelist or "")
        except ValueError as e:
            raise LauncherEnvError(
                f"MASTER_ADDR is not set and cannot be taken from Slurm's node list ({e}): export "
                "MASTER_ADDR=<host of the task with SLURM_PROCID=0>, e.g. "
                "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)") from None
    if not (env.get("MASTER_PORT") or "").strip():
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if job is None or not re.fullmatch(r"[0-9]+", job.strip()):
            raise LauncherEnvError(f"MASTER_PORT is not set and SLURM_JOB_ID={job!r} gives no port to derive "
                                   "it from: export MASTER_PORT=<a free port on the MASTER_ADDR host>")
        export["MASTER_PORT"] = str(slurm_default_port(int(job)))
    else:
        _int_var(env, "MASTER_PORT", 1, 65535, "the TCP port of the rendezvous store")
    return LauncherEnv("slurm", rank, world, local_rank, local_world, node, export)


# ----------------------------------------------------------------------------------------- initialising

def _choose_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None (NCCL when CUDA is available), "
                         f"got {backend!r}")
    return backend


def check_timeout(timeout) -> float:
    """``timeout`` as float seconds, for every ``timeout=`` of :mod:`commlab.launch`.

    Raises:
        ValueError: not a positive, finite number (a bool is not one).
    """
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    return float(timeout)


def _bind_gpu(local_rank: int, local_world: int | None) -> torch.device:
    """``torch.cuda.set_device(local_rank)``: from here on a bare ``.cuda()`` lands on this rank's GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("backend 'nccl' needs CUDA and none is available here; use backend='gloo' for CPU "
                           "processes")
    count = torch.cuda.device_count()
    if local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this node shows {count} CUDA device(s)"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
            + f": NCCL needs one GPU per process, so start at most {count} process(es) per node "
            f"(torchrun --nproc-per-node {count})"
            + (f", not {local_world}" if local_world else "")
            + ". If the scheduler gives every task its own GPU (srun --gpus-per-task), each task sees one "
            "device: run one torchrun per node instead (scripts/slurm/commlab.sbatch does)")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def _context_of_initialised(backend: str | None, env: Mapping[str, str]) -> DistContext:
    have = str(dist.get_backend())
    if backend is not None and backend not in have:
        raise RuntimeError(f"torch.distributed is already initialised with backend {have!r}, and init_from_env "
                           f"was asked for {backend!r}: call destroy_process_group() first, or ask for {have!r}")
    launcher = detect_launcher(env)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = local_world = node = None
    if launcher == "commlab.launch":  # forked ranks: one node, all of them
        local_rank, local_world, node = rank, world, 0
    elif launcher != "none":
        try:
            job = read_env(env)
            local_rank, local_world, node = job.local_rank, job.local_world_size, job.node_rank
        except LauncherEnvError:  # initialised by someone else, from other numbers: keep what the group says
            pass
    elif world == 1:
        local_rank, local_world, node = 0, 1, 0
    nccl = "nccl" in have
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if local_rank is None:
        local_rank = device.index if nccl else 0
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                       node_rank=node, backend="nccl" if nccl else have, device=device, launcher=launcher)


def _attempt_store(plan, timeout: datetime.timedelta) -> dist.Store:
    """The torchrun job's store, seen through a prefix of this attempt (``TORCHELASTIC_RESTART_COUNT``).

    Covers torch 2.13's ``env://`` under torchrun (``rendezvous._create_c10d_store``), which joins the agent's
    store without a prefix per attempt: after a restart (``--max-restarts``) the new gloo group can read the dead
    attempt's peer addresses and fail ("Gloo connectFullMesh failed ... Connection refused") or hang
    (``tests/test_launch_env.py``). The store is the agent's (``TORCHELASTIC_USE_AGENT_STORE=True``, what
    torchrun sets) or else rank 0's, as ``env://`` would do.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, plan.world_size, is_master=not agent and plan.rank == 0, timeout=timeout,
                          multi_tenant=not agent)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"commlab/attempt_{attempt}", store)


def init_from_env(backend: str | None = None, timeout: float = DEFAULT_ENV_TIMEOUT_S) -> DistContext:
    """Initialise the default process group from the launcher's environment and return where this rank is.

    Reads torchrun's or Slurm's variables (listed in the module docstring), checks them, and then:

    * under NCCL, ``torch.cuda.set_device(local_rank)`` and ``init_process_group("nccl", ..., device_id=...)``;
    * under gloo, ``init_process_group("gloo", ...)`` and at most this rank's share of the cores as compute
      threads (:func:`cpu_thread_share`);
    * the rendezvous: under torchrun the job's store, prefixed by the restart attempt (so ``--max-restarts``
      makes a fresh group); under ``srun``, ``env://`` after exporting ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
      ``LOCAL_WORLD_SIZE`` (and ``MASTER_ADDR``/``MASTER_PORT`` if unset); no launcher: a world of one;
    * once initialised (or in a rank of :func:`commlab.launch.launch`): the existing group's context, nothing new.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or None: NCCL when CUDA is available, else gloo.
        timeout: seconds for the rendezvous and every collective (default :data:`DEFAULT_ENV_TIMEOUT_S`).

    Returns:
        A :class:`DistContext`.

    Raises:
        LauncherEnvError: a launcher variable missing, not an integer or out of range, or MASTER_ADDR/PORT unknown.
        ValueError: a bad ``backend`` or ``timeout``.
        RuntimeError: NCCL without CUDA, ``LOCAL_RANK`` >= visible GPUs, or already initialised with another backend.
        torch.distributed.DistError: the rendezvous failed (e.g. a peer never came within ``timeout``).
    """
    timeout_s = check_timeout(timeout)
    if dist.is_initialized():
        return _context_of_initialised(backend, os.environ)
    chosen = _choose_backend(backend)
    plan = read_env()
    if plan.launcher == "commlab.launch":
        raise RuntimeError(f"{CHILD_MARKER} is set, so this process is a rank forked by commlab.launch, but "
                           "torch.distributed is not initialised: call init_from_env() only inside the function "
                           "that launch() runs")
    device = _bind_gpu(plan.local_rank, plan.local_world_size) if chosen == "nccl" else torch.device("cpu")
    kwargs = {"device_id": device} if chosen == "nccl" else {}
    td = datetime.timedelta(seconds=timeout_s)
    if plan.launcher == "none":
        # A world of one needs no rendezvous: an in-memory store, so no port is taken and nothing resolves
        # a host name.
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=td, **kwargs)
    elif plan.launcher == "torchrun":
        dist.init_process_group(chosen, store=_attempt_store(plan, td), rank=plan.rank,
                                world_size=plan.world_size, timeout=td, **kwargs)
    else:
        os.environ.update(plan.exports)
        dist.init_process_group(chosen, init_method="env://", timeout=td, **kwargs)
    if chosen == "gloo":
        torch.set_num_threads(cpu_thread_share(torch.get_num_threads(), plan.local_world_size))
    return DistContext(rank=plan.rank, world_size=plan.world_size, local_rank=plan.local_rank,
                       local_world_size=plan.local_world_size, node_rank=plan.node_rank, backend=chosen,
                       device=device, launcher=plan.launcher)


def cpu_thread_share(threads: int, local_world_size: int, cores: int | None = None) -> int:
    """Compute threads for one of ``local_world_size`` CPU ranks on a node: ``threads``, but at most its share
    of the ``cores`` (default: those this process may run on), and at least 1.

    Why: ranks that together run more threads than cores make every matrix multiplication wait on OpenMP
    threads the scheduler has parked (two ranks of 2 threads on 2 cores multiplied 256 x 256 matrices 50 times
    slower than with 1). torchrun sets ``OMP_NUM_THREADS=1`` for several workers only when the user did not set
    it; this keeps a larger value from oversubscribing the node.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(int(threads), cores // max(1, int(local_world_size))))


def exit_process(code: int | None) -> NoReturn:
    """End a commlab script's process (``if __name__ == "__main__": exit_process(main())``) with ``code``,
    without the interpreter's last garbage collection.

    A process that has imported torch and trained holds about a million objects, and CPython's shutdown
    collects them once more before the OS frees the memory anyway: 0.5 s to a few seconds of CPU per process,
    which 8 ranks on 2 cores wait for in turn. ``gc.freeze()`` (the ``gc`` module's documentation) moves every
    object to the permanent generation, so that collection has nothing to do; atexit handlers and module
    teardown still run. Only a file held by a reference cycle and never closed would lose its buffer.

    Raises:
        SystemExit: always, with ``code`` (None: 0).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    sys.exit(code)
