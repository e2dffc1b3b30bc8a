"""PowerSGD: rank-r gradient compression by one step of power iteration, with two all-reduces.

Source: Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019 (arXiv:1905.13727), Algorithms 1 and 2; tested against PyTorch's
``ddp_comm_hooks.powerSGD_hook``. Entry points: :func:`powersgd_all_reduce` (average a list of tensors),
:class:`PowerSGDState` (settings, residuals, warm-start Q), :func:`orthogonalize_`, :func:`powersgd_nbytes`.

Each gradient is viewed as a matrix M (m x n; a conv weight as (out, in·kh·kw)); P = (M + E) Q and then
Q = Mᵀ P̂ are all-reduced (P̂ orthonormalised in float32). Tensors of at most one dimension, and matrices
that compression would not shrink by ``min_compression_rate``, travel uncompressed (float32 ones with P).
Each rank keeps its own error as residual; NaN or inf raise ``FloatingPointError`` on every rank.

Book: chapter 7 (§7.2 the algorithm, §7.3 why P is all-reduced, §7.4 orthogonalisation, §7.5 warm start and
error feedback, §7.6 what stays uncompressed, §7.8 the differences from PyTorch's hook).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from typing import Hashable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives.common import group_size_and_rank

__all__ = ["PowerSGDState", "PowerSGDBytes", "powersgd_all_reduce", "powersgd_nbytes", "orthogonalize_",
           "compressed_shape", "PowerSGDCall", "state_group"]

# Element size of P and Q on the wire: they are computed and sent in float32 (book §7.4).
_PQ_DTYPE = torch.float32


@dataclasses.dataclass(frozen=True)
class PowerSGDBytes:
    """Bytes each rank puts into the collectives of one :func:`powersgd_all_reduce` call (exact).

    These are message sizes: what one rank contributes to each all-reduce. A ring AllReduce of a
    B-byte message then sends about 2(N-1)/N * B bytes per rank
    (:func:`commlab.collectives.ring_bytes_sent_per_rank`).

    Attributes:
        dense_nbytes: the input tensors' bytes (what a plain all-reduce would carry).
        uncompressed_nbytes: bytes of the tensors sent as they are (in their own dtype).
        p_nbytes, q_nbytes: bytes of all P (m x r) and all Q (n x r) matrices, float32.
    """

    dense_nbytes: int
    uncompressed_nbytes: int
    p_nbytes: int
    q_nbytes: int

    @property
    def total_nbytes(self) -> int:
        """uncompressed + P + Q bytes."""
        return self.uncompressed_nbytes + self.p_nbytes + self.q_nbytes

    @property
    def ratio(self) -> float:
        """dense bytes / sent bytes (1 for an empty call)."""
        return self.dense_nbytes / self.total_nbytes if self.total_nbytes else 1.0


def compressed_shape(shape: Sequence[int], rank: int, min_compression_rate: float) -> tuple[int, int, int] | None:
    """``(m, n, r)`` if a tensor of ``shape`` is compressed, ``None`` if it is sent as it is.

    A tensor of at least two dimensions is viewed as ``m = shape[0]`` rows by ``n = prod(shape[1:])``
    columns; ``r = min(m, n, rank)``; it is compressed when ``(m + n) * r * min_compression_rate < m * n``.
    """
    if len(shape) <= 1:
        return None
    m = int(shape[0])
    n = math.prod(int(s) for s in shape[1:])
    r = min(m, n, rank)
    if r >= 1 and (m + n) * r * min_compression_rate < m * n:
        return m, n, r
    return None


def powersgd_nbytes(tensors: Sequence[torch.Tensor], rank: int = 1,
                    min_compression_rate: float = 2) -> PowerSGDBytes:
    """Exact bytes one rank sends for ``tensors`` (anything with ``.shape`` and ``.dtype``; meta tensors do).

    Same rule as :func:`powersgd_all_reduce`; see :class:`PowerSGDBytes` for what is counted.
    """
    dense = unc = p = q = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        dense += size
        layout = compressed_shape(t.shape, rank, min_compression_rate)
        if layout is None:
            unc += size
        else:
            m, n, r = layout
            itemsize = torch.empty((), dtype=_PQ_DTYPE).element_size()
            p += m * r * itemsize
            q += n * r * itemsize
    return PowerSGDBytes(dense, unc, p, q)


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Make the columns of ``matrix`` (m x r, r <= m, floating point) orthonormal, in place; return it.

    r <= 2: Gram-Schmidt with re-orthogonalization (each column has the previous ones projected out twice);
    each column is divided by ``norm + epsilon``, and a column whose norm is exactly zero (an all-zero
    matrix) is left at zero when ``epsilon == 0``. A column that is numerically in the span of the previous
    ones (rank deficiency) becomes a unit vector orthogonal to them, which the product with M then ignores.
    r > 2: Householder QR (``torch.linalg.qr``), which returns orthonormal columns for any input,
    rank-deficient or zero included; ``epsilon`` is not used there.
    """
    r = matrix.shape[1]
    if r > 2:
        q, _ = torch.linalg.qr(matrix)
        matrix.copy_(q)
        return matrix
    for i in range(r):
        col = matrix[:, i:i + 1]
        if i > 0:
            prev = matrix[:, :i]
            # Project out the previous columns twice ("twice is enough": Giraud, Langou & Rozloznik 2005,
            # Comput. Math. Appl. 50). Once is not: when the column is (nearly) in their span, as for a
            # rank-deficient gradient, what remains is rounding noise whose own component along them is of
            # the same size, and normalizing it would give a column far from orthogonal.
            for _ in range(2):
                col.sub_(prev @ (prev.T @ col))
        norm = torch.linalg.vector_norm(col)
        if i > 0 and norm == 0 and bool(torch.linalg.vector_norm(matrix[:, :i]) > 0):
            # The column was exactly in the span of the previous ones (the projection cancelled to 0.0):
            # put in the unit vector orthogonal to them built from the coordinate they cover least, so that
            # the rank is not lost for good (with warm start a zero column of P would stay zero).
            k = int(torch.argmin(matrix[:, :i].abs().sum(dim=1)))
            col.zero_()
            col[k] = 1
            for _ in range(2):
                col.sub_(prev @ (prev.T @ col))
            norm = torch.linalg.vector_norm(col)
        if epsilon > 0:
            col.div_(norm + epsilon)
        else:
            # Divide by 1 where the norm is 0: the column is all zeros and stays so (no 0/0 = NaN).
            col.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
    return matrix


class PowerSGDState:
    """Settings and persistent buffers of PowerSGD: one object per model (or per set of tensors).

    Args:
        process_group: the group to average over; ``None`` (default): the world.
        rank: r, the rank of the approximation, int >= 1. Default 1, as PyTorch (the paper reaches full accuracy
            with r = 1-4, section 5, Table 3); raise it by factors of 2 if accuracy suffers.
        start_iter: steps of plain all-reduce before compressing (counted in :attr:`step` by
            :func:`commlab.compress.hooks.powersgd_hook`), int >= 0; default 1000, as PyTorch. Must be >= 2
            with error feedback or warm start (DDP reorders its buckets after the first iteration).
        min_compression_rate: compress a matrix only if that divides its bytes by more than this, float > 0.
            Default 2, as PyTorch.
        use_error_feedback, warm_start: error feedback (Algorithm 2), reuse of last step's Q (§4.2); default True.
        orthogonalization_epsilon: added to each column norm in Gram-Schmidt, float >= 0. Default 0.
        random_seed: seeds the initial Q draws, int >= 0, the same on all ranks; the draws follow PyTorch's
            hook (``numpy.random.RandomState(random_seed)``, ``torch.randn`` per new shape) for comparison.

    Attributes (dicts keyed by tensor index, or ``(bucket index, position)`` in the DDP hook):
        residuals: float32 (m, n) residuals of this rank; q_memory: float32 (n, r) warm-start Q (same on all
        ranks); step: steps completed; last_nbytes: :class:`PowerSGDBytes` of the latest call;
        total_dense_nbytes, total_sent_nbytes: sums over all compressed calls.

    Raises:
        ValueError: a setting out of range (named, with the allowed values), or a non-ProcessGroup ``process_group``.
        RuntimeError: this rank is not a member of ``process_group``.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, rank: int = 1, start_iter: int = 1000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0):
        checks.integer("rank", rank, note="of the low-rank approximation; 1-4 is typical, larger values compress less")
        checks.integer("start_iter", start_iter, least=0, note="steps of plain all-reduce first")
        checks.flag("use_error_feedback", use_error_feedback)
        checks.flag("warm_start", warm_start)
        if (use_error_feedback or warm_start) and start_iter < 2:
            raise ValueError(f"start_iter must be >= 2 when use_error_feedback or warm_start is on, got "
                             f"{start_iter}: DDP rebuilds its buckets after the first iteration, so residuals "
                             "and warm-start matrices remembered before that would belong to other tensors. "
                             "Pass start_iter=2 or more, or turn both off")
        checks.number("min_compression_rate", min_compression_rate, above=0,
                      note="2 = compress a matrix only if that at least halves its bytes")
        checks.number("orthogonalization_epsilon", orthogonalization_epsilon, least=0,
                      note="0 is safe: zero columns are guarded; 1e-8 is typical otherwise")
        checks.integer("random_seed", random_seed, 0, 2 ** 32 - 1)
        if process_group is not None:  # None is the world, resolved when the state is used
            group_size_and_rank(process_group, "PowerSGDState")
        self.process_group = process_group
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = int(random_seed)
        self.reset()

    def reset(self) -> None:
        """Forget residuals, warm-start matrices, the step count and byte totals; restart the seed stream."""
        self.rng = np.random.RandomState(self.random_seed)
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self.q_memory: dict[Hashable, torch.Tensor] = {}
        self._seen: set = set()
        self.step = 0
        self.last_nbytes: PowerSGDBytes | None = None
        self.total_dense_nbytes = 0
        self.total_sent_nbytes = 0

    def _settings(self) -> dict:
        return {"rank": self.rank, "start_iter": self.start_iter, "min_compression_rate": self.min_compression_rate,
                "use_error_feedback": self.use_error_feedback, "warm_start": self.warm_start,
                "orthogonalization_epsilon": self.orthogonalization_epsilon, "random_seed": self.random_seed}

    def state_dict(self) -> dict:
        """What the next steps depend on, for a checkpoint: resuming from it is the uninterrupted run.

        ``{"settings": the constructor's arguments but the group, "step": int, "residuals": {key: float32 (m, n)},
        "q_memory": {key: float32 (n, r)}, "seen": [keys met so far], "rng": the seed stream's numpy state}``,
        tensors cloned. The keys are this state's (``(bucket index, position)`` in the DDP hook), so the dict
        belongs to the rank that holds it and to the same bucket layout: the residuals are this rank's own
        errors, not the group's. The byte counters are statistics and are not included.
        """
        return {"settings": self._settings(), "step": self.step,
                "residuals": {k: v.detach().clone() for k, v in self.residuals.items()},
                "q_memory": {k: v.detach().clone() for k, v in self.q_memory.items()},
                "seen": sorted(self._seen, key=repr), "rng": self.rng.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned (on the same rank, with the same bucket layout).

        The tensors are taken as they are (cloned): put them on the gradients' device first.

        Raises:
            ValueError: the settings differ from this state's (the message shows both): residuals and Q
                matrices of another rank r, or of a run without warm start, would not line up.
        """
        saved = dict(state_dict["settings"])
        if saved != self._settings():
            raise ValueError(f"PowerSGDState.load_state_dict: saved with {saved}, this state has {self._settings()}; "
                             "build the state with the settings it was saved with, or start it afresh (reset())")
        self.reset()
        self.step = int(state_dict["step"])
        self.residuals = {k: v.clone() for k, v in state_dict["residuals"].items()}
        self.q_memory = {k: v.clone() for k, v in state_dict["q_memory"].items()}
        self._seen = set(state_dict["seen"])
        self.rng.set_state(state_dict["rng"])

    def __repr__(self) -> str:
        return (f"PowerSGDState(rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate:g}, use_error_feedback={self.use_error_feedback}, "
                f"warm_start={self.warm_start}, orthogonalization_epsilon={self.orthogonalization_epsilon:g}, "
                f"random_seed={self.random_seed}, step={self.step})")

    def _generator(self) -> torch.Generator:
        # One seed per call, drawn as PyTorch's hook draws it, then a CPU generator (device-independent draws).
        return torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))


def state_group(state: PowerSGDState, group=None):
    """The group PowerSGD averages over: ``group`` if given, else the state's ``process_group``, else the world."""
    if group is not None:
        return group
    if state.process_group is not None:
        return state.process_group
    return dist.group.WORLD


class PowerSGDCall:
    """One PowerSGD averaging of a list of tensors, in three stages around its two all-reduces.

    :func:`powersgd_all_reduce` runs the stages back to back; the DDP hook chains them on futures, so
    that backward continues while the collectives run.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], state: PowerSGDState, group, keys: Sequence[Hashable],
                 out: Sequence[torch.Tensor] | None):
        if len(keys) != len(tensors):
            raise ValueError(f"got {len(keys)} keys for {len(tensors)} tensors")
        for i, t in enumerate(tensors):
            if not t.is_floating_point():
                raise TypeError(f"PowerSGD averages floating-point tensors; tensor {i} is {t.dtype}")
        # Detached: the stages write P and Q with out= (and the averages into out), which autograd refuses
        # for tensors that require grad; gradients handed over by a caller often do (create_graph, hooks).
        self.tensors = [t.detach() for t in tensors]
        self.state, self.group, self.keys = state, group, list(keys)
        self.out_given = None if out is None else list(out)  # returned as given (torch's out= convention)
        if out is not None:
            if len(self.out_given) != len(tensors):
                raise ValueError(f"PowerSGD: got {len(self.out_given)} out tensors for {len(tensors)} tensors; "
                                 "give one per tensor")
            for i, (o, t) in enumerate(zip(self.out_given, tensors)):
                if o.shape != t.shape:
                    raise ValueError(f"PowerSGD: out[{i}] has shape {list(o.shape)}, tensor {i} {list(t.shape)}; "
                                     "each out tensor must have its tensor's shape")
        self.out = None if out is None else [o.detach() for o in self.out_given]
        self.world, _ = group_size_and_rank(group, "PowerSGD")
        self.layouts = [compressed_shape(t.shape, state.rank, state.min_compression_rate) for t in tensors]
        self.comp = [i for i, lay in enumerate(self.layouts) if lay is not None]
        self.unc = [i for i, lay in enumerate(self.layouts) if lay is None]
        for i in self.comp:
            m, n, r = self.layouts[i]
            key = self.keys[i]
            q = state.q_memory.get(key)
            e = state.residuals.get(key)
            if (q is not None and tuple(q.shape) != (n, r)) or (e is not None and tuple(e.shape) != (m, n)):
                raise ValueError(f"tensor {i} (key {key!r}, shape {tuple(self.tensors[i].shape)}) does not match "
                                 "the state remembered for that key; the tensors passed changed. Call "
                                 "state.reset() when changing the model")
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self.nbytes = powersgd_nbytes(tensors, state.rank, state.min_compression_rate)

    # ---- stage 1: M, Q, P = M Q; launch the all-reduce of P (with the float32 uncompressed tensors)
    def start(self) -> list[torch.futures.Future]:
        st, n_world = self.state, self.world
        self.ms = {}
        for i in self.comp:
            m, n, _ = self.layouts[i]
            mat = self.tensors[i].reshape(m, n).to(torch.float32)  # no copy for float32 input
            e = st.residuals.get(self.keys[i]) if st.use_error_feedback else None
            self.ms[i] = mat if e is None else mat + e

        fresh = (not st.warm_start) or any(k not in st._seen for k in self.keys)
        gen = st._generator() if fresh else None
        self.qs = {}
        # Group by matrix shape in order of first appearance: the order in which PyTorch's hook draws.
        by_shape: OrderedDict = OrderedDict()
        for i in self.comp:
            by_shape.setdefault(self.layouts[i][:2], []).append(i)
        for idxs in by_shape.values():
            for i in idxs:
                m, n, r = self.layouts[i]
                q = st.q_memory.get(self.keys[i]) if st.warm_start else None
                if q is None:
                    g = gen if gen is not None else st._generator()
                    gen = g
                    q = torch.randn(n, r, generator=g, dtype=torch.float32).to(self.device)
                orthogonalize_(q, st.orthogonalization_epsilon)
                self.qs[i] = q
        for i, q in self.qs.items():
            dead = q.abs().amax(dim=0) == 0
            if bool(dead.any()):
                # An all-zero gradient left this Q with zero columns; M @ 0 would keep P at zero forever.
                gen = gen if gen is not None else st._generator()
                q[:, dead] = torch.randn(q.shape[0], int(dead.sum()), generator=gen).to(q)
                orthogonalize_(q, st.orthogonalization_epsilon)

        # Buffer 0: float32 uncompressed tensors (divided by N first) followed by every P.
        groups: dict[torch.dtype, list[int]] = {}
        for i in self.unc:
            groups.setdefault(self.tensors[i].dtype, []).append(i)
        unc32 = groups.pop(torch.float32, [])
        n_unc32 = sum(self.tensors[i].numel() for i in unc32)
        n_p = sum(self.layouts[i][0] * self.layouts[i][2] for i in self.comp)
        self.buf0 = torch.empty(n_unc32 + n_p, dtype=torch.float32, device=self.device)
        self.unc_views = {}
        off = 0
        for i in unc32:
            k = self.tensors[i].numel()
            torch.div(self.tensors[i].reshape(-1), n_world, out=self.buf0[off:off + k])
            self.unc_views[i] = self.buf0[off:off + k]
            off += k
        self.ps = {}
        for i in self.comp:
            m, _, r = self.layouts[i]
            self.ps[i] = self.buf0[off:off + m * r].view(m, r)
            torch.matmul(self.ms[i], self.qs[i], out=self.ps[i])
            off += m * r
        futs = [dist.all_reduce(self.buf0, group=self.group, async_op=True).get_future()]
        # Other dtypes (bfloat16/float16 uncompressed tensors) travel in their own dtype, one buffer each.
        self.other_bufs = []
        for idxs in groups.values():
            buf = torch.cat([self.tensors[i].reshape(-1) for i in idxs]).div_(n_world)
            off = 0
            for i in idxs:
                k = self.tensors[i].numel()
                self.unc_views[i] = buf[off:off + k]
                off += k
            self.other_bufs.append(buf)
            futs.append(dist.all_reduce(buf, group=self.group, async_op=True).get_future())
        return futs

    # ---- stage 2: check, orthogonalize P, Q = M^T P_hat; launch the all-reduce of Q
    def middle(self) -> torch.futures.Future:
        for buf in [self.buf0, *self.other_bufs]:
            if buf.numel() and not bool(torch.isfinite(buf).all()):
                raise FloatingPointError(
                    "PowerSGD: a rank's gradient (or residual) holds NaN or inf: the all-reduced "
                    f"{'P/uncompressed' if buf is self.buf0 else buf.dtype} buffer is not finite. Every rank "
                    "raises here; residuals and warm-start matrices were not updated (skip this step, or "
                    "fix its cause)")
        st = self.state
        n_q = sum(self.layouts[i][1] * self.layouts[i][2] for i in self.comp)
        self.qbuf = torch.empty(n_q, dtype=torch.float32, device=self.device)
        off = 0
        self.q_views = {}
        for i in self.comp:
            _, n, r = self.layouts[i]
            orthogonalize_(self.ps[i], st.orthogonalization_epsilon)
            self.q_views[i] = self.qbuf[off:off + n * r].view(n, r)
            torch.matmul(self.ms[i].t(), self.ps[i], out=self.q_views[i])
            off += n * r
        if st.use_error_feedback and self.comp:
            # E = M - P_hat Q_local^T needs this rank's own Q, which the all-reduce overwrites: compute it now.
            self.new_residuals = {i: torch.addmm(self.ms[i], self.ps[i], self.q_views[i].t(), alpha=-1)
                                  for i in self.comp}
        return dist.all_reduce(self.qbuf, group=self.group, async_op=True).get_future()

    # ---- stage 3: approximation P_hat Q^T / N, residuals, warm start; outputs
    def finish(self) -> list[torch.Tensor]:
        st = self.state
        self.qbuf.div_(self.world)
        results: list[torch.Tensor | None] = [None] * len(self.tensors)
        for i in self.comp:
            approx = torch.matmul(self.ps[i], self.q_views[i].t())
            results[i] = approx.view(self.tensors[i].shape)
            if st.use_error_feedback:
                st.residuals[self.keys[i]] = self.new_residuals[i]
            if st.warm_start:
                st.q_memory[self.keys[i]] = self.q_views[i]
        for i in self.unc:
            results[i] = self.unc_views[i].view(self.tensors[i].shape)
        st._seen.update(self.keys)
        st.last_nbytes = self.nbytes
        st.total_dense_nbytes += self.nbytes.dense_nbytes
        st.total_sent_nbytes += self.nbytes.total_nbytes
        if self.out is not None:
            for o, res in zip(self.out, results):
                o.copy_(res)
            return list(self.out_given)
        # Every result lives in a buffer of this call (never in an input), so a cast is the only copy needed.
        return [res.to(t.dtype) for res, t in zip(results, self.tensors)]


def powersgd_all_reduce(tensors: Sequence[torch.Tensor], state: PowerSGDState,
                        group: dist.ProcessGroup | None = None, *, keys: Sequence[Hashable] | None = None,
                        out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Average ``tensors`` over the ranks of ``group`` with PowerSGD; every rank must call it alike.

    Args:
        tensors: this rank's gradients (any floating dtype and shape; all on one device).
        state: the :class:`PowerSGDState`; its residuals and warm-start matrices are read and updated,
            its :attr:`~PowerSGDState.last_nbytes` set. :attr:`~PowerSGDState.start_iter` and
            :attr:`~PowerSGDState.step` are not used here (this function always compresses).
        group: process group; default ``state.process_group``, then the world.
        keys: the state's key for each tensor (default: its index in ``tensors``).
        out: optional tensors to write the averages into (may be ``tensors`` themselves), one per tensor and of
            its shape.

    Returns:
        The averaged tensors, in their input shapes and dtypes: low-rank approximations of the average
        for compressed matrices, exact averages (up to rounding) for the others. Identical on all ranks.
        With ``out``, the ``out`` tensors themselves (as torch's ``out=``).

    Tensors that require grad are fine: the computation runs on detached views (the averages are not part
    of any autograd graph).

    Raises:
        TypeError: a non-floating-point tensor.
        ValueError: a tensor whose shape differs from the state remembered for its key; ``out`` of another
            length or shapes.
        FloatingPointError: some rank's gradient or residual holds NaN or inf (raised on every rank).
        RuntimeError: this rank is not a member of the group.
    """
    keys = list(range(len(tensors))) if keys is None else list(keys)
    call = PowerSGDCall(tensors, state, state_group(state, group), keys, out)
    for fut in call.start():
        fut.wait()
    call.middle().wait()
    return call.finish()
