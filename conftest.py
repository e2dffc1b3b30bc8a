"""Loaded by every pytest run in this checkout, also one that collects only book/ or labs/ (nbval)."""
import os

import pytest

from tools.nbtools import TESTED_CPU_KERNELS, pin_cpu_kernels


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    # nbval starts a notebook's kernel in the setup of its first cell, and the kernel inherits the environment:
    # pin it to ATen's other kernel family than the stored outputs' (see pin_cpu_kernels), so that every run
    # compares across CPUs' rounding. Only the kernels: the tests themselves keep the machine's fast kernels.
    if item.path.suffix != ".ipynb" or "ATEN_CPU_CAPABILITY" in os.environ:
        return (yield)
    pin_cpu_kernels(TESTED_CPU_KERNELS)
    try:
        return (yield)
    finally:
        os.environ.pop("ATEN_CPU_CAPABILITY", None)


#: The files that take longest in scripts/test.sh's two runs on pytest-xdist's workers (pytest --durations on 2
#: busy cores: tests/ over ~40 s each, notebooks over ~40 s, the book's build with the browser check), longest
#: first. Those runs (-n 2 --dist loadfile --no-loadscope-reorder) hand them out first, so that the many short
#: files fill in behind them and no long one starts last and runs alone at the end (xdist's own order, most
#: tests first, put the two-test GPU check and wheel files last). The order changes when a test runs, never
#: what runs; a plain run (no workers) keeps the files' own order.
LONGEST_FILES = ("test_capstone_train.py", "test_capstone_faults.py", "test_cluster.py", "test_gpu_check.py",
                 "test_launch_env.py", "test_zero1.py", "test_planner.py", "test_ring.py", "test_experiments.py",
                 "test_nbtools.py", "test_launch_standalone.py", "test_powersgd_hooks.py", "test_algorithms.py",
                 "test_wheel.py", "test_lost_work.py",
                 "ch14_capstone.ipynb", "test_book.py", "test_browser.py", "ch04_compression_foundations.ipynb",
                 "lab14_capstone.ipynb", "lab03_calibrate_alpha_beta.ipynb", "ch05_sparsification.ipynb",
                 "appendix_planner.ipynb", "ch06_quantization_and_sign.ipynb")
#: Files that share one session fixture (the book built once, tests/conftest.py's built_book): one worker runs both.
ONE_WORKER = ("tests/test_book.py", "tests/test_browser.py")


def pytest_collection_modifyitems(config, items):
    # nbval's cells carry the `notebooks` marker too, so that -m "not notebooks" leaves every notebook out.
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker("notebooks")
    if hasattr(config, "workerinput"):   # a pytest-xdist worker: the longest files first (stable within a file)
        first = {name: i for i, name in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: first.get(item.path.name, len(first)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files of ONE_WORKER as one unit: two workers would each build the book."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _LoadFileBookTogether(LoadFileScheduling):
        def _split_scope(self, nodeid):
            return "the book" if nodeid.startswith(ONE_WORKER) else super()._split_scope(nodeid)

    return _LoadFileBookTogether(config, log)
