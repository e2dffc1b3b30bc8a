"""DDP communication hooks: any commlab compressor, and PowerSGD, plugged into ``DistributedDataParallel``.

A hook replaces DDP's all-reduce of each gradient bucket (a flat buffer of several parameters' gradients).
PyTorch's interface, ``DistributedDataParallel.register_comm_hook(state, hook)``: a plain function
``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` whose future yields the bucket's *averaged*
gradient; the state holds settings and what persists between steps. Both hooks follow PyTorch's
``ddp_comm_hooks`` (``fp16_compress_hook``, ``powerSGD_hook``) and are tested against them.

Usage::

    ddp.register_comm_hook(CompressionHookState(CastCompressor(torch.float16)), compression_hook)
    ddp.register_comm_hook(CompressionHookState(SignCompressor(), error_feedback=True, aggregation="two_phase"),
                           compression_hook)
    ddp.register_comm_hook(PowerSGDState(rank=2, start_iter=10), powersgd_hook)
"""

# No "from __future__ import annotations": DDP checks the hook's annotations at runtime (dist.GradBucket, Future).

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives.common import group_size_and_rank
from commlab.compress.aggregate import AggregateCall
from commlab.compress.base import Compressor
from commlab.compress.error_feedback import ErrorFeedback
from commlab.compress.powersgd import PowerSGDCall, PowerSGDState, state_group
from commlab.compress.two_phase import server_key

#: The values of ``CompressionHookState(aggregation=...)``.
AGGREGATIONS = ("auto", "two_phase")

__all__ = ["CompressionHookState", "compression_hook", "PowerSGDState", "powersgd_hook"]


class CompressionHookState:
    """Settings and per-bucket residuals of :func:`compression_hook`.

    Args:
        compressor: any object following :class:`commlab.compress.base.Compressor`.
        process_group: the group to average over; ``None`` (default): the world.
        error_feedback: keep what compression lost on this rank (per bucket, in its dtype) and add it to the next
            gradient (Seide et al. 2014; Karimireddy et al. 2019). Default False, as PyTorch's
            ``fp16_compress_hook``; biased compressors (Top-K, sign) need it to converge.
        aggregation: ``"auto"`` (default): all-reduce a linear compressor's payload, all-gather any other's
            (as torch's prototype ``quantization_pertensor_hook``; ``(N-1) x payload`` per rank).
            ``"two_phase"``: :mod:`commlab.compress.two_phase` (about ``2 (N-1)/N x payload``), as 1-bit Adam.
        server_error_feedback: ``"two_phase"`` only: the chunk owner keeps what recompressing its sum lost
            (DeepSpeed's ``server_error``; float32, or float64 for float64 buckets). None: as ``error_feedback``.

    Attributes:
        residuals: bucket index -> this rank's flat residual. server_residuals: the owner's :class:`ErrorFeedback`
        (keys ``(bucket index, this rank)``) or None. last_payload_nbytes, last_bytes_sent_per_rank: the latest
        bucket's payload bytes and bytes sent (as :attr:`commlab.compress.Aggregated.bytes_sent_per_rank`).

    Raises:
        ValueError: ``compressor`` does not follow the protocol, or a bad ``process_group``/``error_feedback``/
            ``aggregation``/``server_error_feedback`` (server error feedback without two-phase aggregation).
        RuntimeError: this rank is not a member of ``process_group``.
    """

    def __init__(self, compressor: Compressor, process_group: dist.ProcessGroup | None = None,
                 error_feedback: bool = False, aggregation: str = "auto", server_error_feedback: bool | None = None):
        missing = [a for a in ("name", "linear", "compress", "decompress") if not hasattr(compressor, a)]
        if missing:
            raise ValueError(f"compressor {compressor!r} lacks {missing}; it must follow "
                             "commlab.compress.base.Compressor (name, linear, compress, decompress)")
        checks.flag("error_feedback", error_feedback)
        checks.one_of("aggregation", aggregation, AGGREGATIONS)
        if server_error_feedback is not None:
            checks.flag("server_error_feedback", server_error_feedback, note="or None: as error_feedback")
        if server_error_feedback and aggregation != "two_phase":
            raise ValueError("server_error_feedback is the chunk owners' error feedback of aggregation='two_phase'; "
                             f"aggregation={aggregation!r} has no owners")
        if process_group is not None:  # None is the world, resolved when the hook runs
            group_size_and_rank(process_group, "CompressionHookState")
        self.compressor = compressor
        self.process_group = process_group
        self.error_feedback = error_feedback
        self.aggregation = aggregation
        self.server_error_feedback = (aggregation == "two_phase" and
                                      (error_feedback if server_error_feedback is None else server_error_feedback))
        self.residuals: dict[int, torch.Tensor] = {}
        # bucket index -> [(id of parameter, numel)] of the layout its residual was stored with.
        self._layouts: dict[int, list[tuple[int, int]]] = {}
        self.server_residuals = ErrorFeedback(compressor) if self.server_error_feedback else None
        # The same for the owners' residuals: a chunk is a range of the flat bucket, so a new layout drops them.
        self._server_layouts: dict[int, list[tuple[int, int]]] = {}
        self.last_payload_nbytes = 0
        self.last_bytes_sent_per_rank = 0.0

    def state_dict(self) -> dict:
        """What the next steps depend on, for a checkpoint: resuming from it is the uninterrupted run.

        ``{"compressor": its name, "error_feedback": bool, "residuals": {bucket index: flat tensor},
        "bucket_numels": {bucket index: [element count of each parameter in the bucket, in order]},
        "counters": the compressor's own state, if it keeps any: Random-K's call count ``step``, QSGD's
        ``generator`` state, "aggregation": str, "server_error_feedback": bool, "server_owner": this rank's
        group rank (the chunk it owns), "server_residuals": {bucket index: the owner's residual of its
        chunk (float32, float64 for float64 buckets)}, "server_bucket_numels": as "bucket_numels"}``,
        tensors cloned. The residuals are this rank's own, per bucket: the dict belongs to the rank that
        holds it and to the same bucket layout.
        """
        counters = {}
        if isinstance(getattr(self.compressor, "step", None), int):
            counters["step"] = self.compressor.step
        if isinstance(getattr(self.compressor, "generator", None), torch.Generator):
            counters["generator"] = self.compressor.generator.get_state()
        server, owner = {}, None
        if self.server_residuals is not None:
            for (b, owner), r in ((k, self.server_residuals.residual(k)) for k in self.server_residuals.keys()):
                server[b] = r.detach().clone()
        return {"compressor": self.compressor.name, "error_feedback": self.error_feedback,
                "residuals": {b: r.detach().clone() for b, r in self.residuals.items()},
                "bucket_numels": {b: [k for _, k in layout] for b, layout in self._layouts.items()},
                "counters": counters, "aggregation": self.aggregation,
                "server_error_feedback": self.server_error_feedback, "server_owner": owner,
                "server_residuals": server,
                "server_bucket_numels": {b: [k for _, k in self._server_layouts[b]] for b in server}}

    def load_state_dict(self, state_dict: dict, buckets) -> None:
        """Restore what :meth:`state_dict` returned, for the buckets this rank has now.

        Args:
            state_dict: from :meth:`state_dict` (its tensors on the gradients' device).
            buckets: bucket index -> that bucket's parameters in order (what ``bucket.parameters()`` will give
                the hook): the residuals are re-attached to them (the state tracks parameters by identity,
                which does not survive a restart).

        Raises:
            ValueError: another compressor, error-feedback or aggregation setting; server residuals saved by the
                owner of another chunk (another rank); a bucket that does not exist now, or one whose
                parameters' element counts differ from the saved ones (another bucket layout: the message names
                the bucket and both counts).
        """
        # Dicts saved before two-phase aggregation existed hold none of its keys: they are "auto" ones.
        saved_agg = (state_dict.get("aggregation", "auto"), bool(state_dict.get("server_error_feedback", False)))
        if (state_dict["compressor"], state_dict["error_feedback"]) != (self.compressor.name, self.error_feedback):
            raise ValueError(f"CompressionHookState.load_state_dict: saved for {state_dict['compressor']} with "
                             f"error_feedback={state_dict['error_feedback']}, this state has {self.compressor.name} "
                             f"with error_feedback={self.error_feedback}")
        if saved_agg != (self.aggregation, self.server_error_feedback):
            raise ValueError(f"CompressionHookState.load_state_dict: saved with aggregation={saved_agg[0]!r}, "
                             f"server_error_feedback={saved_agg[1]}, this state has aggregation={self.aggregation!r}, "
                             f"server_error_feedback={self.server_error_feedback}")
        server = state_dict.get("server_residuals", {})
        if server:
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            me = dist.get_rank(group)
            if state_dict["server_owner"] != me:
                raise ValueError(f"CompressionHookState.load_state_dict: the server residuals were saved by the owner "
                                 f"of chunk {state_dict['server_owner']}, this rank owns chunk {me}; load each rank's "
                                 "own state dict")

        def relayout(numels_by_bucket: dict) -> dict:
            layouts = {}
            for b, numels in numels_by_bucket.items():
                params = list(buckets[b]) if b in buckets else []
                now = [p.numel() for p in params]
                if now != list(numels):
                    raise ValueError(f"CompressionHookState.load_state_dict: bucket {b} was saved holding parameters "
                                     f"of {list(numels)} elements, now it holds {now}; the residuals belong to another "
                                     "bucket layout (another TP/PP split or bucket cap): start afresh instead")
                layouts[b] = [(id(p), p.numel()) for p in params]
            return layouts

        layouts = relayout(state_dict["bucket_numels"])
        server_layouts = relayout(state_dict.get("server_bucket_numels", {}))
        self.residuals = {b: r.clone() for b, r in state_dict["residuals"].items()}
        self._layouts = layouts
        if self.server_residuals is not None:
            self.server_residuals.reset()
            for b, r in server.items():
                self.server_residuals.set_residual(server_key(b, me), r)
            self._server_layouts = server_layouts
        counters = state_dict.get("counters", {})
        if "step" in counters:
            self.compressor.step = int(counters["step"])
        if "generator" in counters:
            self.compressor.generator.set_state(counters["generator"])

    def _residual(self, bucket, like: torch.Tensor) -> torch.Tensor:
        """The residual of ``bucket``, re-laid out if DDP regrouped its parameters since it was stored."""
        idx = bucket.index()
        layout = [(id(p), p.numel()) for p in bucket.parameters()]
        old = self.residuals.get(idx)
        if old is None:
            return torch.zeros_like(like)
        old_layout = self._layouts[idx]
        if old_layout == layout:
            return old
        # DDP rebuilds its buckets after the first iteration (by gradient arrival order): move each
        # parameter's residual to its new place; a parameter new to this bucket starts from zero.
        pieces, off = {}, 0
        for pid, k in old_layout:
            pieces[pid] = old[off:off + k]
            off += k
        for j, other in self.residuals.items():  # the parameter may come from another old bucket
            if j != idx:
                off = 0
                for pid, k in self._layouts[j]:
                    pieces.setdefault(pid, other[off:off + k])
                    off += k
        return torch.cat([pieces.get(pid, torch.zeros(k, dtype=like.dtype, device=like.device))
                          for pid, k in layout]) if layout else torch.zeros_like(like)

    def _store(self, bucket, residual: torch.Tensor) -> None:
        self.residuals[bucket.index()] = residual
        self._layouts[bucket.index()] = [(id(p), p.numel()) for p in bucket.parameters()]

    def _server_feedback(self, bucket, owner: int) -> ErrorFeedback | None:
        """The owners' error feedback, with ``bucket``'s residual dropped if DDP laid the bucket out anew since
        it was stored: a chunk is a range of the flat bucket, which then holds other parameters' entries (the
        worker residuals are moved parameter by parameter instead; an owner's chunk cannot be, without asking
        its peers). DDP rebuilds its buckets once, after the first step, so at most one step's server error is
        dropped."""
        if self.server_residuals is None:
            return None
        idx = bucket.index()
        layout = [(id(p), p.numel()) for p in bucket.parameters()]
        if self._server_layouts.get(idx) != layout:
            self.server_residuals.reset(server_key(idx, owner))
            self._server_layouts[idx] = layout
        return self.server_residuals


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket with ``state.compressor``, through the path :func:`commlab.compress.aggregate` takes
    (:class:`commlab.compress.aggregate.AggregateCall`): linear payloads all-reduced, others all-gathered, or
    the two-phase compressed AllReduce (``state.aggregation == "two_phase"``).

    Each rank compresses ``x`` = its gradient (+ its residual, with error feedback; the new residual is
    ``x - decompress(compress(x))``, kept per bucket). As a DDP hook it averages with torch's asynchronous
    collectives (``overlap``), divides a linear payload by N before the sum as PyTorch's
    ``fp16_compress_hook`` does (for ``CastCompressor(torch.float16)`` the arithmetic is exactly PyTorch's),
    and lets payload sizes differ by rank (``ragged``: a threshold sparsifier). All collectives are issued
    from the calling thread, in bucket order.

    Returns:
        A future of the bucket buffer, holding the average.

    Raises:
        TypeError: a linear compressor whose payload holds a non-floating-point tensor.
        FloatingPointError: NaN/Inf in any rank's ``x`` (on every rank, before anything is sent); with
            two-phase also a chunk owner whose sum overflows when recompressed (on every rank).
        CollectiveMismatchError: two-phase, the ranks' chunk payloads differ (on every rank).
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    x = buffer + state._residual(bucket, buffer) if state.error_feedback else buffer
    call = AggregateCall(x, state.compressor, group, key=bucket.index(), path=state.aggregation,
                         server_error_feedback=state._server_feedback(bucket, dist.get_rank(group)),
                         mean=True, overlap=True, ragged=True, what="compression_hook")
    futures = call.start()
    state.last_payload_nbytes = call.payload_nbytes
    state.last_bytes_sent_per_rank = call.bytes_sent_per_rank
    if state.error_feedback:
        state._store(bucket, x - call.sent())

    def done(_=None):
        buffer.copy_(call.finish(wait=False).reshape(buffer.shape))
        return buffer

    if not futures:  # nothing in flight (one rank, or an empty bucket)
        fut = torch.futures.Future()
        fut.set_result(done())
        return fut
    return torch.futures.collect_all(futures).then(done)


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD as a DDP communication hook (:mod:`commlab.compress.powersgd` has the algorithm).

    For the first ``state.start_iter`` steps the bucket is averaged with a plain all-reduce (divided by N
    first, as PyTorch's ``allreduce_hook``); afterwards each of the bucket's per-parameter gradients
    (``bucket.gradients()``, views into the bucket's buffer) goes through PowerSGD, keyed in the state by
    ``(bucket index, position in the bucket)``. ``state.step`` advances when DDP hands over the last bucket
    of a step (``bucket.is_last()``).

    The hook waits for the first all-reduce (P, with the uncompressed tensors), launches the second (Q)
    and returns; the approximation and the residuals are computed when Q arrives, while backward goes on
    with the next buckets. All collectives are issued from the calling thread (see the comment inside).

    Returns:
        A future of the bucket buffer, holding the average.
    """
    group = state_group(state)
    buffer = bucket.buffer()
    compress_now = state.step >= state.start_iter
    if bucket.is_last():
        state.step += 1
    if not compress_now:
        buffer.div_(dist.get_world_size(group))
        return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda f: buffer)

    grads = bucket.gradients()
    idx = bucket.index()
    call = PowerSGDCall(grads, state, group, [(idx, j) for j in range(len(grads))], out=grads)
    # Every collective is issued from this thread, in bucket order, so all ranks issue them in the same
    # order. Issuing the second all-reduce from a future's callback (as PyTorch's hook does) races with the
    # next bucket's first all-reduce issued from the autograd thread; with several buckets on gloo the ranks
    # then disagree on the order and abort ("Received data size doesn't match expected size").
    for fut in call.start():
        fut.wait()
    second = call.middle()

    def third(fut):
        fut.value()  # re-raises a failed all-reduce
        call.finish()
        return buffer

    return second.then(third)
