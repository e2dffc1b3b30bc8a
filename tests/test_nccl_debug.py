"""The table of debugging environment variables (commlab/data/nccl_debug.json), read through the package's one
data reader: every entry complete, each default and source stated, no name twice. Cheap: it reads one file, and
where torch is installed, checks the PyTorch names against the headers torch ships."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from commlab import data

FIELDS = ("name", "layer", "default", "values", "what_for", "meaning", "source")
LAYERS = {"NCCL", "PyTorch", "CUDA"}
USES = {"hang", "slow", "overlap", "network", "memory"}
LINES = re.compile(r"^\d+(-\d+)?(, \d+(-\d+)?)*$")


@pytest.fixture(scope="module")
def table():
    return data.load_json(None, "nccl_debug.json")


@pytest.fixture(scope="module")
def rows(table):
    return table["variables"]


def test_the_file_says_what_it_was_checked_against(table):
    note = table["_source"]
    assert "v2.30.7-1" in note and "v2.29.7-1" in note and "2.13.0" in note
    assert re.search(r"\d{4}-\d{2}-\d{2}", note), "the note names the date of the check"


def test_every_entry_has_every_field_filled(rows):
    assert len(rows) >= 30
    for row in rows:
        missing = [f for f in FIELDS if f not in row or row[f] in ("", None, {})]
        assert not missing, f"{row.get('name')}: missing {missing}"
        assert all(isinstance(row[f], str) for f in FIELDS if f != "source"), row["name"]
        assert row["layer"] in LAYERS, row
        assert row["what_for"] in USES, row
        assert len(row["meaning"]) <= 200, f"{row['name']}: the meaning is one line"


def test_names_are_environment_variables_of_their_layer(rows):
    prefix = {"NCCL": "NCCL_", "PyTorch": "TORCH_", "CUDA": "CUDA_"}
    for row in rows:
        assert re.fullmatch(r"(NCCL|TORCH|CUDA)_[A-Z0-9_]+", row["name"]), row["name"]
        assert row["name"].startswith(prefix[row["layer"]]), row["name"]
        for alias in row.get("aliases", []):
            assert re.fullmatch(r"(NCCL|TORCH)_[A-Z0-9_]+", alias), alias


def test_no_name_twice_counting_the_aliases(rows):
    names = [row["name"] for row in rows] + [a for row in rows for a in row.get("aliases", [])]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_source_names_a_file_and_its_lines_or_a_documented_section(rows):
    for row in rows:
        src = row["source"]
        if "file" in src:
            assert src["repo"].count("/") == 1 and src["ref"], row["name"]
            assert "." in Path(src["file"]).name, f"{row['name']}: {src['file']} is not a file"
            if src["repo"] != "pytorch/pytorch" or src["file"].endswith((".hpp", ".h", ".py")):
                assert LINES.match(src["lines"]), f"{row['name']}: lines {src['lines']!r}"
        else:
            assert row["layer"] == "CUDA" and src["url"].startswith("https://") and src["section"], row


def test_nccl_sources_cite_the_pinned_tag_the_course_uses_elsewhere(rows):
    pinned = data.load_json(None, "nccl_tuning.json")["pinned"]
    for row in rows:
        if row["layer"] == "NCCL":
            assert row["source"]["repo"] == "NVIDIA/nccl", row["name"]
            assert row["source"]["ref"] == pinned["tag"] and row["source"]["commit"] == pinned["commit"], row["name"]


def test_the_defaults_the_chapter_leans_on(rows):
    by = {row["name"]: row for row in rows}
    assert by["NCCL_DEBUG_SUBSYS"]["default"].startswith("NCCL_INIT | NCCL_BOOTSTRAP | NCCL_ENV")
    assert by["NCCL_IB_TIMEOUT"]["default"] == "20" and by["NCCL_IB_RETRY_CNT"]["default"] == "7"
    assert by["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["default"].startswith("3")
    assert by["TORCH_FR_BUFFER_SIZE"]["default"] == "2000"
    assert by["TORCH_NCCL_DUMP_ON_TIMEOUT"]["default"] == "true"
    assert by["TORCH_DISTRIBUTED_DEBUG"]["default"] == "OFF"


def test_the_pytorch_names_are_the_ones_the_installed_torch_reads(rows):
    torch = pytest.importorskip("torch")
    inc = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
    if not (inc / "ProcessGroupNCCL.hpp").exists():
        pytest.skip("this torch ships no c10d headers")
    text = (inc / "ProcessGroupNCCL.hpp").read_text() + (inc / "FlightRecorder.hpp").read_text()
    for row in rows:
        if row["layer"] == "PyTorch" and row["source"]["file"].endswith(".hpp"):
            for name in [row["name"], *row.get("aliases", [])]:
                assert f'"{name}"' in text, f"{name} is not read by torch {torch.__version__}"
