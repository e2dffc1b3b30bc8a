"""The hang clinic: inject a fault into a small gloo job for real, and read which rank and which line it was.

Each case (:data:`CASES`) runs a job of :mod:`commlab.launch.failures` through either door (``"launch"``: forked by
:func:`commlab.launch.launch`; ``"torchrun"``: :func:`commlab.launch.torchrun.run_standalone`) with short collective
timeouts and a deadline on the whole job, and reads it with one of :data:`TOOLS`: ``plain`` (what the job and its
launcher print), ``detail`` (``TORCH_DISTRIBUTED_DEBUG=DETAIL``), ``flight-recorder`` (each rank's
``_dump_fr_trace`` pickle, compared across ranks, and torch's ``fr_trace`` analyzer) and ``stacks`` (each rank's
Python stacks from ``faulthandler``). Entry points: one function per case (:func:`order`, :func:`size`,
:func:`dtype`, :func:`absent`, :func:`exits`, :func:`killed`, :func:`send_first`, :func:`recv_first`), all through
:func:`run_case` / :func:`run_tools`, which return :class:`Diagnosis`; :func:`format_diagnosis` prints one in rank
order. ``python -m commlab.launch.clinic CASE [--tool T] [--door D]``. Chapter "When it goes wrong".
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
from typing import Sequence

from commlab.checks import number, one_of
from commlab.launch.failures import FR_PREFIX, STACKS_PREFIX, faulty_rank

__all__ = ["CASES", "TOOLS", "DOORS", "Diagnosis", "run_case", "run_tools", "format_diagnosis", "print_diagnosis",
           "order", "size", "dtype", "absent", "exits", "killed", "send_first", "recv_first", "main"]

#: Clinic case -> (job of :mod:`commlab.launch.failures`, ranks, what goes wrong).
CASES = {
    "order": ("order", 3, "collectives called in another order on one rank"),
    "size": ("shape", 3, "an AllReduce of another size on one rank"),
    "dtype": ("dtype", 3, "an AllReduce of another dtype on one rank"),
    "absent": ("timeout", 3, "a rank that never reaches the AllReduce"),
    "exit": ("exit", 3, "a rank that exits (os._exit) before the AllReduce"),
    "kill": ("kill", 3, "a rank killed by SIGKILL before the AllReduce"),
    "send-first": ("send-first", 2, "a pipeline whose last stage sends before it receives: both ranks send"),
    "recv-first": ("recv-first", 2, "a pipeline whose first stage receives before it sends: both ranks receive"),
}
TOOLS = ("plain", "detail", "flight-recorder", "stacks")
DOORS = ("launch", "torchrun")
_JOB_FILE = "commlab/launch/failures.py"
# The functions of commlab.launch.failures that make the collectives (not its evidence machinery).
_JOB_FUNCS = ("_shape", "_order", "_dtype", "_absent", "_dies", "_pipeline", "run_job")
_OPS = ("all_reduce", "broadcast", "send", "recv", "all_gather", "reduce_scatter", "barrier", "monitored_barrier")


@dataclasses.dataclass
class Diagnosis:
    """What one tool says about one run of a clinic case.

    Attributes:
        case, door, tool: as passed to :func:`run_case`. world_size: ranks in the job.
        injected_rank: the rank the case made faulty (the truth, for checking the tool).
        ranks: the ranks the tool names as the cause (empty: it names none).
        operation: the operation it names ("broadcast", "all_reduce [4] Double", "send", ...), or None.
        line: ``file:line  source`` of that rank's call, where the tool gives it, else None.
        per_rank: what the tool shows for each rank, in rank order (``{rank: text}``).
        printed: what the tool printed, tidied and cut to a few lines.
        launcher: what the door itself said (commlab's RankError / LaunchTimeout, or torchrun's summary).
        seconds: wall seconds from the start of the job to its end. why: how the tool reached its verdict.
    """

    case: str
    door: str
    tool: str
    world_size: int
    injected_rank: int
    ranks: tuple[int, ...]
    operation: str | None
    line: str | None
    per_rank: dict[int, str]
    printed: str
    launcher: str
    seconds: float
    why: str = ""

    @property
    def names_injected(self) -> bool:
        """Whether the tool names the injected rank (alone or within a cycle of waiting ranks)."""
        return self.injected_rank in self.ranks


@dataclasses.dataclass
class _Run:
    door: str
    detail: bool
    text: str              # everything the ranks and the launcher printed
    launcher: str
    launcher_ranks: tuple[int, ...]
    evidence: str | None   # directory with the per-rank dumps
    seconds: float


# ------------------------------------------------------------------------------------------------- running

def _run(case: str, door: str, detail: bool, timeout: float, evidence: str | None) -> _Run:
    job, world, _ = CASES[case]
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL" if detail else "OFF"}
    if door == "torchrun":
        from commlab.launch.torchrun import run_standalone, tidy_output
        argv = ["-m", "commlab.launch.failures", job, "--timeout", f"{timeout:g}"]
        if evidence:
            argv += ["--evidence", evidence]
        res = run_standalone(argv, world, timeout_s=6 * timeout + 60, env=env)
        text = tidy_output(res.stdout + res.stderr, replace={evidence: "DIR"} if evidence else None)
        root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", text, re.S)
        summary = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", text, re.S)
        launcher = (f"torchrun: root cause rank {root.group(1)}, exitcode {summary.group(1) if summary else '?'}"
                    if root else f"torchrun: exit status {res.returncode}" + (", stopped" if res.stopped else ""))
        return _Run(door, detail, text, launcher, (int(root.group(1)),) if root else (), evidence, res.seconds)
    from commlab.launch import LaunchTimeout, RankError, launch
    from commlab.launch.failures import clinic_rank

    def hook(rank: int) -> None:  # before init_process_group, in the rank: the debug level is read there
        os.environ.update(env)
        from torch._C._distributed_c10d import set_debug_level_from_env
        set_debug_level_from_env()

    start = time.monotonic()
    try:
        launch(clinic_rank, world, job, timeout, evidence, timeout=timeout + 1, print_output=False,
               init_hook=hook)
        launcher, ranks, outputs = "launch returned: every rank went through", (), []
    except RankError as e:
        launcher, ranks, outputs = f"RankError: {str(e).splitlines()[0]}", (e.rank,), e.outputs
    except LaunchTimeout as e:
        launcher, outputs = f"LaunchTimeout: {str(e).splitlines()[0]}", e.outputs
        ranks = tuple(e.running) if len(e.running) < world else ()
    seconds = time.monotonic() - start
    from commlab.launch.torchrun import tidy_output
    text = "\n".join(f"[rank {r}] {ln}" for r, out in enumerate(outputs) for ln in out.splitlines())
    return _Run(door, detail, tidy_output(text), launcher, ranks, evidence, seconds)


def run_tools(case: str, tools: Sequence[str] = TOOLS, door: str = "launch", timeout: float = 2.0) -> list[Diagnosis]:
    """Run ``case`` and read it with each of ``tools``, in as few runs as they allow: ``detail`` changes what the
    job does (a check before every collective), so it runs alone; ``plain``, ``flight-recorder`` and ``stacks`` read
    the same run (the dumps go to files, the job prints what it would print anyway).

    Args:
        case: a key of :data:`CASES`. tools: some of :data:`TOOLS`. door: ``"launch"`` or ``"torchrun"``.
        timeout: seconds each collective waits (the evidence is dumped at 0.75 of it); the whole job is bounded
            by ``timeout + 1`` s (launch: its deadline; its send/recv keep the group's longer timeout) or
            ``6 timeout + 60`` s (torchrun, whose start takes seconds).

    Returns:
        One :class:`Diagnosis` per tool, in the order of ``tools``.

    Raises:
        ValueError: an unknown case, tool or door, or a timeout outside [0.5, 60] s.
    """
    one_of("case", case, CASES)
    one_of("door", door, DOORS)
    for t in tools:
        one_of("tool", t, TOOLS)
    number("timeout", timeout, least=0.5, most=60.0)
    out: dict[str, Diagnosis] = {}
    if "detail" in tools:
        out["detail"] = _diagnose(case, "detail", _run(case, door, True, timeout, None))
    rest = [t for t in tools if t != "detail"]
    if rest:
        directory = tempfile.mkdtemp(prefix="commlab-clinic-")
        try:
            want = directory if {"flight-recorder", "stacks"} & set(rest) else None
            run = _run(case, door, False, timeout, want)
            for t in rest:
                out[t] = _diagnose(case, t, run)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return [out[t] for t in tools]


def run_case(case: str, tool: str = "stacks", door: str = "launch", timeout: float = 2.0) -> Diagnosis:
    """Run ``case`` once and read it with ``tool`` (see :func:`run_tools`)."""
    return run_tools(case, (tool,), door, timeout)[0]


def order(tool: str = "stacks", door: str = "launch", timeout: float = 2.0) -> Diagnosis:
    """Rank 0 calls AllReduce then Broadcast, the others Broadcast then AllReduce."""
    return run_case("order", tool, door, timeout)


def size(tool: str = "flight-recorder", door: str = "launch", timeout: float = 2.0) -> Diagnosis:
    """Rank 0 all-reduces 4 elements, the others 5."""
    return run_case("size", tool, door, timeout)


def dtype(tool: str = "detail", door: str = "launch", timeout: float = 2.0) -> Diagnosis:
    """The last rank all-reduces float64, the others float32."""
    return run_case("dtype", tool, door, timeout)


def absent(tool: str = "stacks", door: str = "launch", timeout: float = 2.0) -> Diagnosis:
    """The last rank sleeps through the AllReduce its peers wait in."""
    return run_case("absent", tool, door, timeout)


def exits(tool: str = "stacks", door: str = "launch", timeout: float = 2.0) -> Diagnosis:
    """The last rank ends with ``os._exit(3)`` before the AllReduce."""
    return run_case("exit", tool, door, timeout)


def killed(tool: str = "stacks", door: str = "launch", timeout: float = 2.0) -> Diagnosis:
    """Rank 1 is killed by SIGKILL before the AllReduce."""
    return run_case("kill", tool, door, timeout)


def send_first(tool: str = "stacks", door: str = "launch", timeout: float = 2.0) -> Diagnosis:
    """Two pipeline stages both send first (gloo's send waits for its receive): a deadlock."""
    return run_case("send-first", tool, door, timeout)


def recv_first(tool: str = "stacks", door: str = "launch", timeout: float = 2.0) -> Diagnosis:
    """Two pipeline stages both receive first: a deadlock."""
    return run_case("recv-first", tool, door, timeout)


# ------------------------------------------------------------------------------------------------- reading

def _diagnose(case: str, tool: str, run: _Run) -> Diagnosis:
    job, world, _ = CASES[case]
    read = {"plain": _read_plain, "detail": _read_detail, "flight-recorder": _read_flight_recorder,
            "stacks": _read_stacks}[tool]
    ranks, op, line, per_rank, printed, why = read(run, world)
    return Diagnosis(case, run.door, tool, world, faulty_rank(job, world), tuple(sorted(ranks)), op, line,
                     per_rank, printed, run.launcher, run.seconds, why)


def _rank_errors(text: str) -> dict[int, str]:
    errors = {}
    for m in re.finditer(r"^(?:\[rank \d+\] )?rank (\d+): (\w+): (.*)$", text, re.M):
        errors.setdefault(int(m.group(1)), f"{m.group(2)}: {m.group(3)}")
    return errors


def _short(text: str, width: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _majority(keys: dict[int, object], world: int) -> tuple[list[int], object | None]:
    """The ranks whose key differs from the one more than half of all ``world`` ranks hold, and that key."""
    counts = collections.Counter(keys.values())
    top, n = counts.most_common(1)[0] if counts else (None, 0)
    if len(counts) < 2 or 2 * n <= world:
        return [], None
    return sorted(r for r, k in keys.items() if k != top), top


def _odd_ones(keys: dict[int, object]) -> tuple[list[int], object | None]:
    """The ranks whose key differs from the most common one, when one key is held by most ranks."""
    counts = collections.Counter(keys.values())
    if len(counts) < 2:
        return [], None
    (top, n_top), (_, n_next) = counts.most_common(2)
    if n_top == n_next:
        return sorted(keys), None  # no majority: every rank in the disagreement
    return sorted(r for r, k in keys.items() if k != top), top


def _read_plain(run: _Run, world: int):
    errors = _rank_errors(run.text)
    per_rank = {r: _short(errors.get(r, "(no error printed)")) for r in range(world)}
    fatal = [ln for ln in run.text.splitlines() if re.search(r"terminate called|what\(\)|Fatal Python error", ln)]
    lines = [run.launcher] + [f"rank {r}: {t}" for r, t in per_rank.items()] + fatal[:2]
    why = ("the launcher's verdict; the ranks' own errors say only that they timed out or lost a peer"
           if run.launcher_ranks else "no rank is named: every rank reports a timeout or a lost peer")
    return run.launcher_ranks, None, None, per_rank, "\n".join(lines), why


_FP = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=(\w+), "
                 r"TensorShape=\[([^\]]*)\], TensorDtypes=(\w+)")
_BARRIER = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier in (\d+) ms")


def _read_detail(run: _Run, world: int):
    claims: dict[int, tuple] = {}
    for m in _FP.finditer(run.text):
        claims.setdefault(int(m.group(1)), (m.group(3), m.group(4), m.group(5)))
    errors = _rank_errors(run.text)
    per_rank = {r: _short(errors.get(r, "(no error printed)")) for r in range(world)}
    if claims:
        odd, _ = _odd_ones(claims)
        if odd:
            op = "; ".join(f"rank {r}: {claims[r][0]} [{claims[r][1]}] {claims[r][2]}" for r in odd)
            printed = "\n".join(f"rank {r}: OpType={c[0]}, TensorShape=[{c[1]}], TensorDtypes={c[2]}"
                                for r, c in sorted(claims.items()))
            return odd, op, None, per_rank, printed, ("the collective fingerprints that each rank checked "
                                                      "before the call: the odd one out")
    m = _BARRIER.search(run.text)
    if m:
        ranks = [int(r) for r in m.group(1).replace(" ", "").split(",") if r]
        return ranks, "monitoredBarrier before the next collective", None, per_rank, m.group(0), \
            "the barrier DETAIL runs before every collective names the ranks that never reached it"
    return (), None, None, per_rank, "\n".join(f"rank {r}: {t}" for r, t in per_rank.items()), \
        "no fingerprint and no barrier report: DETAIL checks collectives only, not send/recv or dead peers' cause"


def _job_line(lineno: int) -> str:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "failures.py")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    src = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
    return f"{_JOB_FILE}:{lineno}  {src}"


def _load_fr(directory: str | None, world: int) -> dict[int, dict]:
    dumps = {}
    for r in range(world):
        path = os.path.join(directory or "", f"{FR_PREFIX}{r}")
        try:
            with open(path, "rb") as f:
                dumps[r] = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            pass
    return dumps


def _fr_key(entry: dict) -> tuple:
    op = entry["profiling_name"].split(":")[-1]
    return (op, str(entry.get("input_sizes")), ",".join(entry.get("input_dtypes") or []))


def _fr_line(entry: dict) -> str | None:
    for fr in entry.get("frames") or []:
        if fr["filename"].replace(os.sep, "/").endswith(_JOB_FILE):
            return _job_line(int(fr["line"]))
    return None


def _fr_trace_analyzer(dumps: dict[int, dict]) -> str:
    """What torch's ``fr_trace`` prints for these dumps. torch 2.13's gloo dumps key their group config by an
    empty name while the entries name the group "0", which the analyzer cannot join (KeyError): the copies it
    reads here carry the entries' group name in the config."""
    from torch.distributed.flight_recorder import fr_trace
    tmp = tempfile.mkdtemp(prefix="commlab-fr-")
    try:
        for r, d in dumps.items():
            d = dict(d)
            groups = {e["process_group"] for e in d["entries"]}
            if "" in d.get("pg_config", {}) and len(groups) == 1:
                name, desc = next(iter(groups))
                d["pg_config"] = {name: dict(d["pg_config"][""], name=name, desc=desc)}
            with open(os.path.join(tmp, f"{FR_PREFIX}{r}"), "wb") as f:
                pickle.dump(d, f)
        buf = io.StringIO()
        import logging
        fr_logger = logging.getLogger("Flight Recorder")  # made, with its own stderr handler, by fr_trace's import
        saved = fr_logger.handlers[:]
        fr_logger.handlers = [logging.StreamHandler(buf)]
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                fr_trace.main([tmp, "--prefix", FR_PREFIX, "--allow-incomplete-ranks"])
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the analyzer's failure is part of what it printed
            buf.write(f"fr_trace failed: {type(e).__name__}: {e}\n")
        finally:
            fr_logger.handlers = saved
        return buf.getvalue()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_flight_recorder(run: _Run, world: int):
    dumps = _load_fr(run.evidence, world)
    per_rank = {}
    entries = {}
    for r in range(world):
        if r not in dumps:
            per_rank[r] = "no dump (the process was gone before it could write one)"
            continue
        es = [e for e in dumps[r]["entries"] if not e.get("is_p2p")]
        entries[r] = {e["collective_seq_id"]: e for e in es}
        per_rank[r] = "; ".join(f"#{e['collective_seq_id']} {' '.join(_fr_key(e))} "
                                f"{'completed' if e.get('retired') else 'pending'}" for e in es) or "no entries"
    analyzer = _fr_trace_analyzer(dumps) if dumps else "(no dumps)"
    errors = [ln for ln in analyzer.splitlines() if "Culprit" in ln or "error" in ln.lower()]
    printed = "\n".join([f"rank {r}: {t}" for r, t in per_rank.items()] + ["fr_trace: " + _short(ln, 300)
                                                                          for ln in errors[:3]])
    last = max((max(es, default=0) for es in entries.values()), default=0)
    missing = [r for r in range(world) if r not in dumps]
    for seq in range(1, last + 1):
        keys = {r: (_fr_key(es[seq]) if seq in es else ("never called",)) for r, es in entries.items()}
        odd, expected = _majority(keys, world)
        if odd:
            e = next((entries[r][seq] for r in odd if seq in entries[r]), None)
            op = "; ".join(f"rank {r}: {' '.join(keys[r])}" for r in odd)
            return odd, op, _fr_line(e) if e else None, per_rank, printed, \
                f"collective #{seq} differs from the one most ranks recorded ({' '.join(expected)})"
        if len(set(keys.values())) > 1:
            return (), None, None, per_rank, printed, \
                (f"collective #{seq} differs between the ranks that left a dump, and ranks {missing} left none: "
                 "no majority to call the odd one out")
    if missing and dumps:
        pending = [e for es in entries.values() for e in es.values() if not e.get("retired")]
        op = " ".join(_fr_key(pending[0])) if pending else None
        return missing, f"left no dump while the others waited in {op}" if op else "left no dump", None, \
            per_rank, printed, "every rank that left a dump agrees; the ranks without one were gone"
    if not dumps:
        return (), None, None, per_rank, printed, "no rank left a dump: the launcher ended them before any timed out"
    if all(not es for es in entries.values()) or all(
            all(e.get("retired") for e in es.values()) for es in entries.values()):
        why = "nothing pending in any rank's record: gloo's Flight Recorder in torch 2.13 records no send/recv"
    else:
        why = "the records agree: every rank is in the same collective"
    return (), None, None, per_rank, printed, why


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def _stack_of(text: str) -> tuple[list[tuple[str, int, str]], str]:
    """The frames (most recent first) of the first thread that runs the job, and the dump's header."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x|Exception \w+ \(most recent)", text)
    header = "crashed" if "Fatal Python error" in text else ""
    for b in blocks:
        frames = [(f, int(n), name) for f, n, name in _FRAME.findall(b)]
        if any(f.replace(os.sep, "/").endswith(_JOB_FILE) and name in _JOB_FUNCS for f, _, name in frames):
            kind = "exception" if b.startswith("Exception") else header or "stack"
            return frames, kind
    return [], header


def _read_stacks(run: _Run, world: int):
    per_rank, where = {}, {}
    for r in range(world):
        try:
            with open(os.path.join(run.evidence or "", f"{STACKS_PREFIX}{r}"), encoding="utf-8",
                      errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        frames, kind = _stack_of(text)
        if not frames:
            per_rank[r] = "no stack (the process was gone before it could write one)"
            continue
        i = next(i for i, (f, _, name) in enumerate(frames)
                 if f.replace(os.sep, "/").endswith(_JOB_FILE) and name in _JOB_FUNCS)
        callee = [name for f, _, name in frames[:i] if "torch/distributed" in f.replace(os.sep, "/")]
        ops = [n for n in callee if n in _OPS]
        line = _job_line(frames[i][1])
        op = ops[-1] if ops else line.split("  ", 1)[1].split("(")[0]
        where[r] = (line, op)
        per_rank[r] = f"{op} at {line}" + (f" ({kind})" if kind not in ("stack", "") else "")
    printed = "\n".join(f"rank {r}: {t}" for r, t in per_rank.items())
    missing = [r for r in range(world) if r not in where]
    if where:
        odd, _ = _odd_ones({r: w[0] for r, w in where.items()})
        if odd and not missing and len(odd) < len(where):
            return odd, "; ".join(f"rank {r}: {where[r][1]}" for r in odd), where[odd[0]][0], per_rank, printed, \
                "the rank whose stack stands at another line than the others'"
        p2p = {w[1] for w in where.values()}
        if not missing and p2p <= {"send", "recv"} and len(p2p) == 1:
            op = p2p.pop()
            return sorted(where), f"every rank blocked in {op}", None, per_rank, printed, \
                f"a cycle: each rank waits in {op} for a peer that waits in {op} too (gloo's send waits for its " \
                "receive); the stage whose order differs from the schedule is the one to fix"
        if missing:
            op = collections.Counter(w[1] for w in where.values()).most_common(1)[0][0]
            return missing, f"left no stack while the others waited in {op}", None, per_rank, printed, \
                "the ranks that left no stack were gone while the others waited"
        if len({w[0] for w in where.values()}) == 1:
            return (), None, None, per_rank, printed, \
                "every rank stands at the same line: stacks cannot see sizes or dtypes"
    return (), None, None, per_rank, printed, "no stacks"


# ------------------------------------------------------------------------------------------------ printing

def format_diagnosis(d: Diagnosis) -> str:
    """``d`` as text: the case, what the tool shows for each rank in rank order, its verdict, the launcher's."""
    _, _, what = CASES[d.case]
    verdict = (f"names rank{'s' if len(d.ranks) > 1 else ''} {', '.join(map(str, d.ranks))}"
               + (f": {d.operation}" if d.operation else "") if d.ranks else "names no rank")
    lines = [f"{d.case} ({what}), through {d.door}, read with {d.tool}: ended after {d.seconds:.1f} s",
             *(f"  rank {r}: {t}" for r, t in sorted(d.per_rank.items())),
             f"  {d.tool} {verdict}" + (f"\n    at {d.line}" if d.line else ""),
             f"  why: {d.why}" if d.why else "",
             f"  launcher: {d.launcher}",
             f"  injected: rank {d.injected_rank} ({'named' if d.names_injected else 'not named'})"]
    return "\n".join(ln for ln in lines if ln)


def print_diagnosis(d: Diagnosis, file=None) -> None:
    """Print :func:`format_diagnosis` of ``d``."""
    print(format_diagnosis(d), file=file or sys.stdout, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m commlab.launch.clinic CASE [CASE ...] [--tool T ...] [--door D] [--timeout S] [--printed]
    [--json]``: the cases one after the other."""
    p = argparse.ArgumentParser(prog="python -m commlab.launch.clinic", description=__doc__.split("\n\n")[0])
    p.add_argument("case", nargs="+", choices=list(CASES), help="; ".join(f"{k}: {v[2]}" for k, v in CASES.items()))
    p.add_argument("--tool", choices=TOOLS, action="append", help="how to read it (repeatable; default all four)")
    p.add_argument("--door", choices=DOORS, default="launch", help="launch (fork, default) or torchrun")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds each collective waits (default 2)")
    p.add_argument("--printed", action="store_true", help="also show what each tool printed")
    p.add_argument("--json", action="store_true", help="print the diagnoses as one JSON list instead")
    args = p.parse_args(argv)
    found = [d for case in args.case for d in run_tools(case, args.tool or TOOLS, args.door, args.timeout)]
    if args.json:
        import json
        print(json.dumps([dataclasses.asdict(d) for d in found]), flush=True)
        return 0
    for d in found:
        print_diagnosis(d)
        if args.printed:
            print("  printed:\n" + "\n".join("    " + ln for ln in d.printed.splitlines()), flush=True)
    return 0


if __name__ == "__main__":
    from commlab.launch.env import exit_process
    exit_process(main())
