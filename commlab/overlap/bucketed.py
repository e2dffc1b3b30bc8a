"""Data parallelism with gradient buckets whose AllReduce overlaps the backward pass, built from primitives.

What ``torch.nn.parallel.DistributedDataParallel`` does for the gradients, in Python (Li et al. 2020,
"PyTorch Distributed", PVLDB 13(12); ``torch/csrc/distributed/c10d/reducer.cpp``).
:class:`BucketedDataParallel` groups the parameters in reverse order into buckets of at least
``bucket_cap_bytes`` (:func:`assign_buckets`); a post-accumulate-grad hook copies each gradient into its
bucket; full buckets are launched (``dist.all_reduce(async_op=True)`` or a comm hook on a :class:`Bucket`)
strictly in index order; ``finish``, an autograd engine callback, waits and writes the averages into
``.grad``. It also handles ``no_sync``/``sync_gradients``, unused parameters, NaN propagation, layout
agreement and the hooks' results. :func:`train_step` runs one step and returns its :class:`StepTimes`,
marked with a :class:`commlab.launch.Clock` (CUDA events on a GPU) and read lazily.

Book: chapter 9 (§9.2 buckets, §9.3 waiting, §9.4 comm hooks, §9.5 accumulation and unused parameters,
§9.7 against DDP); §9.1 for what the source article's trainer does instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.profiler import record_function
from torch.utils.weak import WeakIdKeyDictionary

from commlab import checks
from commlab.collectives.common import group_size_and_rank
from commlab.collectives.agreement import agree
from commlab.launch.device import Clock, Mark, group_device

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "assign_buckets", "BucketSpec", "Bucket", "BucketTiming", "StepRecord",
           "BucketedDataParallel", "UnusedParametersError", "train_step", "StepTimes",
           "AllReduceFnState", "all_reduce_fn_hook", "completed_future", "data_parallel_of"]

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


class _Marks:
    """Named :class:`~commlab.launch.Clock` marks, turned into seconds (since the clock's start) when read."""

    _names: tuple[str, ...] = ()

    def __init__(self, clock: Clock):
        self._clock = clock
        self._marks: dict[str, Mark] = {}

    def _set(self, name: str, mark: Mark) -> None:
        self._marks[name] = mark

    def _seconds(self, name: str) -> float | None:
        mark = self._marks.get(name)
        return None if mark is None else self._clock.seconds(mark)

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={self._seconds(n)!r}" for n in self._names)
        return f"{type(self).__name__}({shown})"


class BucketTiming(_Marks):
    """When a bucket moved in one synced step: seconds since the wrapper's clock started (see the module's
    "Timing"; read lazily, so on a GPU reading waits for the events).

    Attributes:
        index: bucket index. nbytes: buffer bytes.
        ready_s: its last gradient was copied in. launch_s / launched_s: the launch call started / returned
            (a comm hook may do work, and even wait, inside it). done_s: its future completed. Each is None
            until it happened.
    """

    _names = ("ready_s", "launch_s", "launched_s", "done_s")

    def __init__(self, index: int, nbytes: int, clock: Clock):
        super().__init__(clock)
        self.index, self.nbytes = index, nbytes

    ready_s = property(lambda self: self._seconds("ready_s"))
    launch_s = property(lambda self: self._seconds("launch_s"))
    launched_s = property(lambda self: self._seconds("launched_s"))
    done_s = property(lambda self: self._seconds("done_s"))


class StepRecord(_Marks):
    """One synced backward (or :meth:`BucketedDataParallel.sync_gradients`) on this rank, in seconds since the
    wrapper's clock started (read lazily).

    Attributes:
        first_grad_s: the first gradient became ready. last_grad_s: the last one did (backward compute over).
        wait_start_s / wait_end_s: :meth:`BucketedDataParallel.finish` started / returned.
        buckets: one :class:`BucketTiming` per bucket, by index.
    """

    _names = ("first_grad_s", "last_grad_s", "wait_start_s", "wait_end_s")

    def __init__(self, buckets: list[BucketTiming], clock: Clock):
        super().__init__(clock)
        self.buckets = buckets

    first_grad_s = property(lambda self: self._seconds("first_grad_s"))
    last_grad_s = property(lambda self: self._seconds("last_grad_s"))
    wait_start_s = property(lambda self: self._seconds("wait_start_s"))
    wait_end_s = property(lambda self: self._seconds("wait_end_s"))


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
        checks.integer(f"sizes_bytes[{i}]", nbytes, least=0)
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
    checks.integer("bucket_cap_bytes", bucket_cap_bytes, note=f"bytes; DDP's default is 25 MiB = "
                   f"{DEFAULT_BUCKET_CAP_BYTES}, one bucket for everything is e.g. 2**62")


class Bucket:
    """What a comm hook receives: the duck type of ``torch.distributed.GradBucket``.

    ``buffer()`` is the flat gradient buffer (1-D, the bucket's dtype, ``sum(numels)`` elements) holding this
    rank's *un-divided* gradients, as DDP hands them to a hook; ``gradients()`` are views of it shaped like
    ``parameters()``; ``index()`` is the bucket's position; ``is_last()`` is True for the last bucket of a step.
    ``set_buffer(t)`` replaces the buffer for the rest of the hook (``buffer()`` and ``gradients()`` then
    return ``t`` and views of it), as ``GradBucket.set_buffer`` does; the wrapper's own buffer is left as it
    was, and the future's value is copied (cast) into it when the step finishes. The hook returns a
    ``torch.futures.Future`` whose value is the averaged buffer (a tensor of the buffer's element count, on its
    device, in its dtype or in the dtype of the buffer set with ``set_buffer``; or a list holding one).
    """

    __slots__ = ("_buffer", "_original", "_index", "_last", "_params")

    def __init__(self, buffer: torch.Tensor, index: int, last: bool, params: list[nn.Parameter]):
        self._buffer = self._original = buffer
        self._index, self._last, self._params = index, last, params

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer (torch's ``fp16_compress_wrapper`` puts a float16 copy here, so that the hook it
        wraps sends 16 bits).

        Raises:
            ValueError: ``tensor`` is not a 1-D tensor of the bucket's element count, or is on another device.
        """
        n = self._original.numel()
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.numel() != n:
            got = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"Bucket.set_buffer: bucket {self._index} needs a 1-D tensor of {n} elements, got {got}")
        if tensor.device != self._original.device:
            raise ValueError(f"Bucket.set_buffer: bucket {self._index} lives on {self._original.device}, the new "
                             f"buffer on {tensor.device}; keep the gradients on the group's device")
        self._buffer = tensor

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        views, off = [], 0
        for p in self._params:
            views.append(self._buffer[off:off + p.numel()].view(p.shape))
            off += p.numel()
        return views


def completed_future(value: torch.Tensor) -> torch.futures.Future:
    """A ``torch.futures.Future`` already holding ``value`` (for a hook that computed its result synchronously).

    A CUDA tensor's future is made with its device, so that a consumer on another stream waits for it.
    """
    fut = torch.futures.Future(devices=[value.device]) if value.is_cuda else torch.futures.Future()
    fut.set_result(value)
    return fut


class AllReduceFnState:
    """State of :func:`all_reduce_fn_hook`: a synchronous ``all_reduce_fn(tensor) -> sum over the group``.

    Args:
        all_reduce_fn: any function returning the element-wise sum over the ranks of the tensor it is given
            (same shape): ``commlab.collectives.ring_all_reduce``, a learner's ring from lab 2, or a compressed
            sum such as :func:`commlab.train.compressed_all_reduce`.
        process_group: the group ``all_reduce_fn`` sums over, to divide by its size (None: the world).

    Raises:
        ValueError: ``all_reduce_fn`` is not callable; RuntimeError: this rank is not in ``process_group``.
    """

    def __init__(self, all_reduce_fn: Callable[[torch.Tensor], torch.Tensor],
                 process_group: dist.ProcessGroup | None = None):
        if not callable(all_reduce_fn):
            raise ValueError(f"all_reduce_fn must be callable, got {type(all_reduce_fn).__name__}")
        self.all_reduce_fn = all_reduce_fn
        self.process_group = process_group
        self.world_size, _ = group_size_and_rank(process_group, "AllReduceFnState")


def all_reduce_fn_hook(state: AllReduceFnState, bucket: Bucket) -> torch.futures.Future:
    """Comm hook that averages a bucket with ``state.all_reduce_fn`` (sum), divided by the group's size.

    The function runs synchronously on the autograd thread when the bucket is launched, so it does not overlap
    with the rest of backward the way an asynchronous AllReduce does; buckets are still launched in index order
    on every rank, which is what a hand-written collective needs to pair its messages.

    Returns:
        A completed future of the average (a new tensor, the bucket's shape and dtype).

    Raises:
        ValueError: the function returned something of another element count (checked in ``finish``).
    """
    total = state.all_reduce_fn(bucket.buffer())
    if not isinstance(total, torch.Tensor):
        raise ValueError(f"all_reduce_fn returned {type(total).__name__}; it must return the summed tensor")
    return completed_future(total / state.world_size)


class _State:
    """Per-step bookkeeping (reset at every synced forward)."""

    def __init__(self, n_params: int, n_buckets: int, sizes: list[int], nbytes: list[int], clock: Clock):
        self.ready = [False] * n_params
        self.pending = list(sizes)          # gradients still missing, per bucket
        self.next_to_launch = 0
        self.futures: list[torch.futures.Future | None] = [None] * n_buckets
        self.hook_buckets: list[Bucket | None] = [None] * n_buckets   # what each hook saw (its buffer may be new)
        self.started = False                # a gradient of this step arrived
        self.finished = False
        self.failure: BaseException | None = None   # a comm hook raised at launch: nothing more is launched
        self.record = StepRecord([BucketTiming(i, nbytes[i], clock) for i in range(n_buckets)], clock)


# Which wrapper averages a parameter's gradient (weakly held: the registry keeps neither alive). Read by
# ZeroOneOptimizer, which must not reduce again what a wrapper has already averaged.
_WRAPPER_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


def data_parallel_of(param: torch.Tensor) -> "BucketedDataParallel | None":
    """The :class:`BucketedDataParallel` (still alive) that was last built around ``param``, or None."""
    ref = _WRAPPER_OF.get(param)
    return None if ref is None else ref()


def _ready_hook(wrapper: "weakref.ref[BucketedDataParallel]", k: int):
    """The post-accumulate-grad hook of parameter k: marks it ready in its wrapper (if that still exists)."""
    def hook(param: torch.Tensor) -> None:
        w = wrapper()
        if w is not None:
            w._mark_ready(k, param)
    return hook


def _done_callback(wrapper: "weakref.ref[BucketedDataParallel]", b: int, timing: BucketTiming):
    """A bucket future's done-callback: records the completion (weakly, like the ready hooks)."""
    def callback(_fut) -> None:
        w = wrapper()
        if w is not None:
            w._on_done(b, timing)
    return callback


def _remove_all(handles) -> None:
    for h in handles:
        h.remove()


def _hook_name(hook: Callable) -> str:
    return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)


class BucketedDataParallel(nn.Module):
    """Wrap ``module`` so that its gradients are averaged over ``process_group`` in overlapped buckets.

    Backward fills buckets and launches their AllReduces while it still runs; :meth:`finish` (at the end of
    backward unless ``finish_in_backward=False``) waits and writes the averages into ``p.grad``. commlab's one
    data-parallel path (trainers, labs, the DP group of a mesh, with a comm hook to compress).

    Args:
        module: the replica, on :func:`commlab.launch.group_device`; broadcast from rank 0 at construction.
        bucket_cap_bytes: bucket size (default 25 MiB, DDP's); ``1``: one bucket per parameter.
        process_group: the group to average over (None: the world).
        find_unused_parameters: False (default): a parameter without gradient in a synced backward raises
            :class:`UnusedParametersError` (after all launches); True: one extra collective per step counts uses.
        finish_in_backward: queue :meth:`finish` as an autograd callback (default True); False: call it yourself.
        broadcast_from_rank0: broadcast parameters and buffers at construction (default True).
        bucket_key: ``bucket_key(name, parameter)`` -> hashable; different keys never share a bucket (under TP,
            keep replicated parameters apart: ``commlab.parallel.tensor.tp_sharded_parameters``).

    Attributes:
        buckets (:class:`BucketSpec`, launch order), last_step (:class:`StepRecord`), clock, world_size, rank.

    Raises:
        ValueError: bad ``bucket_cap_bytes`` or ``process_group``; no trainable, sparse or misplaced parameters.
        CollectiveMismatchError: ranks disagree on parameter names/shapes/dtypes or ``bucket_cap_bytes``.
        RuntimeError: torch.distributed not initialised, or this rank not in ``process_group``.
    """

    def __init__(self, module: nn.Module, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 process_group: dist.ProcessGroup | None = None, find_unused_parameters: bool = False,
                 finish_in_backward: bool = True, broadcast_from_rank0: bool = True,
                 bucket_key: Callable[[str, nn.Parameter], Any] | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        _check_cap(bucket_cap_bytes)
        for name, flag in (("find_unused_parameters", find_unused_parameters),
                           ("finish_in_backward", finish_in_backward), ("broadcast_from_rank0", broadcast_from_rank0)):
            checks.flag(name, flag)
        self.world_size, self.rank = group_size_and_rank(process_group, "BucketedDataParallel")
        self.module = module
        self.process_group = process_group
        self.bucket_cap_bytes = bucket_cap_bytes
        self.find_unused_parameters = find_unused_parameters
        self.finish_in_backward = finish_in_backward
        self._group = process_group if process_group is not None else dist.group.WORLD

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameter with requires_grad=True: nothing to average")
        sparse = [n for n, p in named if p.is_sparse]
        if sparse:
            raise ValueError(f"sparse parameters are not supported (got {sparse}); bucket buffers are dense")
        device = group_device(self._group)
        if device.type == "cuda":
            # NCCL moves only tensors on the rank's own GPU; anything else fails inside the first collective.
            wrong = [f"{n} on {p.device}" for n, p in named if p.device != device]
            if wrong:
                raise ValueError(f"BucketedDataParallel: the group's device is {device} (NCCL), but "
                                 f"{', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}; move the model there "
                                 "first: module.to(commlab.launch.group_device(group))")
        user_keys = [None if bucket_key is None else bucket_key(n, p) for n, p in named]
        self._agree_layout(named, user_keys)
        if broadcast_from_rank0 and self.world_size > 1:
            self._broadcast_state()

        order = list(reversed(range(len(named))))  # reverse registration: about the order backward produces them
        sizes = [named[i][1].numel() * named[i][1].element_size() for i in order]
        keys = [(named[i][1].dtype, named[i][1].device, user_keys[i]) for i in order]
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
        self.clock = Clock(self._bucket_bufs[0].device)
        self._hook: Callable | None = None
        self._hook_state: Any = None
        self._require_sync = True
        self._sync_this_backward = True
        self._averaged = False
        self._state: _State | None = None
        self._lock = threading.Lock()  # done-callbacks run on gloo's threads
        self.last_step: StepRecord | None = None
        # The hooks hold the wrapper weakly and are removed when it is collected: a model wrapped again (a
        # notebook cell run twice) must not keep feeding a wrapper nobody steps any more.
        self._me = me = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(_ready_hook(me, k)) for k, p in enumerate(self._params)]
        weakref.finalize(self, _remove_all, list(self._handles))
        for p in self._params:
            _WRAPPER_OF[p] = me

    # ---- construction helpers -------------------------------------------------------------------------

    def _agree_layout(self, named, keys: list) -> None:
        """One all_gather_object of (names, shapes, dtypes, cap, bucket keys); every rank raises the same error on
        a mismatch."""
        mine = ([(n, tuple(p.shape), str(p.dtype).replace("torch.", "")) for n, p in named], self.bucket_cap_bytes,
                [repr(k) for k in keys])

        def differ(everyone: list) -> str | None:
            ref_params, ref_cap, ref_keys = everyone[0]
            problems = []
            for r, (params, cap, ks) in enumerate(everyone[1:], start=1):
                if cap != ref_cap:
                    problems.append(f"rank {r} has bucket_cap_bytes={cap}, rank 0 has {ref_cap}")
                if params == ref_params and ks != ref_keys:
                    k = next(i for i, (a, b) in enumerate(zip(ref_keys, ks)) if a != b)
                    problems.append(f"rank {r}'s bucket_key gives {params[k][0]} the key {ks[k]}, "
                                    f"rank 0's {ref_keys[k]}")
                if params != ref_params:
                    if len(params) != len(ref_params):
                        problems.append(f"rank {r} has {len(params)} parameters requiring grad, "
                                        f"rank 0 has {len(ref_params)}")
                    for (n0, s0, d0), (n1, s1, d1) in zip(ref_params, params):
                        if (n0, s0, d0) != (n1, s1, d1):
                            problems.append(f"rank {r} has {n1} {list(s1)} {d1} where rank 0 has {n0} {list(s0)} {d0}")
                            break
            if not problems:
                return None
            return ("ranks built different layouts (" + "; ".join(problems) + "). Every rank must wrap the same "
                    "model with the same bucket_cap_bytes; their buckets would otherwise pair buffers of different "
                    "sizes or hang")

        agree("BucketedDataParallel", mine, self._group, differ=differ)

    def _broadcast_state(self) -> None:
        src = dist.get_global_rank(self._group, 0) if self._group is not dist.group.WORLD else 0
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, src=src, group=self._group)

    def _new_state(self) -> _State:
        return _State(len(self._params), len(self.buckets), [len(m) for m in self._members],
                      [s.nbytes for s in self.buckets], self.clock)

    # ---- public API -----------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._state is not None and self._state.failure is not None and not self._state.finished:
            # The previous step's comm hook raised, and that error reached the caller through backward(): end
            # the lost step (wait for what was launched) so that training can go on.
            try:
                self.finish()
            except BaseException:  # noqa: BLE001 -- the same error the caller has already seen
                pass
        if self._state is not None and self._state.started and not self._state.finished:
            raise RuntimeError("the previous synced backward's buckets were never waited for: call finish() "
                               "(or train_step) before the next forward")
        # Like DDP, whether this iteration synchronises is decided at forward time.
        self._sync_this_backward = self._require_sync
        if self._sync_this_backward:
            self._state = self._new_state()
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
        sum, as DDP's ``no_sync``; or, when no backward outside it follows (a pipeline schedule that runs every
        micro-batch itself), :meth:`sync_gradients` averages the accumulated sum explicitly.
        """
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    @property
    def gradients_averaged(self) -> bool:
        """True when the parameters' ``.grad`` hold this wrapper's averages: the latest backward through it was a
        synced one (or :meth:`sync_gradients` ran) and finished, and no backward inside :meth:`no_sync` has added
        local gradients since. :class:`commlab.parallel.ZeroOneOptimizer` reads it so as not to reduce again."""
        return self._averaged

    def pending(self) -> int:
        """Buckets launched in the current step whose future has not been waited for by :meth:`finish`."""
        st = self._state
        if st is None or st.finished:
            return 0
        return sum(f is not None for f in st.futures)

    def sync_gradients(self) -> None:
        """Average the gradients accumulated in ``p.grad`` now, explicitly, through the same buckets and hook.

        For a step whose backward passes all ran inside :meth:`no_sync`: a pipeline schedule
        (:func:`commlab.parallel.pipeline_step`) runs the backward of every micro-batch itself, so none of them
        can be the synced one. Pass the wrapper as the pipeline's stage inside ``no_sync()``, then call this
        after the pipeline's flush, before the optimizer step::

            with dp.no_sync():
                pipeline_step(dp, x, y, loss_fn, m, pp_group)
            dp.sync_gradients()          # every bucket, in order, over the DP group (and its comm hook)

        Copies each parameter's ``.grad`` into its bucket (scaled by 1/N without a hook), launching each bucket
        as soon as it is filled, in index order, then runs :meth:`finish`. Call it on every rank of the group.
        A parameter whose ``.grad`` is None counts as unused (see ``find_unused_parameters``).

        Raises:
            RuntimeError: a synced backward's buckets are still in flight (call :meth:`finish` first).
            UnusedParametersError, and whatever :meth:`finish` raises.
        """
        st = self._state
        if st is not None and st.started and not st.finished:
            raise RuntimeError("sync_gradients: the buckets of a synced backward are still in flight; call "
                               "finish() first (or run the step's backward passes inside no_sync())")
        self._state = st = self._new_state()
        st.started = True
        now = self.clock.mark()
        st.record._set("first_grad_s", now)
        with torch.no_grad():
            for b, members in enumerate(self._members):
                for k in members:
                    grad = self._params[k].grad
                    if grad is not None:
                        self._copy_in(k, grad)
        st.record._set("last_grad_s", self.clock.mark())
        self.finish()

    def finish(self) -> None:
        """Wait for every bucket of the current synced backward and write the averages into ``p.grad``.

        Buckets not yet launched (some gradient never arrived) are launched first with zeros in the missing
        slots, in order, so that every rank issues the same collectives. Every future is waited for before any
        result is checked, so that nothing is left in flight when one is refused. Idempotent: a second call,
        or a call with no synced backward since the last, does nothing.

        Raises:
            UnusedParametersError: some parameters got no gradient and ``find_unused_parameters`` is False
                (after every collective has completed).
            ValueError: a comm hook's future yielded something other than the bucket's average: not a tensor,
                another element count, another device, or another dtype than the bucket's or the one it set
                with :meth:`Bucket.set_buffer` (the message names the hook).
            Whatever a bucket's future raised (a comm hook's error, a failed collective).

        A comm hook that raises when a bucket is launched (in backward, or here) ends the step: the buckets
        already launched are waited for, no later bucket is launched, ``.grad`` is left as backward wrote it,
        and that error is raised here (and by backward, if it launched there). If backward raised it and
        ``finish`` is not called, the next forward ends the lost step itself.
        """
        st = self._state
        if st is None or st.finished or not st.started:
            return
        with record_function(RANGE_WAIT):
            st.record._set("wait_start_s", self.clock.mark())
            missing = [k for k, r in enumerate(st.ready) if not r]
            try:
                for k in missing:  # zero contribution, then launch what became launchable, in order
                    b, j = self._where[k]
                    self._views[b][j].zero_()
                    st.ready[k] = True
                    st.pending[b] -= 1
                    if st.pending[b] == 0:
                        self._mark_bucket_ready(b, self.clock.mark())
                if missing:
                    try:
                        self._launch_ready()
                    except BaseException:  # noqa: BLE001 -- a hook raised: kept in st.failure, raised below
                        pass
                values = []
                for b, fut in enumerate(st.futures):
                    if fut is None:  # never launched: an earlier bucket's hook raised
                        values.append(None)
                        continue
                    try:
                        value = fut.wait()
                    except BaseException as exc:  # noqa: BLE001 -- re-raised below, once every future is waited
                        st.failure = st.failure or exc
                        value = None
                    self._on_done(b, st.record.buckets[b])  # no-op if its callback already ran
                    st.futures[b] = None  # waited: no pending handle left behind
                    values.append(value)
                if st.failure is not None:
                    raise st.failure
                for b, value in enumerate(values):
                    value = self._check_result(b, value)
                    buf = self._bucket_bufs[b]
                    if value.data_ptr() != buf.data_ptr():
                        buf.copy_(value.reshape(buf.shape))  # casts a buffer the hook set to 16 bits back
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
            st.record._set("wait_end_s", self.clock.mark())
            self.last_step = st.record
        if missing and not self.find_unused_parameters:
            raise UnusedParametersError([self._names[k] for k in missing], dist.get_rank())
        self._averaged = True

    def _check_result(self, b: int, value: Any) -> torch.Tensor:
        """The tensor a bucket's future yielded, if it can be the bucket's average; else a ValueError."""
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        buf = self._bucket_bufs[b]
        if self._hook is None:
            return value  # dist.all_reduce's own future: the buffer itself
        sent = self._state.hook_buckets[b].buffer()  # the bucket's own buffer, or one the hook set
        who = f"the comm hook {_hook_name(self._hook)}"
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{who}: its future for bucket {b} yielded {type(value).__name__}; it must yield the "
                             f"averaged buffer ({buf.numel()} elements of {buf.dtype})")
        if value.numel() != buf.numel():
            raise ValueError(f"{who}: its future for bucket {b} yielded a tensor of shape {list(value.shape)}; it "
                             f"must yield the averaged buffer ({buf.numel()} elements)")
        if value.device != buf.device:
            raise ValueError(f"{who}: its future for bucket {b} yielded a tensor on {value.device}, but the bucket "
                             f"lives on {buf.device}; return the average on the bucket's device")
        if value.dtype not in (buf.dtype, sent.dtype):
            allowed = str(buf.dtype) if sent.dtype == buf.dtype else f"{buf.dtype} or {sent.dtype}"
            raise ValueError(f"{who}: its future for bucket {b} yielded {value.dtype}, but the bucket holds "
                             f"{buf.dtype}; it must yield {allowed}. Decompress before returning, or, to send "
                             "another dtype on purpose, put it in with bucket.set_buffer(...) as torch's "
                             "fp16_compress_wrapper does, and it is cast back here")
        return value

    # ---- backward machinery ---------------------------------------------------------------------------

    def _mark_ready(self, k: int, param: torch.Tensor) -> None:
        self._averaged = False  # .grad now holds (or will hold) local gradients
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
        now = self.clock.mark()
        if not st.started:
            st.started = True
            st.record._set("first_grad_s", now)
            if self.finish_in_backward:
                # Runs once the whole backward graph has executed, before backward() returns (DDP's reducer
                # queues its finalize_backward the same way).
                Variable._execution_engine.queue_callback(self.finish)
        st.record._set("last_grad_s", now)
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError(f"{self._names[k]} has a sparse gradient; bucket buffers are dense")
        if torch.is_grad_enabled():  # only with backward(create_graph=True); entering no_grad costs per parameter
            with torch.no_grad():
                self._copy_in(k, grad, now)
        else:
            self._copy_in(k, grad, now)

    def _copy_in(self, k: int, grad: torch.Tensor, now: Mark | None = None) -> None:
        """Copy parameter k's gradient into its bucket slot; launch what this completes, in order."""
        st = self._state
        b, j = self._where[k]
        if self._hook is None:
            # DDP without a hook divides before summing: the sum of N averages cannot overflow where the
            # sum of N gradients might.
            torch.mul(grad, 1.0 / self.world_size, out=self._views[b][j])
        else:
            self._views[b][j].copy_(grad)
        st.ready[k] = True
        st.pending[b] -= 1
        if st.pending[b] == 0:
            self._mark_bucket_ready(b, now if now is not None else self.clock.mark())
            self._launch_ready()

    def _mark_bucket_ready(self, b: int, now: Mark) -> None:
        with record_function(f"{RANGE_READY}{b}"):
            self._state.record.buckets[b]._set("ready_s", now)

    def _launch_ready(self) -> None:
        st = self._state
        n = len(self.buckets)
        # After a hook raised, later buckets stay unlaunched: the step is lost, and launching them would only
        # issue collectives this rank never waits for.
        while st.failure is None and st.next_to_launch < n and st.pending[st.next_to_launch] == 0:
            b = st.next_to_launch
            st.next_to_launch += 1
            self._launch(b)

    def _launch(self, b: int) -> None:
        st = self._state
        timing = st.record.buckets[b]
        with record_function(f"{RANGE_LAUNCH}{b}"):
            timing._set("launch_s", self.clock.mark())
            if self._hook is None:
                fut = dist.all_reduce(self._bucket_bufs[b], group=self._group, async_op=True).get_future()
            else:
                bucket = Bucket(self._bucket_bufs[b], b, b == len(self.buckets) - 1,
                                [self._params[k] for k in self._members[b]])
                st.hook_buckets[b] = bucket
                try:
                    fut = self._hook(self._hook_state, bucket)
                    # dist's futures are torch._C.Future; torch.futures.Future wraps the same type.
                    if not isinstance(fut, (torch.futures.Future, torch._C.Future)):
                        raise ValueError(f"the comm hook {_hook_name(self._hook)} returned {type(fut).__name__}; "
                                         "it must return a torch.futures.Future of the averaged bucket buffer")
                except BaseException as exc:
                    # Kept so that finish() waits for the buckets already launched, then raises this, and the
                    # step ends (the next forward starts afresh) instead of tripping over a missing future.
                    st.failure = exc
                    raise
            timing._set("launched_s", self.clock.mark())
        st.futures[b] = fut
        fut.add_done_callback(_done_callback(self._me, b, timing))

    def _on_done(self, b: int, timing: BucketTiming) -> None:
        # Runs on the thread that completed the future (a gloo worker), or inline if it was already complete,
        # once that thread holds the GIL; finish() marks the bucket itself if its wait returns first. Whichever
        # comes first records the completion, once, as an instant range: the profiler then sees it on the same
        # clock as everything else. Under NCCL the callback runs with the collective's stream current, so the
        # CUDA event recorded here completes when the collective does.
        with self._lock:
            if "done_s" not in timing._marks:
                with record_function(f"{RANGE_DONE}{b}"):
                    timing._set("done_s", self.clock.mark())


class StepTimes:
    """Phases of one :func:`train_step` on this rank, in seconds since ``clock`` started.

    Times and the loss are read lazily (on a GPU, reading one waits for its CUDA event, or for the loss), so
    that a training loop that keeps the :class:`StepTimes` of every step and reads them at the end makes no
    host synchronisation per step.

    Attributes:
        loss: the step's loss (a float). start_s, forward_end_s, backward_end_s (backward() returned, which
        includes the wait when it runs in backward), wait_end_s, end_s (optimizer step done); step_s.
        record: the wrapper's :class:`StepRecord` of this step (per-bucket launch/done times, wait interval); None
            for DDP and for a step inside ``no_sync`` (nothing was communicated).
        clock: the :class:`commlab.launch.Clock` of the marks (the wrapper's, so that ``record`` and these
            phases share one time axis).
    """

    __slots__ = ("clock", "_marks", "_loss", "record")

    def __init__(self, clock: Clock, marks: Sequence[Mark], loss: torch.Tensor, record: StepRecord | None):
        self.clock, self._marks, self._loss, self.record = clock, tuple(marks), loss, record

    @property
    def loss(self) -> float:
        return float(self._loss)

    start_s = property(lambda self: self.clock.seconds(self._marks[0]))
    forward_end_s = property(lambda self: self.clock.seconds(self._marks[1]))
    backward_end_s = property(lambda self: self.clock.seconds(self._marks[2]))
    wait_end_s = property(lambda self: self.clock.seconds(self._marks[3]))
    end_s = property(lambda self: self.clock.seconds(self._marks[4]))

    @property
    def step_s(self) -> float:
        return self.end_s - self.start_s

    def __repr__(self) -> str:
        return (f"StepTimes(loss={self.loss:.6g}, step_s={self.step_s:.6g}, "
                f"record={'yes' if self.record is not None else None})")


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
               *batch: torch.Tensor) -> StepTimes:
    """One data-parallel step: zero grads, forward, backward, wait for every bucket, optimizer step.

    Works for :class:`BucketedDataParallel` and for ``DistributedDataParallel`` alike (for DDP there is no
    ``finish``). ``loss_fn(output, *batch[1:])`` gives the loss of ``model(batch[0])``; the batch must be on the
    model's device. Each phase runs in a ``record_function`` range (``overlap::forward`` is opened by the
    wrapper itself, ``overlap::backward``, ``overlap::wait``, ``overlap::optimizer``) that
    :mod:`commlab.overlap.profile` reads back, and is marked on the wrapper's clock (a CUDA event on a GPU).

    Returns:
        :class:`StepTimes` (read lazily).
    """
    clock = getattr(model, "clock", None)
    if not isinstance(clock, Clock):
        clock = Clock(next(model.parameters()).device)
    t0 = clock.mark()
    optimizer.zero_grad(set_to_none=True)
    if isinstance(model, BucketedDataParallel):
        out = model(batch[0])
    else:
        with record_function(RANGE_FORWARD):
            out = model(batch[0])
    loss = loss_fn(out, *batch[1:])
    t1 = clock.mark()
    with record_function(RANGE_BACKWARD):
        loss.backward()
    t2 = clock.mark()
    finish = getattr(model, "finish", None)
    if finish is not None:
        finish()  # a no-op when it already ran at the end of backward
    t3 = clock.mark()
    with record_function(RANGE_OPTIMIZER):
        optimizer.step()
    t4 = clock.mark()
    # A step inside no_sync communicates nothing: it has no record (last_step still holds the previous one).
    synced = getattr(model, "_sync_this_backward", True)
    return StepTimes(clock, (t0, t1, t2, t3, t4), loss.detach(),
                     getattr(model, "last_step", None) if synced else None)
