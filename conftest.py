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


def pytest_collection_modifyitems(items):
    # nbval's cells carry the `notebooks` marker too, so that -m "not notebooks" leaves every notebook out.
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker("notebooks")
