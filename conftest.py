"""Loaded by every pytest run in this checkout, also one that collects only book/ or labs/ (nbval)."""
from tools.nbtools import TESTED_CPU_KERNELS, pin_cpu_kernels

# Before torch is imported; the kernels nbval starts inherit it: ATen's other kernel family than the
# stored outputs', so that every run compares across CPUs' rounding (see pin_cpu_kernels).
pin_cpu_kernels(TESTED_CPU_KERNELS)


def pytest_collection_modifyitems(items):
    # nbval's cells carry the `notebooks` marker too, so that -m "not notebooks" leaves every notebook out.
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker("notebooks")
