"""Which device a group's tensors live on, and a clock that times work on that device.

Everything above :mod:`commlab.launch` asks these two questions instead of testing the backend itself, so
that the same code runs on gloo (CPU tensors, host clock) and on NCCL (``cuda:LOCAL_RANK`` tensors, CUDA
events).

* NCCL moves only CUDA tensors, and each rank must use *its* GPU: ``torch.cuda.set_device(LOCAL_RANK)``
  is done once when the process group is initialised, so "the current CUDA device" is the rank's GPU.
  A tensor created with a bare ``.cuda()`` before that lands on GPU 0 for every rank.
* CUDA kernels, NCCL collectives included, run asynchronously: ``time.perf_counter()`` around them
  measures how long the launch took, not the work. A :class:`Clock` on a CUDA device records CUDA events
  on the current stream instead (PyTorch's ``torch.cuda.Event(enable_timing=True)``), which complete when
  the GPU reaches them, and reads them only when a time is asked for.
"""

from __future__ import annotations

import time
from typing import Any, Union

import torch
import torch.distributed as dist

__all__ = ["group_device", "Clock", "Mark", "results_to_cpu", "nccl_gpu_problem"]

#: A point in time recorded by :meth:`Clock.mark`: ``time.perf_counter()`` seconds on the CPU, a recorded
#: ``torch.cuda.Event`` on a GPU.
Mark = Union[float, "torch.cuda.Event"]


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor must be on to travel through ``group``.

    Returns:
        ``cuda:<current device>`` when the group's backend is NCCL (the rank's own GPU, which the launcher
        selected with ``torch.cuda.set_device``), else ``cpu`` (gloo).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; run inside commlab.launch(...), or under "
                           "torchrun call commlab.launch.init_from_env() first")
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def results_to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it on the CPU (inside plain lists, tuples and dicts), for a rank's result.

    A CUDA tensor pickled on rank r unpickles onto GPU r in whichever process reads it (the parent of forked
    ranks, or every rank after the in-process gather), so results travel on the CPU. Containers of other
    types (named tuples, dataclasses) are passed as they are.
    """
    if isinstance(obj, torch.Tensor):
        return obj.cpu() if obj.device.type != "cpu" else obj
    if type(obj) in (list, tuple):
        return type(obj)(results_to_cpu(o) for o in obj)
    if type(obj) is dict:
        return {k: results_to_cpu(v) for k, v in obj.items()}
    return obj


def nccl_gpu_problem(ranks: int | None) -> str | None:
    """Why NCCL cannot run ``ranks`` local ranks here, one GPU each (None if it can; ``ranks`` None: one GPU is
    enough). The one check behind ``launch(backend="nccl")``, ``selftest`` and ``bench --backend nccl``, which
    raise or print it as their own error."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        return (f"--backend nccl needs CUDA GPUs and torch {torch.__version__} sees none here (CUDA "
                f"{'built in' if torch.version.cuda else 'not built in'}; NCCL moves only GPU tensors): use "
                "--backend gloo to run on CPU processes")
    if ranks is not None and visible < ranks:
        return (f"--backend nccl puts each rank on its own GPU: {ranks} ranks need {ranks} GPUs, {visible} "
                f"visible; run at most {visible} ranks, or use --backend gloo")
    return None


class Clock:
    """Timestamps of work on one device: the host clock for the CPU, CUDA events for a GPU.

    ``mark()`` is cheap and never waits: on a GPU it records an event on the current stream. Times are
    read with :meth:`seconds` (since the clock was made) or :meth:`elapsed` (between two marks); on a GPU
    that waits for the events, so read them after the work of interest, not inside it.

    Args:
        device: where the timed work runs (a ``torch.device`` or its name); default: the CPU.

    Attributes:
        device: the device. on_gpu: whether marks are CUDA events.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device("cpu" if device is None else device)
        self.on_gpu = self.device.type == "cuda"
        self._origin = self.mark()

    def mark(self) -> Mark:
        """Record the current point of the device's work (the host's time on the CPU)."""
        if self.on_gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed(self, start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end`` (both made by this clock)."""
        if self.on_gpu:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def seconds(self, mark: Mark) -> float:
        """Seconds from the clock's creation to ``mark``."""
        return self.elapsed(self._origin, mark)
