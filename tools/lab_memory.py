"""Peak memory and wall time of executing notebooks from the top, for the table of book/run_the_labs.md.

Memory is the sum of the proportional set size (PSS: shared pages divided among the processes that share
them) over the executing process and all its descendants (kernel, forked ranks, torchrun's workers),
sampled every 0.3 s from /proc (Linux only), so a peak shorter than that can be missed.

    .venv/bin/python tools/lab_memory.py labs/lab*.ipynb

Prints one JSON line per notebook; the executed copies go to a temporary folder, the notebooks are not changed.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

SAMPLE_S = 0.3


def _children():
    kids = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(pid))
    return kids


def _tree(root):
    kids, out = _children(), [root]
    for pid in out:
        out.extend(kids.get(pid, []))
    return out


def _pss_bytes(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # the process ended between listing and reading
        pass
    return 0


def measure(path, out_dir):
    jupyter = os.path.join(os.path.dirname(sys.executable), "jupyter")
    start = time.monotonic()
    proc = subprocess.Popen([jupyter, "nbconvert", "--to", "notebook", "--execute",
                             "--ExecutePreprocessor.timeout=600", "--output-dir", out_dir, path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = peak_procs = 0
    while proc.poll() is None:
        pids = _tree(proc.pid)
        total = sum(_pss_bytes(p) for p in pids)
        if total > peak:
            peak, peak_procs = total, len(pids)
        time.sleep(SAMPLE_S)
    return {"notebook": path, "returncode": proc.returncode, "wall_s": round(time.monotonic() - start, 1),
            "peak_pss_mib": round(peak / 2**20), "processes_at_peak": peak_procs}


def main(paths):
    with tempfile.TemporaryDirectory() as out_dir:
        for path in paths:
            print(json.dumps(measure(path, out_dir)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
