"""Small helpers shared by the multi-process tests."""

import os

import pytest


def child_pids(pid: int | None = None) -> list[int]:
    """PIDs whose parent is ``pid`` (default: this process), read from /proc; zombies included.

    multiprocessing's own resource tracker (started once by a spawn launch, and meant to live as long as
    the parent) is not counted.
    """
    pid = os.getpid() if pid is None else pid
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"resource_tracker" in f.read():
                        continue
            except OSError:
                pass
            found.append(int(entry))
    return found


def processes_mentioning(token: str) -> list[int]:
    """PIDs (other than this process) whose command line or environment contains ``token``, read from /proc.

    A torchrun job's agents carry its run id on their command line and its workers in their environment
    (``TORCHELASTIC_RUN_ID``): after a job ends, nothing should mention its id any more.
    """
    needle = token.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        for what in ("cmdline", "environ"):
            try:
                with open(f"/proc/{entry}/{what}", "rb") as f:
                    if needle in f.read():
                        found.append(int(entry))
                        break
            except OSError:
                continue
    return found


def exit_status(main, argv, capsys) -> tuple:
    """Run a command line's ``main(argv)`` in this process: ``(exit status, stderr)``.

    A usage error is argparse's ``SystemExit(2)`` or ``main`` returning 2; any other exception (a traceback
    for the user) propagates and fails the test. ``capsys`` is pytest's fixture; what was captured before
    the call is dropped.
    """
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


#: World sizes 1..8 for the exhaustive collective checks; 5..8 ranks on 2 cores are `slow` (full suite only).
WORLD_SIZES_1_TO_8 = [*range(1, 5), *(pytest.param(n, marks=pytest.mark.slow) for n in range(5, 9))]
