import matplotlib

# Tests that draw must never open a window. (MPLBACKEND is deliberately not exported: notebook kernels
# started by nbval inherit the environment and would then not display figures inline.)
matplotlib.use("Agg")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_torch():
    # Every test starts from the same global random state, so a test that draws without its own generator
    # sees the same numbers whichever tests ran before it (two such tests used to pass or fail with the order).
    torch.manual_seed(0)
    yield
