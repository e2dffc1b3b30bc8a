"""The errata appendix covers the whole source article: every numbered section has at least one row, and
every row has a verdict and says where the course shows it (a cell on the page, a chapter, or a source).

The article is not part of the repository; its section numbers are listed here, in its own order (一 … 七
and the numbered subsections of 三 to 六), together with the five numbered lessons of its §七.
"""

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "book" / "appendix_errata.ipynb"

ARTICLE_SECTIONS = ("一", "二", "三", "3.1", "3.2", "3.3", "四", "4.1", "4.2", "4.3",
                    "五", "5.1", "5.2", "5.3", "六", "6.1", "6.2", "6.3", "七")
LESSONS = ("1", "2", "3", "4", "5")  # §七's numbered lessons
VERDICTS = {"wrong", "partly right", "unsupported", "holds"}
HEADER = ["Claim in the article", "Where", "Verdict", "What is right", "Shown in"]
WHERE = re.compile(r"§([一二三四五六七]|\d\.\d)(?: \(([1-5])\))?")


def _cells(row: str) -> list[str]:
    # Split a markdown table row on the pipes that are not escaped (\| stands for |g| in the text).
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _page():
    cells = json.loads(PAGE.read_text())["cells"]
    markdown = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    rows, in_table = [], False
    for text in markdown:
        for line in text.splitlines():
            if not line.startswith("|"):
                in_table = False
                continue
            cols = _cells(line)
            if cols == HEADER:
                in_table = True
            elif in_table and not set("".join(cols)) <= set("-: "):
                rows.append(cols)
    return rows, "\n".join(markdown)


def test_every_row_has_a_verdict_a_where_and_a_place_that_shows_it():
    rows, _ = _page()
    assert len(rows) >= 40, f"only {len(rows)} errata rows"
    for claim, where, verdict, right, shown in rows:
        assert WHERE.fullmatch(where), f"{claim[:60]!r}: 'Where' must be an article section like §3.1, got {where!r}"
        assert verdict in VERDICTS, f"{claim[:60]!r}: verdict {verdict!r} is not one of {sorted(VERDICTS)}"
        assert len(right) > 40, f"{claim[:60]!r}: say what is right"
        assert re.search(r"\{(doc|ref|cite)\}`", shown), f"{claim[:60]!r}: 'Shown in' names no cell, chapter or source"


def test_every_numbered_section_and_lesson_of_the_article_has_a_row():
    rows, _ = _page()
    found = [WHERE.fullmatch(where).groups() for _, where, *_ in rows if WHERE.fullmatch(where)]
    missing = [s for s in ARTICLE_SECTIONS if s not in {sec for sec, _ in found}]
    assert missing == [], f"no errata row for the article's §{', §'.join(missing)}"
    lessons = {n for sec, n in found if sec == "七" and n}
    assert lessons == set(LESSONS), f"§七's lessons without a row: {sorted(set(LESSONS) - lessons)}"


def test_every_reference_to_a_cell_on_the_page_has_its_label():
    _, text = _page()
    labels = set(re.findall(r"^\(([\w-]+)\)=$", text, flags=re.M))
    refs = set(re.findall(r"\{ref\}`([\w-]+)`", text))
    assert refs and refs <= labels, f"references without a label on the page: {sorted(refs - labels)}"
