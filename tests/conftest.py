import matplotlib

# Tests that draw must never open a window. (MPLBACKEND is deliberately not exported: notebook kernels
# started by nbval inherit the environment and would then not display figures inline.)
matplotlib.use("Agg")
