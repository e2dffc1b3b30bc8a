"""The per-node command of a multi-node job: torchrun with a preflight, a named rendezvous and a deadline.

Run on every node, with torchrun's own arguments, unchanged::

    python -m commlab.launch.torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 \\
        --rdzv-backend c10d --rdzv-endpoint HEAD:29400 --rdzv-id JOB --max-restarts 0 \\
        --rdzv-conf join_timeout=120 -m commlab selftest

It starts ``python -m torch.distributed.run`` with those arguments (in a session of its own) and adds what
torchrun 2.13 lacks in three failures, each measured with two agents on one machine:

* **A node that never joins.** The head's torchrun waits ``join_timeout`` (default 600 s) and then ends with a
  bare ``torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError``: no message, no word of who came.
  Here every node registers in the rendezvous store (``commlab/<run id>/node/<node rank>`` = its host name)
  and, when the rendezvous fails, node 0 prints which nodes joined and which never did.
* **A port already in use.** With ``--rdzv-backend c10d`` the agent whose host matches the endpoint tries to
  host the store there and, if it cannot, connects as a client to whatever listens on the port. A client's
  handshake with a program that is not a torch store has no timeout: torchrun then hangs, silently, for good
  (measured: over 150 s with ``read_timeout=10``). Here node 0 checks the port before torchrun starts and
  stops at once, naming it, and saying so when what holds it is a torch store (another node 0: two nodes
  started with ``--node-rank 0``, or another job on the same port); a node whose endpoint accepts connections but never answers as a store gives
  up after :data:`PROBE_S` seconds and says so.
* **Which node hosts the store, and for how long.** torchrun ignores ``--node-rank`` with c10d (it prints so)
  and guesses the host from host names. Here ``--node-rank`` decides, so no node silently joins a store left
  by another job; under SLURM, without ``--node-rank``, ``SLURM_NODEID`` is used. Node 0's command hosts the
  store itself and every torchrun joins it with ``is_host=0`` (unless ``is_host`` is given, which is then
  left to torchrun). The reason is a race: torchrun 2.13's agent returns at once when a worker fails, with no
  exit barrier, and when that agent hosted the store the store goes with it. The other nodes' agents, still
  watching workers that are only now reacting to the failure, then crash with ``RendezvousConnectionError``
  and never print their "Root Cause" summary (measured: 2 runs in 9 on two agents on one machine). Node 0
  therefore keeps the store up after its torchrun ends, until every node that registered has said its
  torchrun ended, for at most :data:`LINGER_S` seconds.

Nothing waits without a deadline: if the rendezvous has not completed ``join_timeout`` + :data:`MARGIN_S`
seconds after the start, torchrun is stopped and the node says so. SIGTERM and SIGINT (``scancel``, Ctrl-C)
are passed on to torchrun, which stops its workers. The exit status is torchrun's (1 where this command
stopped it). Everything this command itself prints starts with ``[commlab node N]``, on stderr.

:func:`run_local_nodes` starts several such nodes on this machine (loopback), as the tests and
``python -m commlab bench --torchrun 2x2`` do; :func:`run_standalone` runs one single-node torchrun job
(``--standalone``) from a notebook or a test and returns what it printed, and :func:`tidy_output` makes that
text the same from run to run (no process ids, ports, host names, times or machine paths) so that a notebook
can show it.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

__all__ = ["main", "node_command", "run_local_nodes", "free_port", "NodeResult", "PROBE_S", "MARGIN_S", "LINGER_S",
           "DEFAULT_C10D_PORT", "run_standalone", "StandaloneResult", "tidy_output"]

#: Seconds a node gives an endpoint that accepts TCP connections to answer as a torch store (the handshake
#: takes milliseconds; a program that is not a store never answers).
PROBE_S = 10.0
#: Seconds past ``join_timeout`` before a rendezvous that never completed is given up on (start-up and
#: torchrun's own last call).
MARGIN_S = 30.0
#: Seconds node 0 keeps the rendezvous store up after its own torchrun ended, waiting for the other nodes'
#: torchruns to end (each node's agent reads the store until its workers have ended).
LINGER_S = 30.0
#: torchrun's port for ``--rdzv-endpoint HOST`` without one (``torch/distributed/elastic/rendezvous``).
DEFAULT_C10D_PORT = 29400
_TORCH_JOIN_TIMEOUT_S = 600.0  # torchrun's default join_timeout
_PORT_PROBE_S = 3.0  # node 0's look at a taken port: a torch store answers in milliseconds
_POLL_S = 0.5


def _say(node: int | str, text: str) -> None:
    print(f"[commlab node {node}] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ reading the arguments

@dataclasses.dataclass(frozen=True)
class _Plan:
    argv: list[str]            # what torchrun receives
    c10d: bool                 # a c10d rendezvous at an endpoint: the additions apply
    node_rank: int
    min_nodes: int
    max_nodes: int
    host: str
    port: int
    run_id: str
    join_timeout_s: float
    hosts_store: bool          # this command (node 0) hosts the rendezvous store, not torchrun


class _Refused(Exception):
    """Arguments this command cannot run with (the message says why and what to pass)."""


def _option_span(argv: Sequence[str], names: Sequence[str]) -> tuple[int, int] | None:
    """(start, end) of the first ``--name VALUE`` or ``--name=VALUE`` in ``argv``."""
    for i, tok in enumerate(argv):
        for name in names:
            if tok == name:
                return i, i + 2
            if tok.startswith(name + "="):
                return i, i + 1
    return None


def _plan(argv: Sequence[str], environ) -> _Plan:
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    argv = list(argv)
    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its usage message (or, for --help, torchrun's help)
        if e.code in (0, None):
            raise
        raise _Refused("torchrun could not read these arguments (see above)") from e
    # torchrun's own options end where the training script begins.
    tail = [args.training_script, *args.training_script_args]
    split = len(argv) - len(tail)
    if split < 0 or argv[split:] != tail:
        raise _Refused("could not find where torchrun's options end and the job's arguments begin")
    opts, job = argv[:split], argv[split:]
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    c10d = args.rdzv_backend == "c10d" and not args.standalone and bool(args.rdzv_endpoint)
    node_rank = args.node_rank
    if _option_span(opts, ("--node-rank", "--node_rank")) is None:
        if re.fullmatch(r"[0-9]+", environ.get("SLURM_NODEID", "").strip()):
            node_rank = int(environ["SLURM_NODEID"])
            if not c10d:
                opts = ["--node-rank", str(node_rank)] + opts
        elif c10d and max_nodes > 1:
            raise _Refused(f"--nnodes {args.nnodes} needs --node-rank on every node (0 on the node at "
                           f"--rdzv-endpoint {args.rdzv_endpoint}, which hosts the rendezvous; 1..{max_nodes - 1} "
                           "on the others)")
    if not 0 <= node_rank < max_nodes:
        raise _Refused(f"--node-rank {node_rank} is out of range: allowed 0..{max_nodes - 1} (--nnodes {args.nnodes})")
    host, port, run_id, join_timeout, hosts_store = "", 0, args.rdzv_id, _TORCH_JOIN_TIMEOUT_S, False
    if c10d:
        host, _, port_text = args.rdzv_endpoint.rpartition(":")
        if not host:  # no port given: torchrun's default
            host, port_text = args.rdzv_endpoint, str(DEFAULT_C10D_PORT)
        host = host.strip("[]")
        if not re.fullmatch(r"[0-9]+", port_text) or not 1 <= int(port_text) <= 65535:
            raise _Refused(f"--rdzv-endpoint {args.rdzv_endpoint}: the port must be an integer 1..65535")
        port = int(port_text)
        conf = {}
        for item in (args.rdzv_conf or "").split(","):
            if item.strip():
                key, _, value = item.partition("=")
                conf[key.strip()] = value.strip()
        if "join_timeout" in conf:
            try:
                join_timeout = float(conf["join_timeout"])
            except ValueError:
                raise _Refused(f"--rdzv-conf join_timeout={conf['join_timeout']!r} is not a number of "
                               "seconds") from None
        hosts_store = node_rank == 0 and "is_host" not in conf
        conf.setdefault("is_host", "0")  # node 0's store is this command's (see the module's docstring)
        for names in (("--rdzv-conf", "--rdzv_conf"), ("--node-rank", "--node_rank")):
            # --node-rank is this command's: torchrun ignores it with c10d, and would print that it does.
            span = _option_span(opts, names)
            if span is not None:
                del opts[span[0]:span[1]]
        opts = ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())] + opts
    return _Plan(argv=opts + job, c10d=c10d, node_rank=node_rank, min_nodes=min_nodes, max_nodes=max_nodes,
                 host=host, port=port, run_id=run_id, join_timeout_s=join_timeout, hosts_store=hosts_store)


# ----------------------------------------------------------------------------------------- the port

def _port_taken(host: str, port: int) -> str | None:
    """Why node 0 cannot host the store at ``host:port`` (None if it can): bound the way TCPStore binds."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"the host name {host!r} of --rdzv-endpoint does not resolve ({e.strerror})"
    for family, kind, proto, _, addr in infos:
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
            return None
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                state, _ = _store_client(host, port, _PORT_PROBE_S)
                if state == "store":
                    return (f"port {port} on {host} is already taken by a torch rendezvous store: another node 0 "
                            "runs there (was a second node started with --node-rank 0? only the node at "
                            "--rdzv-endpoint is 0, the others 1..N-1), or a torchrun of another job uses this "
                            "port. Give each node its own --node-rank, or pick another port for --rdzv-endpoint")
                return (f"port {port} on {host} is already in use by another program, so the rendezvous store "
                        f"cannot start there. Pick another port for --rdzv-endpoint (`ss -ltnp 'sport = :{port}'` "
                        "on this node shows who holds it)")
            if e.errno == errno.EADDRNOTAVAIL:
                return (f"{host} is not an address of this machine, but node 0 hosts the rendezvous store at "
                        f"--rdzv-endpoint {host}:{port}: run node 0 on {host}, or point --rdzv-endpoint at "
                        "node 0's host")
            last = e
        finally:
            s.close()
    return f"cannot bind {host}:{port}: {last}"


def _store_client(host: str, port: int, wait_s: float):
    """What answers at ``host:port``: ``("store", client)`` (a torch TCPStore), ``("not a store", None)`` (it
    accepts connections but the store handshake, which has no timeout of its own, did not finish within
    ``wait_s``) or ``("nothing", None)`` (nothing listens, or the handshake failed)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            pass
    except OSError:
        return "nothing", None
    import torch.distributed as dist

    box: list = []

    def make():
        try:
            box.append(dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                     timeout=datetime.timedelta(seconds=wait_s)))
        except Exception as e:  # noqa: BLE001
            box.append(e)

    t = threading.Thread(target=make, daemon=True)
    t.start()
    t.join(wait_s)
    if not box:
        return "not a store", None
    return ("nothing", None) if isinstance(box[0], Exception) else ("store", box[0])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bound to port 0, read, released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------------------------- the watcher

class _Watcher:
    """Registers this node in the rendezvous store and follows how many nodes have joined."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.state = "no store yet"   # "no store yet" | "not a store" | "connected" | "gone"
        self.joined = 0               # nodes registered, as last read
        self.names: dict[int, str] = {}  # node rank -> host (read by node 0 only)
        self.complete = threading.Event()
        self.store = None             # the store client, once connected
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="commlab-rendezvous-watch")

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()

    def _key(self, what: str) -> str:
        return f"commlab/{self.plan.run_id}/{what}"

    def _connect(self):
        """A TCPStore client, or None while nothing listens; sets state "not a store" if the handshake hangs."""
        state, store = _store_client(self.plan.host, self.plan.port, PROBE_S)
        if state == "not a store":
            self.state = "not a store"
        return store

    def _run(self):
        p = self.plan
        store = None
        while not self._stop.is_set() and store is None:
            store = self._connect()
            if self.state == "not a store":
                return
            if store is None:
                self._stop.wait(_POLL_S)
        if store is None:
            return
        self.store = store
        self.state = "connected"
        try:
            store.set(self._key(f"node/{p.node_rank}"), socket.gethostname())
            store.add(self._key("joined"), 1)
            while not self._stop.is_set():
                self.joined = int(store.add(self._key("joined"), 0))
                if p.node_rank == 0:
                    for r in range(p.max_nodes):
                        if r not in self.names and store.check([self._key(f"node/{r}")]):
                            self.names[r] = store.get(self._key(f"node/{r}")).decode(errors="replace")
                if self.joined >= p.min_nodes:
                    self.complete.set()
                    return
                self._stop.wait(_POLL_S)
        except Exception:  # noqa: BLE001 - the store went away (torchrun on node 0 ended)
            self.state = "gone"

    def say_ended(self) -> None:
        """Tell node 0 (through the store) that this node's torchrun has ended; nothing if there is no store."""
        if self.store is not None and self.state == "connected":
            try:
                self.store.add(self._key("ended"), 1)
            except Exception:  # noqa: BLE001 - node 0 has gone: nobody waits for the word
                pass

    def report(self) -> str:
        p = self.plan
        where = f"the rendezvous '{p.run_id}' at {p.host}:{p.port}"
        if self.state == "not a store":
            return (f"{p.host}:{p.port} accepts connections but does not answer as a torch rendezvous store "
                    f"within {PROBE_S:g} s: the port is used by another program. Pick another port for "
                    "--rdzv-endpoint, the same on every node")
        if self.state == "no store yet":
            return (f"no rendezvous store answered at {p.host}:{p.port}: node 0 did not start, failed, or had "
                    "already given up. Start node 0 first (or together), with the same --rdzv-endpoint")
        need = f"{p.min_nodes}" if p.min_nodes == p.max_nodes else f"{p.min_nodes} to {p.max_nodes}"
        text = f"{where} did not complete (torchrun's own error is above): {self.joined} of {need} nodes had joined"
        if p.node_rank == 0 and self.names:
            came = ", ".join(f"node {r} ({h})" for r, h in sorted(self.names.items()))
            missing = [r for r in range(p.max_nodes) if r not in self.names]
            text += f" ({came}); never joined: " + ", ".join(f"node {r}" for r in missing)
        elif p.node_rank != 0:
            text += " (node 0's output names them)"
        return (text + f". Start the same command on every node (same --nnodes, --rdzv-id and --rdzv-endpoint, "
                f"each with its own --node-rank) and check that every node reaches {p.host}:{p.port}; nodes that "
                f"start more than join_timeout={p.join_timeout_s:g} s apart need a larger --rdzv-conf join_timeout")


# --------------------------------------------------------------------------------------------- running

def _stop_session(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM to torchrun's session (torchrun then stops its workers), SIGKILL after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def _has_children(pid: int) -> bool:
    """Whether process ``pid`` has started processes (torchrun's workers: the rendezvous completed)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return bool(f.read().split())
    except OSError:
        pass
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False  # no /proc: only the nodes' own count tells
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        return True
            except (OSError, IndexError, ValueError):
                continue
    return False


def _host_store(plan: _Plan):
    """Node 0's rendezvous store, served from this process (torchrun's agents join it as clients)."""
    import torch.distributed as dist

    return dist.TCPStore(plan.host, plan.port, is_master=True, multi_tenant=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=PROBE_S))


def _linger(store, plan: _Plan) -> None:
    """Keep node 0's store up until every registered node's torchrun has ended, or :data:`LINGER_S` passed."""
    key = f"commlab/{plan.run_id}/"
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        try:
            if int(store.add(key + "ended", 0)) >= int(store.add(key + "joined", 0)):
                return
        except Exception:  # noqa: BLE001 - the store is this process's own; nothing to wait for if it broke
            return
        time.sleep(_POLL_S / 5)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m commlab.launch.torchrun [torchrun options] SCRIPT|-m MODULE [args]``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)  # torchrun gets the environment as it was
    # This process's own store client logs a C++ warning with a stack trace when node 0's store closes at the
    # end of the rendezvous; that is expected here, not news (read when torch is first imported, just below).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        plan = _plan(argv, env)
    except _Refused as e:
        _say("?", str(e))
        return 2
    node = plan.node_rank
    if plan.c10d and node == 0:
        problem = _port_taken(plan.host, plan.port)
        if problem:
            _say(node, problem)
            return 1
    store = None
    if plan.hosts_store:
        try:
            store = _host_store(plan)
        except Exception as e:  # noqa: BLE001 - TCPStore says RuntimeError or DistNetworkError
            _say(node, f"cannot host the rendezvous store at {plan.host}:{plan.port}: {e}")
            return 1
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *plan.argv], env=env,
                            start_new_session=True)
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    watcher = _Watcher(plan) if plan.c10d else None
    stopped_by_us = None
    try:
        if watcher is not None:
            watcher.start()
            deadline = time.monotonic() + plan.join_timeout_s + MARGIN_S
            # Done watching once the nodes have registered, or once torchrun has started its workers (its
            # rendezvous completed, whatever the count says: a node may run plain torchrun).
            next_look = 0.0
            while proc.poll() is None and not watcher.complete.is_set():
                if time.monotonic() >= next_look:
                    if _has_children(proc.pid):
                        watcher.complete.set()
                        break
                    next_look = time.monotonic() + 1.0
                if watcher.state == "not a store":
                    stopped_by_us = "the endpoint is not a rendezvous store"
                    break
                if time.monotonic() >= deadline:
                    stopped_by_us = (f"the rendezvous had not completed {plan.join_timeout_s + MARGIN_S:g} s after "
                                     "the start")
                    break
                time.sleep(0.1)
            if stopped_by_us:
                _say(node, f"stopping torchrun: {stopped_by_us}")
                _stop_session(proc)
        rc = proc.wait()
        if watcher is not None:
            watcher.stop()
            watcher.say_ended()
        if store is not None and not received:
            _linger(store, plan)
    finally:
        if proc.poll() is None:
            _stop_session(proc)
        if watcher is not None:
            watcher.stop()
        for s, h in old.items():
            signal.signal(s, h)
    if watcher is not None and not watcher.complete.is_set() and (rc != 0 or stopped_by_us) and not received:
        _say(node, watcher.report())
    if rc != 0 and not received:
        _say(node, f"torchrun ended with exit status {rc}")
    return 1 if (stopped_by_us and rc == 0) or rc < 0 else rc


def node_command(node_rank: int, nnodes: int, nproc_per_node: int, endpoint: str, run_id: str,
                 job: Sequence[str], *, join_timeout_s: float = 60.0, python: str | None = None,
                 local_addr: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The documented per-node command line, as a list: this module with torchrun's arguments.

    Args:
        node_rank: this node's index (0 hosts the rendezvous store at ``endpoint``).
        nnodes, nproc_per_node: torchrun's ``--nnodes`` and ``--nproc-per-node``.
        endpoint: ``HOST:PORT`` of node 0.
        run_id: the same on every node of one job (SLURM: the job id).
        job: what every worker runs, e.g. ``["-m", "commlab", "selftest"]`` or ``["train.py", "--lr", "1e-3"]``.
        join_timeout_s: seconds node 0 waits for the others (torchrun's ``join_timeout``).
        python: the interpreter (default this one).
        local_addr: torchrun's ``--local-addr`` (the address the workers publish; on one machine 127.0.0.1
            avoids looking the host's own name up).
        extra: further torchrun options.
    """
    cmd = [python or sys.executable, "-m", "commlab.launch.torchrun", "--nnodes", str(nnodes), "--node-rank",
           str(node_rank), "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
           endpoint, "--rdzv-id", run_id, "--max-restarts", "0", "--rdzv-conf", f"join_timeout={join_timeout_s:g}"]
    if local_addr:
        cmd += ["--local-addr", local_addr]
    return cmd + list(extra) + list(job)


@dataclasses.dataclass(frozen=True)
class NodeResult:
    """One node of :func:`run_local_nodes`.

    Attributes:
        node_rank: the node. returncode: its exit status. output: what it printed (stdout and stderr).
        stopped: True if it was still running at the deadline and had to be stopped.
    """

    node_rank: int
    returncode: int
    output: str
    stopped: bool = False


def run_local_nodes(nnodes: int, nproc_per_node: int, job: Sequence[str], *, timeout_s: float = 120.0,
                    join_timeout_s: float = 30.0, nodes: Sequence[int] | None = None, port: int | None = None,
                    run_id: str | None = None, env: dict | None = None, stream_node0: bool = False) -> list[NodeResult]:
    """Start ``nnodes`` torchrun "nodes" on this machine (loopback) running ``job``; wait for all of them.

    Each node is :func:`node_command` in a session of its own, with ``OMP_NUM_THREADS=1`` (which is also
    what torchrun would set, with a banner). Nodes still running after ``timeout_s`` are sent SIGTERM (which
    stops torchrun and its workers), then SIGKILL.

    Args:
        nodes: which node ranks to start (default all; fewer makes a node that never joins).
        port: rendezvous port on 127.0.0.1 (default a free one, see :func:`free_port`).
        run_id: the rendezvous id (default one made from this process's id and the port).
        env: extra environment variables for every node.
        stream_node0: let node 0 write to this process's stdout/stderr as it runs (its output is then not
            captured).

    Returns:
        One :class:`NodeResult` per started node, in node order.
    """
    port = free_port() if port is None else port
    run_id = run_id or f"commlab-{os.getpid()}-{port}"
    base_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    procs, files = [], []
    for r in (range(nnodes) if nodes is None else nodes):
        cmd = node_command(r, nnodes, nproc_per_node, f"127.0.0.1:{port}", run_id, job,
                           join_timeout_s=join_timeout_s, local_addr="127.0.0.1")
        if stream_node0 and r == 0:
            out = None
        else:
            out = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        files.append(out)
        procs.append((r, subprocess.Popen(cmd, env=base_env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                          start_new_session=True)))
    deadline = time.monotonic() + timeout_s
    results, stopped = [], set()
    try:
        for _, p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for r, p in procs:
            if p.poll() is None:
                stopped.add(r)
                _stop_session(p, grace_s=20.0)  # the node forwards SIGTERM to torchrun, which stops its workers
        for (r, p), f in zip(procs, files):
            text = ""
            if f is not None:
                f.seek(0)
                text = f.read()
                f.close()
            results.append(NodeResult(r, p.returncode, text, r in stopped))
    return results


# ------------------------------------------------------------------------- one node, from a notebook

@dataclasses.dataclass(frozen=True)
class StandaloneResult:
    """One :func:`run_standalone` job.

    Attributes:
        returncode: torchrun's exit status (non-zero if a worker failed; negative if it was stopped).
        stdout, stderr: what torchrun and its workers printed, each stream whole (workers share them).
        seconds: wall seconds from the start to the end (or to the stop).
        stopped: True if the job was still running after ``timeout_s`` and had to be stopped.
    """

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    stopped: bool = False

    def check(self) -> "StandaloneResult":
        """This result if the job succeeded, else RuntimeError with its exit status and the end of its stderr."""
        if self.returncode != 0 or self.stopped:
            why = "was stopped at its deadline" if self.stopped else f"exited with status {self.returncode}"
            raise RuntimeError(f"the torchrun job {why}; the end of its stderr:\n{self.stderr[-4000:]}")
        return self


def run_standalone(job: Sequence[str], nproc_per_node: int, *, timeout_s: float = 120.0, env: dict | None = None,
                   cwd: str | None = None, torchrun_args: Sequence[str] = (),
                   python: str | None = None) -> StandaloneResult:
    """Run ``job`` on ``nproc_per_node`` workers of one torchrun on this machine and wait for it.

    The command is ``python -m torch.distributed.run --standalone --nproc-per-node N --max-restarts 0
    [torchrun_args] JOB``: ``--standalone`` makes torchrun host its own c10d rendezvous on a free local port,
    so nothing needs choosing. It runs in a session of its own with ``OMP_NUM_THREADS=1`` unless the
    environment sets it (which is also what torchrun would set, with a banner); a job still running after
    ``timeout_s`` is sent SIGTERM (torchrun then stops its workers), then SIGKILL, and nothing is left behind.

    Args:
        job: what every worker runs, as torchrun takes it: ``["train.py", "--steps", "3"]`` or
            ``["-m", "commlab", "selftest"]``.
        nproc_per_node: workers (ranks), >= 1.
        timeout_s: seconds before the job is stopped (> 0).
        env: extra environment variables for torchrun and its workers (e.g. ``TORCH_DISTRIBUTED_DEBUG``).
        cwd: the working directory (default this process's).
        torchrun_args: further torchrun options (after the defaults, so they win: ``["--max-restarts", "1"]``).
        python: the interpreter (default this one).

    Returns:
        A :class:`StandaloneResult`; its ``check()`` raises if the job failed.

    Raises:
        ValueError: an empty ``job``, ``nproc_per_node`` < 1 or ``timeout_s`` <= 0.
    """
    if not job:
        raise ValueError("run_standalone: job is empty; pass a script and its arguments, or ['-m', MODULE, ...]")
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"run_standalone: nproc_per_node must be an int >= 1, got {nproc_per_node!r}")
    if not timeout_s > 0:
        raise ValueError(f"run_standalone: timeout_s must be > 0 seconds, got {timeout_s!r}")
    cmd = [python or sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc_per_node), "--max-restarts", "0", *torchrun_args, *job]
    full_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    start = time.monotonic()
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as out, \
            tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as err:
        proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        stopped = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stopped = True
        finally:
            if proc.poll() is None:
                _stop_session(proc, grace_s=20.0)
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        return StandaloneResult(proc.returncode, out.read(), err.read(), seconds, stopped)


_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TIDY = [
    # glog-style prefixes of torch's C++ and elastic loggers: "W1201 15:53:39.229000 9882 " -> "W "
    (re.compile(r"\b([IWEF])\d{4} \d{2}:\d{2}:\d{2}\.\d+ +\d+ "), r"\1 "),
    (re.compile(r"\d{4}-\d{2}-\d{2}[ _T]\d{2}:\d{2}:\d{2}(\.\d+)?"), "TIME"),
    (re.compile(r"\b(pid|PID)([:= ]+)\d+"), r"\1\2N"),
    (re.compile(r"\b([Pp]rocess) \d+"), r"\1 N"),
    (re.compile(r"\b(\d{1,3}(?:\.\d{1,3}){3}|localhost|\[[0-9a-fA-F:]+\]):\d{2,5}\b"), r"\1:PORT"),
    (re.compile(r"\b([Pp]ort) \d{2,5}\b"), r"\1 PORT"),
    (re.compile(r"sport = :\d+"), "sport = :PORT"),
    # the build machine's source path in torch's C++ messages: "[/__w/.../third_party/gloo/..." -> "[gloo/..."
    (re.compile(r"\[/\S*?/third_party/"), "["),
]
_NOISE = (re.compile(r"^USDT:"),                      # the profiler's own start/stop lines
          re.compile(r"^\*+$"),                       # torchrun's OMP_NUM_THREADS banner
          re.compile(r"^Setting OMP_NUM_THREADS environment variable"))


def tidy_output(text: str, replace: dict[str, str] | None = None) -> str:
    """``text`` (a job's output) with what changes from run to run replaced, so that a notebook can show it.

    Lines of the profiler's start/stop log and torchrun's ``OMP_NUM_THREADS`` banner are dropped; then the
    strings in ``replace`` (e.g. a temporary directory -> ``"DIR"``, longest first), this checkout's own path
    (dropped, so paths read ``labs/capstone/train.py``), the host name (``HOST``), times and dates (``TIME``),
    process ids (``pid N``), ports (``127.0.0.1:PORT``, ``port PORT``) are replaced.
    """
    lines = [line for line in text.splitlines() if not any(p.search(line.strip()) for p in _NOISE)]
    text = "\n".join(lines)
    for old, new in sorted((replace or {}).items(), key=lambda kv: -len(kv[0])):
        text = text.replace(old, new)
    text = text.replace(_PACKAGE_ROOT + os.sep, "").replace(_PACKAGE_ROOT, ".")
    host = socket.gethostname()
    if host:
        text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", "HOST", text)
    for pattern, new in _TIDY:
        text = pattern.sub(new, text)
    return text


if __name__ == "__main__":
    from commlab.launch.env import exit_process
    exit_process(main())
