"""One-off: relabel recorded QSGD runs that were made with one norm for the whole gradient.

Until QSGD took a bucket size, the method spec ``qsgd:4`` meant one bucket (one float32 norm for the whole
gradient). It now means buckets of 512 entries, the paper's setting, and the one-bucket method is spelled
``qsgd:4:all`` (:mod:`commlab.experiments.methods`). The runs recorded under the old meaning are still valid
runs of the one-bucket method, so this rewrites their ``config.method`` to ``qsgd:B:all`` and their label to
what :func:`commlab.experiments.describe` now gives; everything else in the line is kept as it was. A grid
run afterwards finds them under the new key and runs only the bucketed rows.

A line is rewritten only if its payload has the one-bucket size (``ceil(n/2) + 4`` bytes for 4-bit codes,
``n + 4`` for 8-bit, n = the model's parameters, all in one gradient bucket as the experiments run them),
which no bucketed run of more than 512 entries has; running it twice, or after the bucketed rows were
recorded, changes nothing more.

Usage: ``python tools/relabel_qsgd_one_bucket.py [FILE.jsonl ...]`` (default:
``commlab/data/experiments/full.jsonl``, in a checkout). Prints how many lines of each file it rewrote.
"""

from __future__ import annotations

import json
import pathlib
import sys

from commlab.data import record_path
from commlab.experiments import describe


def one_bucket_nbytes(numel: int, bits: int) -> int:
    """Payload bytes of one-bucket QSGD of ``numel`` entries: the codes and one float32 norm."""
    return (-(-numel // 2) if bits == 4 else numel) + 4


def relabel_line(record: dict) -> bool:
    """Rewrite one record (a parsed JSON line) in place if it is a one-bucket run under the old spec."""
    cfg = record["config"]
    kind, _, arg = cfg["method"].partition(":")
    if kind != "qsgd" or ":" in arg or record["params"] <= 512:
        return False
    if record["payload_nbytes"] != one_bucket_nbytes(record["params"], int(arg)):
        return False
    cfg["method"] = f"qsgd:{arg}:all"
    record["label"] = describe(cfg["method"], cfg["error_feedback"], cfg["warmup_steps"])
    return True


def relabel_file(path: pathlib.Path) -> int:
    """Rewrite ``path``'s one-bucket QSGD lines; return how many were rewritten (the others are kept byte for byte)."""
    lines = path.read_text().splitlines(keepends=True)
    changed = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        record = json.loads(line)
        if relabel_line(record):
            lines[i] = json.dumps(record, allow_nan=False) + "\n"
            changed += 1
    if changed:
        path.write_text("".join(lines))
    return changed


def main(argv: list[str]) -> int:
    paths = [pathlib.Path(a) for a in argv] or [record_path("experiments/full.jsonl")]
    for path in paths:
        print(f"{path}: {relabel_file(path)} line(s) relabelled")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
