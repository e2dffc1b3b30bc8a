"""The built wheel carries the course data (commlab/data/), and a non-editable install reads it.

The wheel is built offline from a copy of the package (``pip wheel --no-deps --no-build-isolation``, so no
download and no build/ folder in the checkout), then unpacked into a target folder that a fresh Python
process, started in another directory, imports commlab from.
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from commlab import data

pytestmark = pytest.mark.slow  # builds a wheel: seconds, not in the fast lane

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "commlab"


def _names_in_code() -> set[str]:
    """The data files the package's modules name (string literals such as ``"hardware.json"``)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "data":
            continue
        names.update(re.findall(r'"((?:[\w-]+/)*[\w-]+\.jsonl?)"', path.read_text(encoding="utf-8")))
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(PACKAGE, src / "commlab", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("commlab_course-*.whl")
    return built


def test_the_wheel_holds_every_data_file(wheel):
    in_wheel = {n[len("commlab/data/"):] for n in zipfile.ZipFile(wheel).namelist()
                if n.startswith("commlab/data/") and not n.endswith(".py")}
    assert data.names(), "commlab/data/ holds no data"
    assert set(data.names()) <= in_wheel, f"missing from the wheel: {sorted(set(data.names()) - in_wheel)}"
    named = _names_in_code()
    assert {"hardware.json", "clusters.json", "software.json", "experiments/slow_link.json"} <= named
    assert named <= in_wheel, f"named in commlab but not in the wheel: {sorted(named - in_wheel)}"


def test_a_non_editable_install_reads_its_data_from_another_directory(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # what pip install puts in site-packages
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import commlab, commlab.data as d; from commlab.topology import load_preset; "
            "from commlab.parallel.planner import load_model, load_software; "
            "from commlab.experiments import grid; "
            "print(commlab.__file__); load_preset('dgx-h100-ndr', nodes=2); load_model('llama3-405b'); "
            "load_software('megatron-core'); print(len(grid.load_records(grid.default_path('full'))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    where, records = proc.stdout.split()
    assert Path(where).is_relative_to(site) and int(records) > 0
    # Recording into an installed package is refused with a pointer to --out.
    proc = subprocess.run([sys.executable, "-c", "import commlab.data as d; d.record_path('experiments/x.jsonl')"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--out" in proc.stderr
