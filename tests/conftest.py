import matplotlib

# Tests that draw must never open a window. (MPLBACKEND is deliberately not exported: notebook kernels
# started by nbval inherit the environment and would then not display figures inline.)
matplotlib.use("Agg")

import os

import pytest
import torch
from hypothesis import settings

# In CI the property tests draw the same examples on every run (derandomize), so a run is red only for a
# change, never for a new example that a random draw happened upon; locally they keep exploring. A found
# example is pinned with @example next to its test.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _seed_torch():
    # Every test starts from the same global random state, so a test that draws without its own generator
    # sees the same numbers whichever tests ran before it (two such tests used to pass or fail with the order).
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def built_book(tmp_path_factory):
    """The book built strictly from its stored outputs, once per test session (test_book checks the
    build, test_browser reads it in Chromium); deleted at the end of the session."""
    import shutil

    from tests.book_build import build_strictly

    workdir = tmp_path_factory.mktemp("book")
    yield build_strictly(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
