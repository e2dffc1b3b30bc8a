"""Loaded by every pytest run in this checkout, also one that collects only book/ or labs/ (nbval)."""
import os
import platform

# nbval compares notebook outputs digit for digit, and ATen picks its vectorised CPU kernels by the machine:
# AVX-512 kernels sum in other orders than AVX2 ones, so a training curve stored on one CPU drifts on the
# other (seen: a CI machine without AVX-512 got PowerSGD's accuracy 0.883 against a stored 0.894). On x86-64
# every notebook therefore runs ATen's AVX2 kernels, which any x86-64 CPU of the last decade has (elsewhere
# the value would be invalid, and torch would warn into the outputs). The kernels nbval starts inherit it;
# set before torch is imported. tools/nbtools.py and scripts/build_book.sh do the same. It pins ATen's own
# kernels, not MKL's or oneDNN's, which gave the same results on both kinds of machine.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
