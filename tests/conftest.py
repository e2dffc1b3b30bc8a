import os

# Matplotlib must never try to open a window in tests.
os.environ.setdefault("MPLBACKEND", "Agg")
