"""Data parallelism with gradient buckets whose AllReduce overlaps the backward pass, built from primitives.

This is what ``torch.nn.parallel.DistributedDataParallel`` (DDP) does for the gradients, written in Python so
that each step can be read (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", PVLDB 13(12); see its design sections on gradient bucketing, overlapping computation with
communication and gradient accumulation; PyTorch's ``torch/nn/parallel/distributed.py`` and
``torch/csrc/distributed/c10d/reducer.cpp`` are the implementation it mirrors):

1. **Buckets.** At construction the parameters that require a gradient are grouped, in *reverse*
   registration order, into buckets of at least ``bucket_cap_bytes`` (a bucket is closed as soon as it holds
   that many bytes, so it may exceed the cap by its last parameter; a parameter is never split). Backward
   produces gradients roughly from the last layer to the first, so the first bucket fills first. Each bucket
   owns one flat buffer.
2. **Ready marks.** ``Tensor.register_post_accumulate_grad_hook`` runs after a parameter's ``.grad`` has been
   accumulated for this backward; the hook copies the gradient into its bucket's buffer (scaled by 1/N,
   as DDP does when no comm hook is registered) and counts the bucket down.
3. **Launch in bucket order.** When bucket ``i`` is full *and every bucket before it has been launched*, its
   AllReduce is launched asynchronously (``dist.all_reduce(buf, async_op=True)``), or, with a comm hook,
   ``hook(state, bucket)`` is called and returns a future. Launching strictly in index order is what makes
   every rank issue the same collectives in the same order even when gradients arrive in a different order
   on different ranks; gloo and NCCL match collectives by their order, so anything else can pair one rank's
   bucket 3 with another's bucket 4 (DDP's reducer does the same, ``next_bucket_``).
4. **Wait, then write back.** :meth:`BucketedDataParallel.finish` waits for *every* future, then copies
   each bucket's averaged buffer back into the parameters' ``.grad``. By default it runs as an autograd
   engine callback queued by the first ready mark of the backward (``queue_callback``, as DDP's reducer
   does), so that ``loss.backward()`` returns with averaged gradients and code that reads them right after
   (``clip_grad_norm_``, the optimizer) is correct without a second call. ``finish()`` is public and
   idempotent; :func:`train_step` calls it again before ``optimizer.step()``, where it costs nothing.

What the source article's ``CommunicationEfficientTrainer`` (§5.3) does instead: it launches
``dist.all_reduce(grad, async_op=True)`` from a per-tensor hook and drops the handle, so nothing waits before
clipping and the optimizer step read the gradients (they read whatever the reduction has or has not written
yet), and it all-reduces the dict that ``compress`` returns, which ``all_reduce`` rejects.

Policies (each tested in ``tests/test_overlap.py``):

* **Unused parameters.** A parameter that receives no gradient in a synced backward never marks its bucket
  ready. ``finish`` then fills its slot with zeros and launches the remaining buckets in order, so every rank
  still issues the same collectives and no peer is left inside one. With ``find_unused_parameters=False``
  (the default, as DDP) it then raises :class:`UnusedParametersError` naming the parameters; with ``True``
  it all-reduces a small "used here" count (one extra collective per step, as DDP's flag costs) and, like
  DDP, gives a parameter used on some ranks the average of their gradients and leaves a parameter used on no
  rank untouched. Unlike DDP, buckets behind the unused parameter's are launched only at ``finish``, not
  during backward (DDP searches the autograd graph after forward to mark them ready early).
* **NaN / Inf.** Propagated, as DDP does: a non-finite gradient on one rank makes that entry non-finite on
  every rank after the AllReduce, so every rank sees the same thing and AMP's ``GradScaler`` can skip the
  step everywhere. A comm hook may choose otherwise (``commlab.compress.compression_hook`` raises on every
  rank).
* **Layout agreement.** The constructor all-gathers every rank's parameter names, shapes and dtypes and
  ``bucket_cap_bytes`` (one ``all_gather_object``) and raises the same :class:`LayoutMismatchError` on every
  rank if they differ: a mismatch would otherwise hang or pair buffers of different sizes.
* **No sync.** Inside :meth:`BucketedDataParallel.no_sync` a forward/backward only accumulates into
  ``.grad``; the next synced backward all-reduces the accumulated sum (DDP's ``no_sync``; like DDP, the
  decision is taken at forward time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.profiler import record_function

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "assign_buckets", "BucketSpec", "Bucket", "BucketTiming", "StepRecord",
           "BucketedDataParallel", "UnusedParametersError", "LayoutMismatchError", "train_step", "StepTimes"]

#: DDP's default bucket cap: 25 MiB (``bucket_cap_mb=25``).
DEFAULT_BUCKET_CAP_BYTES = 25 * 2 ** 20

#: Names of the ``record_function`` ranges, read back by :mod:`commlab.overlap.profile`.
RANGE_FORWARD = "overlap::forward"
RANGE_BACKWARD = "overlap::backward"
RANGE_WAIT = "overlap::wait"
RANGE_OPTIMIZER = "overlap::optimizer"
RANGE_LAUNCH = "overlap::launch::bucket"   # + index: the hook or all_reduce call, on the autograd thread
RANGE_DONE = "overlap::done::bucket"       # + index: an instant marker in the future's done-callback
RANGE_READY = "overlap::ready::bucket"     # + index: an instant marker when the bucket's last gradient arrived


class UnusedParametersError(RuntimeError):
    """A synced backward produced no gradient for some parameters (``find_unused_parameters=False``).

    Attributes:
        names: the parameters, by their name in the wrapped module.
    """

    def __init__(self, names: Sequence[str], rank: int):
        self.names = list(names)
        shown = ", ".join(self.names[:8]) + (f", ... ({len(self.names)} in all)" if len(self.names) > 8 else "")
        super().__init__(
            f"rank {rank}: backward produced no gradient for {len(self.names)} parameter(s): {shown}. Their buckets "
            "were all-reduced with zeros so that no peer waits, but this step's gradients are not what the model "
            "computes. Use every parameter in forward, set requires_grad=False on the ones you do not train, or "
            "pass find_unused_parameters=True")


class LayoutMismatchError(ValueError):
    """Ranks built the wrapper with different parameters or bucket caps (raised on every rank alike)."""


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    """One bucket's layout.

    Attributes:
        index: position in launch order (0 = first to fill in backward).
        names: the parameters, in buffer order (reverse registration order).
        numels: element counts, in the same order.
        nbytes: bytes of the flat buffer (sum of the parameters' bytes).
        dtype: the buffer's dtype (one per bucket).
    """

    index: int
    names: tuple[str, ...]
    numels: tuple[int, ...]
    nbytes: int
    dtype: torch.dtype


@dataclasses.dataclass
class BucketTiming:
    """When a bucket moved in one synced step, in ``time.perf_counter()`` seconds of this rank.

    Attributes:
        index: bucket index. nbytes: buffer bytes.
        ready_s: its last gradient was copied in. launch_s / launched_s: the launch call started / returned
            (a comm hook may do work, and even wait, inside it). done_s: its future completed (None until then).
    """

    index: int
    nbytes: int
    ready_s: float | None = None
    launch_s: float | None = None
    launched_s: float | None = None
    done_s: float | None = None


@dataclasses.dataclass
class StepRecord:
    """One synced backward on this rank (``time.perf_counter()`` seconds).

    Attributes:
        first_grad_s: the first gradient became ready. last_grad_s: the last one did (backward compute over).
        wait_start_s / wait_end_s: :meth:`BucketedDataParallel.finish` started / returned.
        buckets: one :class:`BucketTiming` per bucket, by index.
    """

    buckets: list[BucketTiming]
    first_grad_s: float | None = None
    last_grad_s: float | None = None
    wait_start_s: float | None = None
    wait_end_s: float | None = None


def assign_buckets(sizes_bytes: Sequence[int], bucket_cap_bytes: int,
                   keys: Sequence[Any] | None = None) -> list[list[int]]:
    """Group tensors, taken in the given order, into buckets of at least ``bucket_cap_bytes``.

    A bucket is closed as soon as it holds ``>= bucket_cap_bytes`` bytes, so a tensor larger than the cap gets
    a bucket of its own and no tensor is split; tensors with different ``keys`` (dtype, device) never share a
    bucket, each key filling its own open bucket. Buckets are returned in the order of their first tensor.
    This is ``torch.distributed._compute_bucket_assignment_by_size`` with one size limit (tested against it);
    pass the parameters in *reverse* registration order to get DDP's buckets.

    Args:
        sizes_bytes: bytes of each tensor.
        bucket_cap_bytes: the cap, in bytes, an int >= 1.
        keys: one hashable per tensor (default: all the same).

    Returns:
        Lists of positions into ``sizes_bytes``.

    Raises:
        ValueError: a bad cap or size, or ``keys`` of the wrong length.
    """
    _check_cap(bucket_cap_bytes)
    if keys is None:
        keys = [None] * len(sizes_bytes)
    if len(keys) != len(sizes_bytes):
        raise ValueError(f"keys has {len(keys)} entries for {len(sizes_bytes)} tensors")
    open_: dict[Any, tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for i, (nbytes, key) in enumerate(zip(sizes_bytes, keys)):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"sizes_bytes[{i}] must be an int >= 0, got {nbytes!r}")
        members, total = open_.get(key, ([], 0))
        members.append(i)
        total += nbytes
        if total >= bucket_cap_bytes:
            done.append(members)
            open_.pop(key, None)
        else:
            open_[key] = (members, total)
    done.extend(members for members, _ in open_.values())
    return sorted(done, key=lambda b: b[0])


def _check_cap(bucket_cap_bytes) -> None:
    if isinstance(bucket_cap_bytes, bool) or not isinstance(bucket_cap_bytes, int) or bucket_cap_bytes < 1:
        raise ValueError(f"bucket_cap_bytes must be an int >= 1 (bytes; DDP's default is 25 MiB = {DEFAULT_BUCKET_CAP_BYTES}, "
                         f"one bucket for everything is e.g. 2**62), got {bucket_cap_bytes!r}")


class Bucket:
    """What a comm hook receives: the duck type of ``torch.distributed.GradBucket``.

    ``buffer()`` is the flat gradient buffer (1-D, the bucket's dtype, ``sum(numels)`` elements) holding this
    rank's *un-divided* gradients, as DDP hands them to a hook; ``gradients()`` are views of it shaped like
    ``parameters()``; ``index()`` is the bucket's position; ``is_last()`` is True for the last bucket of a step.
    The hook returns a ``torch.futures.Future`` whose value is the averaged buffer (a tensor of the buffer's
    shape, or a list holding one).
    """

    __slots__ = ("_buffer", "_index", "_last", "_params", "_views")

    def __init__(self, buffer: torch.Tensor, index: int, last: bool, params: list[nn.Parameter],
                 views: list[torch.Tensor]):
        self._buffer, self._index, self._last, self._params, self._views = buffer, index, last, params, views

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._views)


class _State:
    """Per-step bookkeeping (reset at every synced forward)."""

    def __init__(self, n_params: int, n_buckets: int, sizes: list[int], nbytes: list[int]):
        self.ready = [False] * n_params
        self.pending = list(sizes)          # gradients still missing, per bucket
        self.next_to_launch = 0
        self.futures: list[torch.futures.Future | None] = [None] * n_buckets
        self.started = False                # a gradient of this step arrived
        self.finished = False
        self.callback_queued = False
        self.record = StepRecord([BucketTiming(i, nbytes[i]) for i in range(n_buckets)])


class BucketedDataParallel(nn.Module):
    """Wrap ``module`` so that its gradients are averaged over ``process_group`` in overlapped buckets.

    Forward is the module's own; backward fills buckets and launches their AllReduces while it still runs;
    :meth:`finish` (run automatically at the end of backward unless ``finish_in_backward=False``) waits for
    them and writes the averages into ``p.grad``.

    Args:
        module: the model replica. Its parameters (and buffers) are broadcast from the group's rank 0 at
            construction (``broadcast_from_rank0``), as DDP does, so replicas start identical.
        bucket_cap_bytes: bucket size in bytes (default 25 MiB, DDP's); ``1`` gives one bucket per
            parameter, anything >= the model's gradient bytes one bucket for all.
        process_group: the group to average over (None: the world).
        find_unused_parameters: see the module docstring (default False: raise :class:`UnusedParametersError`).
        finish_in_backward: queue :meth:`finish` as an autograd engine callback so that ``backward()`` returns
            with averaged gradients (default True, as DDP). False: the caller must call :meth:`finish` before
            reading gradients; :func:`train_step` does.
        broadcast_from_rank0: broadcast parameters and buffers at construction (default True).

    Attributes:
        buckets: one :class:`BucketSpec` per bucket, in launch order.
        last_step: the :class:`StepRecord` of the latest synced backward (None before the first).

    Raises:
        ValueError: a bad ``bucket_cap_bytes``; no parameter requires a gradient; parameters that share
            storage with each other are fine, but sparse parameters are refused.
        LayoutMismatchError: ranks disagree on parameter names/shapes/dtypes or on ``bucket_cap_bytes``
            (every rank raises it).
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(self, module: nn.Module, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 process_group: dist.ProcessGroup | None = None, find_unused_parameters: bool = False,
                 finish_in_backward: bool = True, broadcast_from_rank0: bool = True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        _check_cap(bucket_cap_bytes)
        for name, flag in (("find_unused_parameters", find_unused_parameters),
                           ("finish_in_backward", finish_in_backward), ("broadcast_from_rank0", broadcast_from_rank0)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; run inside commlab.launch(...) or call "
                               "dist.init_process_group first")
        self.module = module
        self.process_group = process_group
        self.bucket_cap_bytes = bucket_cap_bytes
        self.find_unused_parameters = find_unused_parameters
        self.finish_in_backward = finish_in_backward
        self._group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self._group)
        self.rank = dist.get_rank(self._group)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameter with requires_grad=True: nothing to average")
        sparse = [n for n, p in named if p.is_sparse]
        if sparse:
            raise ValueError(f"sparse parameters are not supported (got {sparse}); bucket buffers are dense")
        self._agree_layout(named)
        if broadcast_from_rank0 and self.world_size > 1:
            self._broadcast_state()

        order = list(reversed(range(len(named))))  # reverse registration: about the order backward produces them
        sizes = [named[i][1].numel() * named[i][1].element_size() for i in order]
        keys = [(named[i][1].dtype, named[i][1].device) for i in order]
        groups = assign_buckets(sizes, bucket_cap_bytes, keys)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._where: list[tuple[int, int]] = [(-1, -1)] * len(named)   # param -> (bucket, position in bucket)
        self._bucket_bufs: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] = []
        self._members: list[list[int]] = []
        self.buckets: list[BucketSpec] = []
        for b, positions in enumerate(groups):
            members = [order[pos] for pos in positions]
            dtype, device = self._params[members[0]].dtype, self._params[members[0]].device
            buf = torch.zeros(sum(self._params[k].numel() for k in members), dtype=dtype, device=device)
            views, off = [], 0
            for j, k in enumerate(members):
                n = self._params[k].numel()
                views.append(buf[off:off + n].view(self._params[k].shape))
                self._where[k] = (b, j)
                off += n
            self._bucket_bufs.append(buf)
            self._views.append(views)
            self._members.append(members)
            self.buckets.append(BucketSpec(b, tuple(self._names[k] for k in members),
                                           tuple(self._params[k].numel() for k in members),
                                           buf.numel() * buf.element_size(), dtype))
        self._hook: Callable | None = None
        self._hook_state: Any = None
        self._require_sync = True
        self._sync_this_backward = True
        self._state: _State | None = None
        self._lock = threading.Lock()  # done-callbacks run on gloo's threads
        self.last_step: StepRecord | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._make_ready_hook(k))
                         for k, p in enumerate(self._params)]

    # ---- construction helpers -------------------------------------------------------------------------

    def _agree_layout(self, named) -> None:
        """One all_gather_object of (names, shapes, dtypes, cap); every rank raises the same error on a mismatch."""
        mine = ([(n, tuple(p.shape), str(p.dtype).replace("torch.", "")) for n, p in named], self.bucket_cap_bytes)
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self._group)
        ref_params, ref_cap = everyone[0]
        problems = []
        for r, (params, cap) in enumerate(everyone[1:], start=1):
            if cap != ref_cap:
                problems.append(f"rank {r} has bucket_cap_bytes={cap}, rank 0 has {ref_cap}")
            if params != ref_params:
                if len(params) != len(ref_params):
                    problems.append(f"rank {r} has {len(params)} parameters requiring grad, rank 0 has {len(ref_params)}")
                for (n0, s0, d0), (n1, s1, d1) in zip(ref_params, params):
                    if (n0, s0, d0) != (n1, s1, d1):
                        problems.append(f"rank {r} has {n1} {list(s1)} {d1} where rank 0 has {n0} {list(s0)} {d0}")
                        break
        if problems:
            raise LayoutMismatchError("BucketedDataParallel: ranks built different layouts (" + "; ".join(problems) +
                                      "). Every rank must wrap the same model with the same bucket_cap_bytes; "
                                      "their buckets would otherwise pair buffers of different sizes or hang")

    def _broadcast_state(self) -> None:
        src = dist.get_global_rank(self._group, 0) if self._group is not dist.group.WORLD else 0
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, src=src, group=self._group)

    # ---- public API -----------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._state is not None and self._state.started and not self._state.finished:
            raise RuntimeError("the previous synced backward's buckets were never waited for: call finish() "
                               "(or train_step) before the next forward")
        # Like DDP, whether this iteration synchronises is decided at forward time.
        self._sync_this_backward = self._require_sync
        if self._sync_this_backward:
            self._state = _State(len(self._params), len(self.buckets), [len(m) for m in self._members],
                                 [s.nbytes for s in self.buckets])
        with record_function(RANGE_FORWARD):
            return self.module(*args, **kwargs)

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Use ``hook(state, bucket) -> Future`` instead of the AllReduce (DDP's interface; see :class:`Bucket`).

        Raises:
            ValueError: ``hook`` is not callable, or a hook is already registered (as DDP refuses a second).
        """
        if not callable(hook):
            raise ValueError(f"hook must be callable, got {type(hook).__name__}")
        if self._hook is not None:
            raise ValueError("a comm hook is already registered; register it once, before training")
        self._hook, self._hook_state = hook, state

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward/backward passes started inside accumulate into ``.grad`` without communicating.

        The next forward outside the context starts a synced step whose backward all-reduces the accumulated
        sum, as DDP's ``no_sync``.
        """
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    def pending(self) -> int:
        """Buckets launched in the current step whose future has not been waited for by :meth:`finish`."""
        st = self._state
        if st is None or st.finished:
            return 0
        return sum(f is not None for f in st.futures)

    def finish(self) -> None:
        """Wait for every bucket of the current synced backward and write the averages into ``p.grad``.

        Buckets not yet launched (some gradient never arrived) are launched first with zeros in the missing
        slots, in order, so that every rank issues the same collectives. Idempotent: a second call, or a call
        with no synced backward since the last, does nothing.

        Raises:
            UnusedParametersError: some parameters got no gradient and ``find_unused_parameters`` is False
                (after every collective has completed).
            Whatever a bucket's future raised (a comm hook's error, a failed collective).
        """
        st = self._state
        if st is None or st.finished or not st.started:
            return
        with record_function(RANGE_WAIT):
            st.record.wait_start_s = time.perf_counter()
            missing = [k for k, r in enumerate(st.ready) if not r]
            for k in missing:  # zero contribution, then launch what became launchable, in order
                b, j = self._where[k]
                self._views[b][j].zero_()
                st.ready[k] = True
                st.pending[b] -= 1
                if st.pending[b] == 0:
                    self._mark_bucket_ready(b, time.perf_counter())
            if missing:
                self._launch_ready()
            try:
                for b, fut in enumerate(st.futures):
                    value = fut.wait()
                    if isinstance(value, (list, tuple)):
                        value = value[0]
                    buf = self._bucket_bufs[b]
                    if not isinstance(value, torch.Tensor) or value.numel() != buf.numel():
                        raise ValueError(f"the comm hook's future for bucket {b} yielded "
                                         f"{type(value).__name__ if not isinstance(value, torch.Tensor) else list(value.shape)}; "
                                         f"it must yield the averaged buffer ({buf.numel()} elements)")
                    self._on_done(b, st.record.buckets[b])  # no-op if its callback already ran
                    if value.data_ptr() != buf.data_ptr():
                        buf.copy_(value.reshape(buf.shape))
                    st.futures[b] = None  # waited: no pending handle left behind
            finally:
                st.finished = True
            globally_unused: set[int] = set()
            if self.find_unused_parameters:
                missing_set = set(missing)
                used = torch.tensor([0 if k in missing_set else 1 for k in range(len(self._params))],
                                    dtype=torch.int32, device=self._bucket_bufs[0].device)
                dist.all_reduce(used, group=self._group)
                globally_unused = {k for k, u in enumerate(used.tolist()) if u == 0}
            with torch.no_grad():
                for k, p in enumerate(self._params):
                    if k in globally_unused or (k in missing and not self.find_unused_parameters):
                        continue
                    b, j = self._where[k]
                    if p.grad is None:
                        p.grad = self._views[b][j].clone()
                    else:
                        p.grad.copy_(self._views[b][j])
            st.record.wait_end_s = time.perf_counter()
            self.last_step = st.record
        if missing and not self.find_unused_parameters:
            raise UnusedParametersError([self._names[k] for k in missing], dist.get_rank())

    # ---- backward machinery ---------------------------------------------------------------------------

    def _make_ready_hook(self, k: int):
        def hook(param: torch.Tensor) -> None:
            self._mark_ready(k, param)
        return hook

    def _mark_ready(self, k: int, param: torch.Tensor) -> None:
        if not self._sync_this_backward:
            return  # no_sync: the gradient stays accumulated in .grad
        st = self._state
        if st is None:
            raise RuntimeError("backward through BucketedDataParallel without a forward through it: call the "
                               "wrapper (not the inner module) so that it can prepare the step")
        if st.finished:
            raise RuntimeError(f"gradient of {self._names[k]} arrived after this step was finished: run a new "
                               "forward before each synced backward")
        if st.ready[k]:
            raise RuntimeError(f"gradient of {self._names[k]} became ready twice in one synced step (two backward "
                               "passes after one forward?); run forward again, or wrap the first in no_sync()")
        now = time.perf_counter()
        if not st.started:
            st.started = True
            st.record.first_grad_s = now
            if self.finish_in_backward:
                # Runs once the whole backward graph has executed, before backward() returns (DDP's reducer
                # queues its finalize_backward the same way).
                Variable._execution_engine.queue_callback(self.finish)
        st.record.last_grad_s = now
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError(f"{self._names[k]} has a sparse gradient; bucket buffers are dense")
        b, j = self._where[k]
        with torch.no_grad():
            if self._hook is None:
                # DDP without a hook divides before summing: the sum of N averages cannot overflow where the
                # sum of N gradients might.
                torch.mul(grad, 1.0 / self.world_size, out=self._views[b][j])
            else:
                self._views[b][j].copy_(grad)
        st.ready[k] = True
        st.pending[b] -= 1
        if st.pending[b] == 0:
            self._mark_bucket_ready(b, now)
            self._launch_ready()

    def _mark_bucket_ready(self, b: int, now: float) -> None:
        with record_function(f"{RANGE_READY}{b}"):
            self._state.record.buckets[b].ready_s = now

    def _launch_ready(self) -> None:
        st = self._state
        n = len(self.buckets)
        while st.next_to_launch < n and st.pending[st.next_to_launch] == 0:
            b = st.next_to_launch
            st.next_to_launch += 1
            self._launch(b)

    def _launch(self, b: int) -> None:
        st = self._state
        timing = st.record.buckets[b]
        with record_function(f"{RANGE_LAUNCH}{b}"):
            timing.launch_s = time.perf_counter()
            if self._hook is None:
                fut = dist.all_reduce(self._bucket_bufs[b], group=self._group, async_op=True).get_future()
            else:
                bucket = Bucket(self._bucket_bufs[b], b, b == len(self.buckets) - 1,
                                [self._params[k] for k in self._members[b]], self._views[b])
                fut = self._hook(self._hook_state, bucket)
                # dist's futures are torch._C.Future; torch.futures.Future wraps the same type.
                if not isinstance(fut, (torch.futures.Future, torch._C.Future)):
                    raise ValueError(f"the comm hook returned {type(fut).__name__}; it must return a "
                                     "torch.futures.Future of the averaged bucket buffer")
            timing.launched_s = time.perf_counter()
        st.futures[b] = fut
        fut.add_done_callback(lambda _f, b=b, timing=timing: self._on_done(b, timing))

    def _on_done(self, b: int, timing: BucketTiming) -> None:
        # Runs on the thread that completed the future (a gloo worker), or inline if it was already complete,
        # once that thread holds the GIL; finish() marks the bucket itself if its wait returns first. Whichever
        # comes first records the completion, once, as an instant range: the profiler then sees it on the same
        # clock as everything else.
        with self._lock:
            if timing.done_s is None:
                with record_function(f"{RANGE_DONE}{b}"):
                    timing.done_s = time.perf_counter()


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Phases of one :func:`train_step` on this rank, in ``time.perf_counter()`` seconds.

    Attributes:
        loss: the step's loss (a float). start_s, forward_end_s, backward_end_s (backward() returned, which
        includes the wait when it runs in backward), wait_end_s, end_s (optimizer step done).
        record: the wrapper's :class:`StepRecord` of this step (per-bucket launch/done times, wait interval); None
            for DDP and for a step inside ``no_sync`` (nothing was communicated).
    """

    loss: float
    start_s: float
    forward_end_s: float
    backward_end_s: float
    wait_end_s: float
    end_s: float
    record: StepRecord | None

    @property
    def step_s(self) -> float:
        return self.end_s - self.start_s


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
               *batch: torch.Tensor) -> StepTimes:
    """One data-parallel step: zero grads, forward, backward, wait for every bucket, optimizer step.

    Works for :class:`BucketedDataParallel` and for ``DistributedDataParallel`` alike (for DDP there is no
    ``finish``). ``loss_fn(output, *batch[1:])`` gives the loss of ``model(batch[0])``. Each phase runs in a
    ``record_function`` range (``overlap::forward`` is opened by the wrapper itself, ``overlap::backward``,
    ``overlap::wait``, ``overlap::optimizer``) that :mod:`commlab.overlap.profile` reads back.

    Returns:
        :class:`StepTimes`.
    """
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    if isinstance(model, BucketedDataParallel):
        out = model(batch[0])
    else:
        with record_function(RANGE_FORWARD):
            out = model(batch[0])
    loss = loss_fn(out, *batch[1:])
    t1 = time.perf_counter()
    with record_function(RANGE_BACKWARD):
        loss.backward()
    t2 = time.perf_counter()
    finish = getattr(model, "finish", None)
    if finish is not None:
        finish()  # a no-op when it already ran at the end of backward
    t3 = time.perf_counter()
    with record_function(RANGE_OPTIMIZER):
        optimizer.step()
    t4 = time.perf_counter()
    # A step inside no_sync communicates nothing: it has no record (last_step still holds the previous one).
    synced = getattr(model, "_sync_this_backward", True)
    return StepTimes(float(loss.detach()), t0, t1, t2, t3, t4, getattr(model, "last_step", None) if synced else None)
