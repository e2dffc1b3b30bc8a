"""tools/nbtools.py's tag-ignore: nbval's output-ignoring comment becomes a cell tag, and nbval still
ignores that cell's output (checked by running nbval itself on a small notebook); and its CPU-kernel pin:
nbval's kernels run another ATen kernel family than the stored outputs, unless one is set explicitly."""

import os
import pathlib
import subprocess
import sys

import nbformat
import pytest

from tools import nbtools

pytestmark = pytest.mark.slow  # seconds a test (processes, torchrun or training): not in the fast lane


def _notebook(path: pathlib.Path, *cells: tuple[str, str]) -> None:
    # Cells of (source, stored output): a stored output that can never match what the cell prints now
    # makes nbval fail the cell unless it is told to ignore that cell's output.
    nb = nbformat.v4.new_notebook()
    for i, (source, stored) in enumerate(cells):
        cell = nbformat.v4.new_code_cell(source, execution_count=i + 1)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored)]
        nb.cells.append(cell)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def test_tag_ignore_moves_the_comment_into_a_tag(tmp_path):
    nb = tmp_path / "a.ipynb"
    _notebook(nb, ("# NBVAL_IGNORE_OUTPUT\nprint('fresh')", "stored\n"))
    loaded = nbformat.read(nb, as_version=4)
    loaded.cells[0].metadata["tags"] = ["hide-input"]
    nbformat.write(loaded, nb)
    assert nbtools.tag_ignore(str(nb)) == 1
    cell = nbformat.read(nb, as_version=4).cells[0]
    assert cell.source == "print('fresh')"
    assert cell.metadata["tags"] == ["hide-input", "nbval-ignore-output"]
    assert cell.outputs[0]["text"] == "stored\n"
    assert nbtools.tag_ignore(str(nb)) == 0  # idempotent: nothing left to move


def test_tag_ignore_leaves_other_cells_alone(tmp_path):
    nb = tmp_path / "b.ipynb"
    # The marker later in a cell is not the leading line this tool moves (nbval would still read it).
    _notebook(nb, ("x = 1\n# NBVAL_IGNORE_OUTPUT\nprint(x)", "1\n"))
    before = nb.read_text()
    assert nbtools.tag_ignore(str(nb)) == 0
    assert nb.read_text() == before


@pytest.fixture(scope="module")
def nbval_run(tmp_path_factory):
    """nbval itself, run once in a subprocess on the two notebooks of the two tests below (one pytest start
    for both): (the cells tag-ignore moved in tagged.ipynb, nbval's report). The root conftest.py is loaded as
    a plugin, as every run in this checkout loads it, with ATEN_CPU_CAPABILITY unset."""
    tmp = tmp_path_factory.mktemp("nbval")
    # tagged.ipynb: cell 0 carries the comment, then the tag; cell 1 is the same cell with neither: nbval must
    # fail it, or cell 0 passing would prove nothing.
    _notebook(tmp / "tagged.ipynb", ("# NBVAL_IGNORE_OUTPUT\nprint('fresh')", "stored\n"),
              ("print('fresh')", "stored\n"))
    moved = nbtools.tag_ignore(str(tmp / "tagged.ipynb"))
    # kernels.ipynb: the stored "DEFAULT" must match what torch reports inside nbval's kernel.
    _notebook(tmp / "kernels.ipynb", ("import torch\nprint(torch.backends.cpu.get_cpu_capability())", "DEFAULT\n"))
    (tmp / "pytest.ini").write_text("[pytest]\n")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-c",
                           "pytest.ini", "--nbval", "--nbval-current-env", "-rA", "-q", "tagged.ipynb",
                           "kernels.ipynb"], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    return moved, proc.stdout + proc.stderr


@pytest.mark.notebooks
def test_nbval_ignores_the_output_of_a_tagged_cell(nbval_run):
    moved, out = nbval_run
    assert moved == 1
    assert "PASSED tagged.ipynb::Cell 0" in out, out
    assert "FAILED tagged.ipynb::Cell 1" in out, out


def test_pin_cpu_kernels_keeps_an_explicit_value(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    nbtools.pin_cpu_kernels(nbtools.TESTED_CPU_KERNELS)
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    nbtools.pin_cpu_kernels(nbtools.TESTED_CPU_KERNELS)
    assert os.environ["ATEN_CPU_CAPABILITY"] == "default"
    assert nbtools.STORED_CPU_KERNELS != nbtools.TESTED_CPU_KERNELS  # two families, compared on every run


@pytest.mark.notebooks
def test_nbval_kernels_run_the_tested_kernels(nbval_run):
    # The root conftest.py, loaded as a plugin, pins the kernels nbval starts: the stored "DEFAULT" must
    # match what torch reports inside that kernel when nothing else set ATEN_CPU_CAPABILITY.
    _, out = nbval_run
    assert "PASSED kernels.ipynb::Cell 0" in out, out


def test_the_tests_themselves_keep_the_machines_kernels():
    # Only nbval's kernels run the tested family: the suite itself (and the ranks it forks) keeps the fast ones.
    import platform

    import torch
    if "ATEN_CPU_CAPABILITY" in os.environ or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("ATEN_CPU_CAPABILITY set explicitly, or not an x86-64 machine")
    assert torch.backends.cpu.get_cpu_capability() != "DEFAULT"
