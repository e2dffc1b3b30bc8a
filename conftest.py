"""Loaded by every pytest run in this checkout, also one that collects only book/ or labs/ (nbval)."""
from tools.nbtools import pin_cpu_kernels

pin_cpu_kernels()  # before torch is imported: the kernels nbval starts inherit it (see its docstring)
