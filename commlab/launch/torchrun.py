"""The per-node command of a multi-node job, and torchrun jobs run from Python.

``python -m commlab.launch.torchrun [torchrun's arguments]`` runs torchrun (``torch.distributed.run.main``) in
this process, unchanged, with three additions for what torch 2.13 lacks (each one tested in
``tests/test_cluster.py``):

* node 0 hosts the c10d store and keeps it up, at most :data:`LINGER_S` s, until every node's torchrun has ended:
  torch's agent returns at once when a worker fails (no exit barrier on failure) and its store goes with it;
* a node whose endpoint accepts connections but never answers as a store stops after :data:`PROBE_S` s: torch's
  store client has no timeout on that handshake, so torchrun would wait for good, even past ``join_timeout``;
* when the rendezvous times out, the node names who joined: torch raises a bare ``RendezvousTimeoutError``.

``--node-rank`` (else ``SLURM_NODEID``) says which node is 0. :func:`run_local_nodes` starts such nodes on
loopback; :func:`run_standalone` runs one ``torchrun --standalone`` job and :func:`tidy_output` makes its text
repeatable (chapter 14, sections 14.2 and 14.4).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Sequence

__all__ = ["main", "node_command", "run_local_nodes", "free_port", "NodeResult", "PROBE_S", "LINGER_S",
           "DEFAULT_C10D_PORT", "run_standalone", "StandaloneResult", "tidy_output"]

#: Seconds an endpoint that accepts TCP connections has to answer as a torch store (a store takes milliseconds).
PROBE_S = 10.0
#: Seconds node 0 keeps the rendezvous store up after its own torchrun ended, for the other nodes' torchruns.
LINGER_S = 30.0
#: torchrun's port for ``--rdzv-endpoint HOST`` without one (``torch/distributed/elastic/rendezvous``).
DEFAULT_C10D_PORT = 29400
_TORCH_JOIN_TIMEOUT_S = 600.0  # torchrun's default join_timeout
_POLL_S = 0.5


def _say(node: int | str, text: str) -> None:
    print(f"[commlab node {node}] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ reading the arguments

@dataclasses.dataclass(frozen=True)
class _Plan:
    argv: list[str]            # what torchrun receives
    c10d: bool                 # a c10d rendezvous at an endpoint, is_host not given: the additions apply
    node_rank: int
    min_nodes: int
    max_nodes: int
    host: str
    port: int
    run_id: str
    join_timeout_s: float
    hosts_store: bool          # this command (node 0) hosts the rendezvous store, not torchrun

    def key(self, what: str) -> str:
        return f"commlab/{self.run_id}/{what}"


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
        if "is_host" in conf:  # who hosts the store is then left to torchrun, and so are its failures
            c10d = False
        hosts_store = c10d and node_rank == 0
        conf.setdefault("is_host", "0")  # node 0's store is this command's, not its torchrun's
        for names in (("--rdzv-conf", "--rdzv_conf"), ("--node-rank", "--node_rank")):
            # --node-rank is this command's: torchrun ignores it with c10d, and would print that it does.
            span = _option_span(opts, names)
            if span is not None:
                del opts[span[0]:span[1]]
        opts = ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())] + opts
    return _Plan(argv=opts + job, c10d=c10d, node_rank=node_rank, min_nodes=min_nodes, max_nodes=max_nodes,
                 host=host, port=port, run_id=run_id, join_timeout_s=join_timeout, hosts_store=hosts_store)


# ----------------------------------------------------------------------------------------- the store

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


# --------------------------------------------------------------------------------------------- running

def _join_store(plan: _Plan):
    """This node's client of the rendezvous store (node 0: the store itself), registered under its node rank.

    Raises:
        _Refused: node 0 cannot host the store (the port is taken: torch's own message), or the endpoint
            accepts connections but is not a store, or no store answered within ``join_timeout``.
    """
    import torch.distributed as dist

    if plan.hosts_store:
        try:
            store = dist.TCPStore(plan.host, plan.port, is_master=True, multi_tenant=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=PROBE_S))
        except Exception as e:  # noqa: BLE001 - TCPStore says DistNetworkError or RuntimeError
            raise _Refused(f"cannot host the rendezvous store at {plan.host}:{plan.port}: "
                           f"{str(e).splitlines()[0]}") from None
    else:
        deadline = time.monotonic() + plan.join_timeout_s
        while True:
            state, store = _store_client(plan.host, plan.port, PROBE_S)
            if state == "store":
                break
            if state == "not a store":
                raise _Refused(f"{plan.host}:{plan.port} accepts connections but does not answer as a torch "
                               f"rendezvous store within {PROBE_S:g} s: the port is used by another program. Pick "
                               "another port for --rdzv-endpoint, the same on every node")
            if time.monotonic() >= deadline:
                raise _Refused(f"no rendezvous store answered at {plan.host}:{plan.port} within join_timeout="
                               f"{plan.join_timeout_s:g} s: node 0 did not start, failed, or had already given up. "
                               "Start node 0 first (or together), with the same --rdzv-endpoint")
            time.sleep(_POLL_S)
    store.set(plan.key(f"node/{plan.node_rank}"), socket.gethostname())
    store.add(plan.key("joined"), 1)
    return store


def _who_joined(store, plan: _Plan) -> str:
    """What node 0's store says of who joined the rendezvous that timed out."""
    where = f"the rendezvous '{plan.run_id}' at {plan.host}:{plan.port}"
    try:
        names = {r: store.get(plan.key(f"node/{r}")).decode(errors="replace") for r in range(plan.max_nodes)
                 if store.check([plan.key(f"node/{r}")])}
    except Exception:  # noqa: BLE001 - node 0's store has gone: its own output names them
        return f"{where} did not complete (torchrun's own error is above; node 0's output names who joined)"
    need = f"{plan.min_nodes}" if plan.min_nodes == plan.max_nodes else f"{plan.min_nodes} to {plan.max_nodes}"
    came = ", ".join(f"node {r} ({h})" for r, h in sorted(names.items()))
    missing = ", ".join(f"node {r}" for r in range(plan.max_nodes) if r not in names)
    return (f"{where} did not complete (torchrun's own error is above): {len(names)} of {need} nodes had joined "
            f"({came}); never joined: {missing}. Start the same command on every node (same --nnodes, --rdzv-id "
            f"and --rdzv-endpoint, each with its own --node-rank) and check that every node reaches "
            f"{plan.host}:{plan.port}; nodes that start more than join_timeout={plan.join_timeout_s:g} s apart "
            "need a larger --rdzv-conf join_timeout")


def _torchrun(argv: Sequence[str]) -> tuple[int, BaseException | None]:
    """``torch.distributed.run.main(argv)`` in this process: (exit status, the exception it raised)."""
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(list(argv))
    except SystemExit as e:  # argparse: --help, or arguments torchrun cannot read
        return (e.code if isinstance(e.code, int) else 1), None
    except Exception as e:  # noqa: BLE001 - torchrun's summary (ChildFailedError) or its rendezvous error
        traceback.print_exc()
        return 1, e
    return 0, None


def _linger(store, plan: _Plan) -> None:
    """Keep node 0's store up until every registered node's torchrun has ended, or :data:`LINGER_S` passed."""
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        try:
            if int(store.add(plan.key("ended"), 0)) >= int(store.add(plan.key("joined"), 0)):
                return
        except Exception:  # noqa: BLE001 - the store is this process's own; nothing to wait for if it broke
            return
        time.sleep(_POLL_S / 5)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m commlab.launch.torchrun [torchrun options] SCRIPT|-m MODULE [args]``; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    try:
        plan = _plan(list(sys.argv[1:] if argv is None else argv), os.environ)
    except _Refused as e:
        _say("?", str(e))
        return 2
    try:
        store = _join_store(plan) if plan.c10d else None  # before torchrun, which would hang on a port not a store
    except _Refused as e:
        _say(plan.node_rank, str(e))
        return 1
    rc, error = _torchrun(plan.argv)
    if store is None:
        return rc
    if isinstance(error, RendezvousTimeoutError):
        _say(plan.node_rank, _who_joined(store, plan))
    try:
        store.add(plan.key("ended"), 1)
    except Exception:  # noqa: BLE001 - node 0 has gone: nobody waits for the word
        pass
    if plan.hosts_store and not isinstance(error, SignalException):
        _linger(store, plan)
    return rc


# ------------------------------------------------------------------------------- jobs started from Python

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
                    run_id: str | None = None, env: dict | None = None) -> list[NodeResult]:
    """Start ``nnodes`` torchrun "nodes" (:func:`node_command`) on this machine (loopback) running ``job``, and
    wait for all of them; nodes still running after ``timeout_s`` are stopped, their workers with them.

    Args:
        nodes: which node ranks to start (default all; fewer makes a node that never joins).
        port: rendezvous port on 127.0.0.1 (default a free one, see :func:`free_port`).
        run_id: the rendezvous id (default one made from this process's id and the port).
        env: extra environment variables for every node.

    Returns:
        One :class:`NodeResult` per started node, in node order (its output: stdout and stderr together).
    """
    port = free_port() if port is None else port
    run_id = run_id or f"commlab-{os.getpid()}-{port}"
    ranks = list(range(nnodes) if nodes is None else nodes)
    cmds = [node_command(r, nnodes, nproc_per_node, f"127.0.0.1:{port}", run_id, job, join_timeout_s=join_timeout_s,
                         local_addr="127.0.0.1") for r in ranks]
    runs, _ = _run_bounded(cmds, env, timeout_s)
    return [NodeResult(r, rc, out, stopped) for r, (rc, out, _, stopped) in zip(ranks, runs)]


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
    so nothing needs choosing. A job still running after ``timeout_s`` is stopped, its workers with it.

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
    [(rc, out, err, stopped)], seconds = _run_bounded([cmd], env, timeout_s, cwd=cwd, split=True)
    return StandaloneResult(rc, out, err, seconds, stopped)


def _run_bounded(cmds: Sequence[Sequence[str]], env: dict | None, timeout_s: float, *, cwd: str | None = None,
                 split: bool = False) -> tuple[list[tuple[int, str, str | None, bool]], float]:
    """Run ``cmds`` side by side, each in a session of its own, and wait for all of them until ``timeout_s``.

    ``OMP_NUM_THREADS=1`` unless the environment sets it (what torchrun sets, with a banner). A command still
    running at the deadline is sent SIGTERM (torchrun then stops its workers), SIGKILL 20 s later.

    Returns:
        ``[(exit status, stdout, stderr or None (split=False: in stdout), stopped), ...]`` and the wall seconds.
    """
    full_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    start = time.monotonic()
    files, procs = [], []
    try:
        for cmd in cmds:
            out, err = (tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") if want else None
                        for want in (True, split))
            files.append((out, err))
            procs.append(subprocess.Popen(list(cmd), env=full_env, cwd=cwd, stdout=out, stdin=subprocess.DEVNULL,
                                          stderr=err or subprocess.STDOUT, start_new_session=True))
        for p in procs:
            try:
                p.wait(timeout=max(0.1, start + timeout_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        stopped = [p.poll() is None for p in procs]
        for p, late in zip(procs, stopped):
            if late:
                _stop_session(p, grace_s=20.0)
        seconds = time.monotonic() - start
        texts = [[_read_and_close(f) for f in pair] for pair in files]
    return [(p.returncode, out, err, late) for p, (out, err), late in zip(procs, texts, stopped)], seconds


def _read_and_close(f) -> str | None:
    if f is None:
        return None
    f.seek(0)
    text = f.read()
    f.close()
    return text


def _stop_session(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM to ``proc``'s session (torchrun then stops its workers), SIGKILL after ``grace_s``."""
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


_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TIDY = [
    # glog-style prefixes of torch's C++ and elastic loggers: "W1201 15:53:39.229000 9882 " -> "W "
    (re.compile(r"\b([IWEF])\d{4} \d{2}:\d{2}:\d{2}\.\d+ +\d+ "), r"\1 "),
    (re.compile(r"\d{4}-\d{2}-\d{2}[ _T]\d{2}:\d{2}:\d{2}(\.\d+)?"), "TIME"),
    (re.compile(r"\b(pid|PID)([:= ]+)\d+"), r"\1\2N"),
    (re.compile(r"\b([Pp]rocess) \d+"), r"\1 N"),
    (re.compile(r"\b(\d{1,3}(?:\.\d{1,3}){3}|localhost|\[[0-9a-fA-F:]+\]):\d{2,5}\b"), r"\1:PORT"),
    (re.compile(r"\b([Pp]ort:?) \d{2,5}\b"), r"\1 PORT"),  # "port 29400", torch's "port: 29400"
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
