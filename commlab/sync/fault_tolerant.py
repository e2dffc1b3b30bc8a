"""Per-step fault-tolerant data parallelism: a quorum each step, heal from a healthy replica, go on with fewer.

:class:`FaultTolerantDP` (the shape of torchft's Manager, on the course's pieces) runs in each replica of
:func:`commlab.launch.run_replicas`. Per step: :meth:`~FaultTolerantDP.start_step` agrees on a :class:`Quorum`
through the store (decided once with ``compare_set``, one round at a time), re-initialises the gloo group when
the members change, and copies model and optimizer state from the lowest healthy member to any member that is
behind; :meth:`~FaultTolerantDP.average_gradients` sums with the ring AllReduce, divides by the quorum's size and
copies buffers from the first member; :meth:`~FaultTolerantDP.should_commit` is a vote: all skip a failed step.
It does not handle: a failure inside a TP or PP group (that group still needs a restart), the loss of the store's
host (the parent: fatal), a loss of every replica holding the latest step (RuntimeError; so also a replacement
that arrives after the survivors finished), silent corruption or a NaN gradient (averaged into every replica, as
in DDP), RNG or data-loader state (the job derives its batch from ``step``), or a collective that hangs without a
peer dying (bounded by ``op_timeout_s`` only). Chapter "When it goes wrong", section "Survive a failure".
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
import time

import torch
import torch.distributed as dist

from commlab import checks
from commlab.collectives import p2p, ring_all_reduce

__all__ = ["FaultTolerantDP", "Quorum", "StepRecord"]

_P = "commlab/ft"                      # every key of the protocol lives under this prefix of the store
_ANNOUNCE = _P + "/{round}/announce/{replica}"   # JSON {"step": committed steps, "model": signature}
_DECISION = _P + "/{round}/decision"             # JSON {"members", "steps", "models"}, set once
_VOTE = _P + "/{round}/vote/{replica}"           # "1" averaged fine, "0" failed
_OUTCOME = _P + "/{round}/outcome"               # "commit" or "abort", set once
_PENDING = _P + "/pending/{replica}"             # a replica waiting to join (new, restarted or left out)
_LATEST = _P + "/latest"                         # a hint: some decided round (never ahead of the last)
_COMMITTED = _P + "/committed"                   # the most steps any quorum has committed
_POLL_S = 0.005


@dataclasses.dataclass(frozen=True)
class Quorum:
    """One step's agreement. id: the round (one per start_step, committed or not); step: committed steps of
    the healthy members; members: replicas in it (sorted; group rank = index); healthy: members at ``step``;
    joining: members behind it (new or restarted), healed before the step."""

    id: int
    step: int
    members: tuple[int, ...]
    healthy: tuple[int, ...]
    joining: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one round did on this replica: its quorum, whether the group was rebuilt, whom it healed from,
    whether the step was committed, the error that failed it (None if none), and seconds per phase
    (``quorum``, ``group``, ``heal``, ``allreduce``, ``commit``)."""

    quorum: Quorum
    reinitialised: bool
    healed_from: int | None
    committed: bool
    error: str | None
    seconds: dict


class FaultTolerantDP:
    """Data parallelism over whichever replicas are alive this step (see the module docstring for the loop).

    Args:
        ctx: the :class:`~commlab.launch.ReplicaContext` of this replica; model, optimizer: its model and
            optimizer (any ``torch.optim`` optimizer; state travels through ``state_dict``).
        min_replicas: fewest members a quorum may have (1..ctx.replicas); fewer blocks until quorum_timeout_s.
        join_timeout_s: how long a quorum waits for the previous members and known joiners before it forms
            with those who came (a dead replica costs this much once, unless the parent has seen it end).
        op_timeout_s: bound on the group's collectives, its rendezvous and the commit vote.
        quorum_timeout_s: bound on forming any quorum at all (then TimeoutError).

    Raises:
        ValueError: a bad argument (named), e.g. ``min_replicas > ctx.replicas``.
    """

    def __init__(self, ctx, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, min_replicas: int = 1,
                 join_timeout_s: float = 2.0, op_timeout_s: float = 10.0, quorum_timeout_s: float = 60.0):
        where = "FaultTolerantDP"
        # who and what
        self.ctx, self.model, self.optimizer = ctx, model, optimizer
        self.replica, self.replicas = ctx.replica, ctx.replicas
        # settings
        self.min_replicas = checks.integer("min_replicas", min_replicas, 1, ctx.replicas, where=where,
                                           note=f"there are {ctx.replicas} replicas")
        self.join_timeout_s, self.op_timeout_s, self.quorum_timeout_s = (
            checks.number(name, value, above=0, where=where, note="seconds")
            for name, value in (("join_timeout_s", join_timeout_s), ("op_timeout_s", op_timeout_s),
                                ("quorum_timeout_s", quorum_timeout_s)))
        # progress (equal on all healthy replicas)
        self.step = 0
        self.history: list[StepRecord] = []
        # this round
        self._round = 0
        self._joining = ctx.incarnation > 0
        self._quorum: Quorum | None = None
        self._error: str | None = None
        self._averaged = False
        self._phase: dict = {}
        self._reinit = False
        self._healed_from: int | None = None

    # ---------------------------------------------------------------------------------------- quorum
    def start_step(self) -> Quorum:
        """Join this step's quorum, rebuild the group if its members changed, heal if behind.

        Returns the :class:`Quorum`. Raises TimeoutError when no quorum of ``min_replicas`` forms within
        ``quorum_timeout_s``, RuntimeError when no member holds the latest committed step or when called twice
        without :meth:`should_commit`, ValueError (naming the replicas) when the members' models differ in
        parameter names, shapes or dtypes.
        """
        store, me = self.ctx.store, self.replica
        if self._quorum is not None:
            raise RuntimeError(f"replica {me}: start_step() twice in one step (round {self._quorum.id}): call "
                               "should_commit() to end a step before starting the next")
        if store is None:
            raise RuntimeError(f"replica {me}: ctx.store is None; FaultTolerantDP runs inside "
                               "commlab.launch.run_replicas, whose ReplicaContext holds the shared store")
        t0 = time.monotonic()
        self._error, self._averaged, self._healed_from, self._phase = None, False, None, {}
        if self._joining:
            store.set(_PENDING.format(replica=me), "1")
            self._round = self._next_open_round()
        announce = json.dumps({"step": self.step, "model": _signature(self.model)})
        while True:
            store.set(_ANNOUNCE.format(round=self._round, replica=me), announce)
            members, steps, models = self._decide(self._round)
            if me in members:
                break
            # Left out (arrived after the decision): wait for the next round as a known joiner.
            self._joining = True
            store.set(_PENDING.format(replica=me), "1")
            self._round = max(self._round + 1, self._next_open_round())
        if self._joining:
            store.delete_key(_PENDING.format(replica=me))
            self._joining = False
        _check_same_model(me, self._round, members, models)
        top = max(steps)
        committed = int(store.get(_COMMITTED)) if store.check([_COMMITTED]) else 0
        if top < committed:
            raise RuntimeError(f"replica {me}: no member of quorum {self._round} {members} holds the latest "
                               f"state ({committed} committed steps; members hold {steps}): every replica that "
                               "had it has ended (lost, or done with its job: a replacement that comes after the "
                               "survivors finish has nobody to heal from), so restart from a checkpoint or end")
        q = Quorum(id=self._round, step=top, members=members,
                   healthy=tuple(m for m, s in zip(members, steps) if s == top),
                   joining=tuple(m for m, s in zip(members, steps) if s < top))
        self._quorum = q
        self._phase["quorum"] = time.monotonic() - t0
        self._regroup(q)
        if q.joining and self._error is None:
            self._heal(q)
        return q

    def _next_open_round(self) -> int:
        store = self.ctx.store
        r = int(store.get(_LATEST)) if store.check([_LATEST]) else -1
        while store.check([_DECISION.format(round=r + 1)]):
            r += 1
        return r + 1

    def _members_of(self, rnd: int) -> tuple[int, ...] | None:
        if rnd < 0:
            return None
        key = _DECISION.format(round=rnd)
        if not self.ctx.store.check([key]):
            return None
        return tuple(json.loads(self.ctx.store.get(key))["members"])

    def _decide(self, rnd: int) -> tuple[tuple[int, ...], list[int], list[str]]:
        store = self.ctx.store
        key = _DECISION.format(round=rnd)
        previous = self._members_of(rnd - 1)
        if previous is None:
            previous = tuple(range(self.replicas)) if rnd == 0 else ()
        start = time.monotonic()
        opened = None  # when the previous round settled: the join timer runs from then
        while True:
            if store.check([key]):
                break
            gone = {r for r in range(self.replicas) if self.ctx.is_gone(r)}
            settled = self._settled(rnd - 1, gone)
            if settled is None:  # one round at a time: deciding while one is in flight splits the brain
                if time.monotonic() - start >= self.quorum_timeout_s:
                    raise TimeoutError(f"replica {self.replica}: round {rnd - 1} had no outcome within "
                                       f"quorum_timeout_s={self.quorum_timeout_s:g} s")
                time.sleep(_POLL_S)
                continue
            opened = opened or time.monotonic()
            came = {}
            for r in range(self.replicas):
                k = _ANNOUNCE.format(round=rnd, replica=r)
                if r not in gone and store.check([k]):
                    came[r] = json.loads(store.get(k))
            pending = {r for r in range(self.replicas) if store.check([_PENDING.format(replica=r)])}
            expected = (set(previous) | pending) - gone
            waited = time.monotonic() - opened
            # Never form without a holder of the latest state while one may still come: joiners alone (the
            # survivors slower than join_timeout_s) could only fail. Once every holder has ended, form (and fail).
            committed = max(settled, int(store.get(_COMMITTED)) if store.check([_COMMITTED]) else 0)
            holder = any(a["step"] >= committed for a in came.values())
            awaited = set(range(self.replicas)) - gone - set(came)
            if len(came) >= self.min_replicas and (expected <= set(came) or waited >= self.join_timeout_s) \
                    and (holder or not awaited):
                members = sorted(came)
                payload = json.dumps({"members": members, "steps": [came[m]["step"] for m in members],
                                      "models": [came[m]["model"] for m in members]})
                store.compare_set(key, "", payload)
                store.set(_LATEST, str(rnd))
                break
            if time.monotonic() - start >= self.quorum_timeout_s:
                raise TimeoutError(
                    f"replica {self.replica}: no quorum of at least min_replicas={self.min_replicas} formed for "
                    f"round {rnd} within quorum_timeout_s={self.quorum_timeout_s:g} s (came: {sorted(came)}, "
                    f"expected: {sorted(expected)}, gone: {sorted(gone)})")
            time.sleep(_POLL_S)
        decision = json.loads(store.get(key))
        return tuple(decision["members"]), list(decision["steps"]), list(decision["models"])

    def _settled(self, rnd: int, gone: set) -> int | None:
        """Committed steps after round ``rnd`` once it has an outcome (or all its members are gone), else None."""
        store = self.ctx.store
        if rnd < 0 or not store.check([_DECISION.format(round=rnd)]):
            return 0
        decision = json.loads(store.get(_DECISION.format(round=rnd)))
        key = _OUTCOME.format(round=rnd)
        if store.check([key]):
            return max(decision["steps"]) + (store.get(key) == b"commit")
        return max(decision["steps"]) if set(decision["members"]) <= gone else None

    # ----------------------------------------------------------------------------------------- group
    def _regroup(self, q: Quorum) -> None:
        t0 = time.monotonic()
        store = self.ctx.store
        previous = self._members_of(q.id - 1)
        same = previous == q.members and store.check([_OUTCOME.format(round=q.id - 1)]) and \
            store.get(_OUTCOME.format(round=q.id - 1)) == b"commit"
        self._reinit = not (same and dist.is_initialized())
        if self._reinit:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()  # measured: returns in ~20 ms even after a peer was killed
                dist.init_process_group("gloo", store=dist.PrefixStore(f"quorum/{q.id}", store),
                                        rank=q.members.index(self.replica), world_size=len(q.members),
                                        timeout=datetime.timedelta(seconds=self.op_timeout_s))
            except Exception as e:  # noqa: BLE001 - a member gone during the rendezvous fails this step
                self._error = f"group: {type(e).__name__}: {e}"
        self._phase["group"] = time.monotonic() - t0

    def _heal(self, q: Quorum) -> None:
        t0 = time.monotonic()
        src = min(q.healthy)
        src_rank = q.members.index(src)
        try:
            if self.replica == src:
                buf = io.BytesIO()
                torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                            "step": self.step}, buf)
                payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
                peers = [q.members.index(j) for j in q.joining]   # the quorum's group: rank = index in members
                size = torch.tensor([payload.numel()], dtype=torch.int64)
                p2p.exchange(sends=[(size, p) for p in peers]).wait()
                p2p.exchange(sends=[(payload, p) for p in peers]).wait()
            elif self.replica in q.joining:
                n = torch.zeros(1, dtype=torch.int64)
                p2p.exchange(recvs=[(n, src_rank)]).wait()
                payload = torch.empty(int(n.item()), dtype=torch.uint8)
                p2p.exchange(recvs=[(payload, src_rank)]).wait()
                state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                self.step = int(state["step"])
                self._healed_from = src
        except Exception as e:  # noqa: BLE001 - the step fails, the joiner tries again next round
            self._error = f"heal: {type(e).__name__}: {e}"
        self._phase["heal"] = time.monotonic() - t0

    # ------------------------------------------------------------------------------------ the step
    def average_gradients(self) -> None:
        """Replace each parameter's ``.grad`` by its mean over the quorum (ring AllReduce sum / quorum size),
        and each buffer (BatchNorm's running statistics) by the first member's, as DDP broadcasts rank 0's; a
        parameter without a gradient counts as zeros (it gets a zero gradient, not None).

        A collective that fails (a peer killed: gloo raises "Connection closed by peer" within milliseconds;
        a peer stuck: after ``op_timeout_s``) is recorded, not raised: :meth:`should_commit` then says False.
        """
        t0 = time.monotonic()
        self._averaged = True
        if self._quorum is None:
            raise RuntimeError("average_gradients() before start_step(): call start_step() first in each step")
        if self._error is not None:  # the group or the heal failed: peers must not wait op_timeout_s for us
            if dist.is_initialized():
                dist.destroy_process_group()
            self._phase["allreduce"] = time.monotonic() - t0
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        try:
            # check=False: start_step checked that every member holds a model of the same layout.
            ring_all_reduce(flat, inplace=True, check=False)
            for b in self.model.buffers():  # BatchNorm's statistics: the first member's, as DDP broadcasts them
                dist.broadcast(b, src=0)
        except Exception as e:  # noqa: BLE001 - recorded; the vote fails the step everywhere
            self._error = f"allreduce: {type(e).__name__}: {e}"
            # Close this member's connections now: a peer blocked on a receive from it (not from the dead
            # one) then fails at once instead of at op_timeout_s. The next round rebuilds the group anyway.
            dist.destroy_process_group()
            self._phase["allreduce"] = time.monotonic() - t0
            return
        flat.div_(len(self._quorum.members))  # the divisor follows the quorum
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype, copy=True)  # cat promotes dtypes
            offset += p.numel()
        self._phase["allreduce"] = time.monotonic() - t0

    def should_commit(self) -> bool:
        """Vote through the store: True on every member iff every member averaged without error.

        The first member to see the outcome writes it with ``compare_set``; all follow it, so the survivors of
        a failed step all skip ``optimizer.step()`` and stay bit-identical. A member that neither votes nor
        ends within ``op_timeout_s`` fails the step. On True, :attr:`step` grows by one and is published.
        """
        t0 = time.monotonic()
        q = self._quorum
        if q is None:
            raise RuntimeError("should_commit() before start_step(): call start_step() first in each step")
        if not self._averaged and self._error is None:
            self._error = "average_gradients() was not called in this step"
        store = self.ctx.store
        ok = self._error is None and len(q.members) >= self.min_replicas
        store.set(_VOTE.format(round=q.id, replica=self.replica), "1" if ok else "0")
        key = _OUTCOME.format(round=q.id)
        while not store.check([key]):
            votes = {m: store.get(_VOTE.format(round=q.id, replica=m))
                     for m in q.members if store.check([_VOTE.format(round=q.id, replica=m)])}
            lost = any(m not in votes and self.ctx.is_gone(m) for m in q.members)
            if b"0" in votes.values() or lost or time.monotonic() - t0 >= self.op_timeout_s:
                store.compare_set(key, "", "abort")
            elif len(votes) == len(q.members):
                store.compare_set(key, "", "commit")
            else:
                time.sleep(_POLL_S)
        committed = store.get(key) == b"commit"
        if committed:
            self.step += 1
            if self.step > (int(store.get(_COMMITTED)) if store.check([_COMMITTED]) else 0):
                store.set(_COMMITTED, str(self.step))
            self.ctx.publish_step(self.step)
        self._phase["commit"] = time.monotonic() - t0
        self.history.append(StepRecord(quorum=q, reinitialised=self._reinit, healed_from=self._healed_from,
                                       committed=committed, error=self._error, seconds=dict(self._phase)))
        self._round = q.id + 1
        self._quorum = None
        return committed


def _signature(model: torch.nn.Module) -> str:
    """What must agree across members: gradient elements, dtypes and a digest of names, shapes and dtypes."""
    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters() if p.requires_grad]
    buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dtypes = "/".join(sorted({d.replace("torch.", "") for _, _, d in params})) or "none"
    digest = hashlib.sha1(repr((params, buffers)).encode()).hexdigest()[:8]
    return f"{numel} gradient elements ({dtypes}), layout {digest}"


def _check_same_model(me: int, rnd: int, members, models) -> None:
    """ValueError naming the members whose model differs from the most common one (ties: the lowest member's)."""
    if len(set(models)) <= 1:
        return
    common = max(models, key=lambda m: (models.count(m), -models.index(m)))
    odd = [(r, m) for r, m in zip(members, models) if m != common]
    others = [r for r, m in zip(members, models) if m == common]
    raise ValueError(f"replica {me}: the members of quorum {rnd} hold different models, so their gradients cannot "
                     "be averaged nor their state copied: " + "; ".join(f"replica {r} has {m}" for r, m in odd) +
                     f"; replicas {others} have {common}. Build the same model (shapes, dtypes) on every replica")
