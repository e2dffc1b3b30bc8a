"""The built book as a reader meets it: every page of ``_toc.yml`` opened in headless Chromium.

The book is the strict build from stored outputs that tests/test_book.py checks (the session's
``built_book`` fixture, built once), served on 127.0.0.1 by a thread running ``http.server``. Chromium is
Debian's (``.ci/run`` installs it with apt-get), driven through the ``playwright`` package; where it is
missing or cannot start, every test here is skipped with a message that says why.

For every page it checks: no console errors; no failed requests; no request that leaves 127.0.0.1
(every request is intercepted and any other host is aborted and counted, so the book must read offline);
every image loaded, has a real alt text (not empty, not a file path or hash) and sits in a figure
captioned "Figure N"; all maths typeset by
MathJax; no code cell, output, table or display formula wider than the 688 px text column at a 1280 px
window. Sphinx's search page must find results for a few terms. Screenshots of a few key pages go to
``$COMMLAB_BROWSER_ARTIFACTS`` (default ``_build/browser-artifacts/``), with the per-page table as
``report.txt`` (and every offender in ``report.json``); the table is printed as well.
At a phone's 390 px width a few pages are checked in CI, every page with ``COMMLAB_BROWSER_PHONE=all``.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import pathlib
import shutil
import threading
import time
import urllib.parse

import pytest

from tests.book_build import ROOT, toc_files

# It reads the book build (marked like test_book's build, so `-m "not notebooks"` skips both).
pytestmark = pytest.mark.notebooks

CHROMIUM = os.environ.get("COMMLAB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = pathlib.Path(os.environ.get("COMMLAB_BROWSER_ARTIFACTS") or ROOT / "_build" / "browser-artifacts")
VIEWPORT = {"width": 1280, "height": 900}
COLUMN_PX = 688  # the theme's text column at a 1280 px window (checked below against the page itself)
SEARCH_TERMS = ["AllReduce", "PowerSGD", "bucket", "pipeline"]
SCREENSHOTS = {
    "home": "book/intro",
    "ch02": "book/ch02_ring_collectives",
    "ch08": "book/ch08_does_compression_pay",
    "lab02": "labs/lab02_ring_reduce_scatter_all_gather",
}
# A phone's width (390 px): on these pages the page itself must not scroll sideways and every figure must
# shrink to the screen (wide tables may scroll inside their own box there).
PHONE = {"width": 390, "height": 844}
PHONE_PAGES = ["book/intro", "book/ch02_ring_collectives", "book/ch03_collective_algorithms",
               "book/ch10_parallelism_patterns", "labs/lab02_ring_reduce_scatter_all_gather"]
# COMMLAB_BROWSER_PHONE=all checks every page at 390 px instead (about 1.5 s a page: a release check, kept
# out of CI's time budget).
PHONE_ALL = os.environ.get("COMMLAB_BROWSER_PHONE") == "all"
PHONE_JS = r"""
() => {
  const over = [...document.querySelectorAll("article img, article pre, article mjx-container")]
    .filter((e) => e.getBoundingClientRect().width > window.innerWidth + 1 && !e.closest("table"))
    .map((e) => `${e.tagName.toLowerCase()} ${Math.round(e.getBoundingClientRect().width)} px`);
  return {page_width: document.documentElement.scrollWidth, over};
}
"""
# The only flags besides playwright's own: no background traffic of Chromium's own (updates, sync,
# field trials), which the routing below would otherwise count against the book.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


# Runs in the page: what the checks need, measured after MathJax's first typeset.
MEASURE_JS = r"""
(column_px) => {
  const article = document.querySelector("article.bd-article") || document.querySelector("main") || document.body;
  const alt_is_fake = (a) => !a.trim() || /\.(png|jpe?g|svg|gif|webp)$/i.test(a.trim()) || /^\S*[\\/]\S*$/.test(a.trim())
                             || /^[0-9a-f]{16,}$/i.test(a.trim());
  const images = [...article.querySelectorAll("img")];
  const broken = images.filter((i) => !(i.complete && i.naturalWidth > 0)).map((i) => i.getAttribute("src"));
  const no_alt = images.filter((i) => alt_is_fake(i.getAttribute("alt") || "")).map((i) => i.getAttribute("src"));
  // A figure is numbered and captioned: the image sits in a <figure> whose <figcaption> reads "Figure N".
  const uncaptioned = images.filter((i) => {
    const caption = i.closest("figure") && i.closest("figure").querySelector("figcaption");
    return !(caption && /^Figure \d+/.test(caption.textContent.trim()));
  }).map((i) => i.getAttribute("src"));
  const maths = [...article.querySelectorAll(".math")];
  const untypeset = maths.filter((m) => !m.querySelector("mjx-container")).map((m) => m.textContent.slice(0, 40));
  // TeX delimiters left in the prose (outside code and outside what MathJax replaced): maths that was
  // never marked up as maths, or that MathJax skipped.
  const walker = document.createTreeWalker(article, NodeFilter.SHOW_TEXT);
  for (let node; (node = walker.nextNode());) {
    if (node.parentElement.closest("pre, code, script, style, mjx-container, .math")) continue;
    if (/\\\(|\\\[/.test(node.textContent)) untypeset.push(node.textContent.trim().slice(0, 40));
  }
  // Leaf kinds only (an output's <pre>, a code block's <pre>, a table, a display formula, an image),
  // so that one too-wide thing is counted once and not again through each of its wrappers.
  // Outputs first: an output's <pre> sits in a div.highlight too, and would otherwise count as code.
  const kinds = [["output", ".cell_output pre"], ["code", ".cell_input pre, div.highlight pre"],
                 ["table", "table"], ["math", "div.math, mjx-container[display='true']"], ["image", "img"]];
  const seen = new Set();
  const wide = [];
  for (const [kind, selector] of kinds) {
    for (const el of article.querySelectorAll(selector)) {
      if (seen.has(el)) continue;
      seen.add(el);
      const width = Math.max(el.scrollWidth, Math.ceil(el.getBoundingClientRect().width));
      if (width > column_px + 1 || el.scrollWidth > el.clientWidth + 1) {
        const text = (el.innerText || el.getAttribute("src") || "").trim().split("\n")[0].slice(0, 60);
        wide.push({kind, width, text});
      }
    }
  }
  const style = getComputedStyle(article);
  const column = article.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  return {column: Math.round(column), page_width: document.documentElement.scrollWidth,
          images: images.length, broken, no_alt, uncaptioned, maths: maths.length, untypeset: untypeset.length,
          raw_math: untypeset, wide};
}
"""


def _say(config, text: str) -> None:
    """Print past pytest's capture, so the table and any skip reason show in CI's log."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(text, flush=True)


def _skip(config, reason: str):
    _say(config, f"\n{'!' * 100}\n!! BROWSER TEST SKIPPED: {reason}\n{'!' * 100}")
    pytest.skip(reason)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would drown the test's own report
        pass


@functools.cache
def _pages() -> list[str]:
    return toc_files()


@pytest.fixture(scope="module")
def report(request):
    """Per page: what MEASURE_JS measured, plus the console errors and requests seen while loading.

    ``COMMLAB_BOOK_HTML=path/to/_build/html`` checks a book built before instead of the session's build
    (for measuring while editing chapters; CI does not set it).
    """
    started = time.monotonic()
    if os.environ.get("COMMLAB_BOOK_HTML"):
        html = pathlib.Path(os.environ["COMMLAB_BOOK_HTML"])
    else:
        built_book = request.getfixturevalue("built_book")
        if built_book.returncode != 0:
            pytest.fail("the book did not build (see test_book.py::test_book_builds_strictly):\n" + built_book.log)
        html = built_book.html
        started = time.monotonic()
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        _skip(request.config, f"the playwright package is not installed ({exc}); pip install -r requirements.txt")
    if not os.access(CHROMIUM, os.X_OK):
        _skip(request.config, f"no Chromium at {CHROMIUM} (apt-get install chromium, or set COMMLAB_CHROMIUM)")

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(html)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    seen = {"console": [], "failed": [], "nonlocal": []}

    def route(r):
        url = urllib.parse.urlsplit(r.request.url)
        if url.scheme in ("http", "https", "ws", "wss") and url.hostname != "127.0.0.1":
            seen["nonlocal"].append(r.request.url)
            r.abort()
        else:
            r.continue_()

    def failed(req):
        # ERR_ABORTED is a load the browser itself cancelled on leaving the page (a font still in flight);
        # a file that is missing answers 404, which response() counts.
        if urllib.parse.urlsplit(req.url).hostname == "127.0.0.1" and "ERR_ABORTED" not in str(req.failure):
            seen["failed"].append(f"{req.url} ({req.failure})")

    def response(resp):
        if resp.status >= 400:
            seen["failed"].append(f"{resp.url} (HTTP {resp.status})")

    results, search, phone = {}, {}, {}
    try:
        with sync_playwright() as pw:
            try:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
            except PlaywrightError as exc:
                _skip(request.config, f"Chromium at {CHROMIUM} did not start: {str(exc).splitlines()[0]}")
            phases = {"launch": time.monotonic() - started}
            context = browser.new_context(viewport=VIEWPORT, service_workers="block")
            context.route("**/*", route)
            page = context.new_page()
            page.on("console", lambda m: m.type == "error" and seen["console"].append(m.text))
            page.on("pageerror", lambda e: seen["console"].append(f"uncaught: {e}"))
            page.on("requestfailed", failed)
            page.on("response", response)
            for name in _pages():
                for v in seen.values():
                    v.clear()
                page_started = time.monotonic()
                page.goto(base + name + ".html", wait_until="load")
                # MathJax typesets after load; its startup promise resolves when the first pass is done
                # (a MathJax that never loaded leaves no promise, and the page's maths stays raw).
                page.evaluate("async () => { const s = window.MathJax && window.MathJax.startup;"
                              " if (s && s.promise) await s.promise; await document.fonts.ready; }")
                measured = page.evaluate(MEASURE_JS, COLUMN_PX)
                measured.update({k: list(v) for k, v in seen.items()})
                measured["seconds"] = round(time.monotonic() - page_started, 1)
                results[name] = measured
                for shot, shot_page in SCREENSHOTS.items():
                    if shot_page == name:
                        page.screenshot(path=str(ARTIFACTS / f"{shot}.png"))
                        figure = page.locator(".cell_output img").first
                        if figure.count():
                            figure.scroll_into_view_if_needed()
                            page.screenshot(path=str(ARTIFACTS / f"{shot}-figure.png"))
            phases["pages"] = time.monotonic() - started - sum(phases.values())
            for term in SEARCH_TERMS:
                page.goto(base + "search.html?q=" + urllib.parse.quote(term), wait_until="load")
                # Sphinx adds results one by one and then writes its summary line: count after that.
                try:
                    page.wait_for_function("() => /Search finished|did not match/.test("
                                           "document.querySelector('.search-summary')?.innerText || '')",
                                           timeout=20_000)
                    search[term] = page.locator("ul.search li").count()
                except PlaywrightError:
                    search[term] = 0  # no summary: the search never finished
            phases["search"] = time.monotonic() - started - sum(phases.values())
            phone_page = browser.new_context(viewport=PHONE, service_workers="block")
            phone_page.route("**/*", route)
            phone_page = phone_page.new_page()
            for name in (_pages() if PHONE_ALL else PHONE_PAGES):
                phone_page.goto(base + name + ".html", wait_until="load")
                phone_page.evaluate("async () => { const s = window.MathJax && window.MathJax.startup;"
                                    " if (s && s.promise) await s.promise; await document.fonts.ready; }")
                phone[name] = phone_page.evaluate(PHONE_JS)
            phone_page.goto(base + "book/ch02_ring_collectives.html", wait_until="load")
            phone_page.locator(".cell_output img").first.scroll_into_view_if_needed()
            phone_page.screenshot(path=str(ARTIFACTS / "ch02-phone.png"))
            phases["phone"] = time.monotonic() - started - sum(phases.values())
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
    table = _table(results, search) + (f"\n(the browser check took {time.monotonic() - started:.0f} s: "
                                       + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()) + ")")
    # Every offender with its kind, width and first line, page by page, for whoever fixes them.
    table += "\nat 390 px: " + ", ".join(f"{n.split('/')[-1]} {r['page_width']} px" for n, r in phone.items())
    (ARTIFACTS / "report.txt").write_text(table + "\n")
    (ARTIFACTS / "report.json").write_text(json.dumps({"pages": results, "search": search, "phone": phone},
                                                      indent=1))
    _say(request.config, "\n" + table)
    return {"pages": results, "search": search, "phone": phone}


def _table(results: dict, search: dict) -> str:
    head = f"{'page':<46} {'console':>7} {'requests':>8} {'no alt':>6} {'overflow':>8} {'widest px':>9} {'maths':>7} {'s':>5}"
    lines = [f"browser check at {VIEWPORT['width']} px (text column {COLUMN_PX} px): errors and offenders per page",
             head, "-" * len(head)]
    for name, r in results.items():
        widest = max((w["width"] for w in r["wide"]), default=0)
        lines.append(f"{name:<46} {len(r['console']):>7} {len(r['failed']) + len(r['nonlocal']):>8} "
                     f"{len(r['no_alt']):>6} {len(r['wide']):>8} {widest:>9} "
                     f"{r['maths'] - r['untypeset']:>3}/{r['maths']:<3} {r['seconds']:>5}")
    total = lambda key: sum(len(r[key]) for r in results.values())  # noqa: E731
    lines.append("-" * len(head))
    lines.append(f"{'total':<46} {total('console'):>7} {total('failed') + total('nonlocal'):>8} "
                 f"{total('no_alt'):>6} {total('wide'):>8}")
    lines.append("search: " + ", ".join(f"{t!r} -> {n} results" for t, n in search.items()))
    return "\n".join(lines)


def _by_page(report, key) -> dict[str, list]:
    return {name: r[key] for name, r in report["pages"].items() if r[key]}


def test_every_page_was_opened(report):
    assert list(report["pages"]) == _pages()


def test_no_console_errors(report):
    assert _by_page(report, "console") == {}


def test_no_request_leaves_127_0_0_1(report):
    # The book must read offline: MathJax and every other script or font come from the build itself.
    assert _by_page(report, "nonlocal") == {}


def test_no_failed_requests(report):
    assert _by_page(report, "failed") == {}


def test_every_image_loaded(report):
    assert _by_page(report, "broken") == {}


def test_every_figure_is_numbered_and_captioned(report):
    assert _by_page(report, "uncaptioned") == {}
    assert sum(r["images"] for r in report["pages"].values()) >= 40  # not vacuous: the book has its figures


def test_on_a_phone_the_page_does_not_scroll_sideways_and_figures_shrink(report):
    assert set(report["phone"]) == set(_pages() if PHONE_ALL else PHONE_PAGES)
    wide = {n: r for n, r in report["phone"].items() if r["page_width"] > PHONE["width"] or r["over"]}
    assert wide == {}


def test_maths_is_typeset(report):
    untypeset = {name: r["raw_math"] for name, r in report["pages"].items() if r["untypeset"]}
    assert untypeset == {}
    # Not vacuous: the chapters do have maths, and the check saw it.
    assert sum(r["maths"] for r in report["pages"].values()) > 100


def test_text_column_is_the_width_the_overflow_check_assumes(report):
    columns = {name: r["column"] for name, r in report["pages"].items()}
    assert set(columns.values()) == {COLUMN_PX}, columns


def test_no_page_scrolls_sideways(report):
    wide = {name: r["page_width"] for name, r in report["pages"].items() if r["page_width"] > VIEWPORT["width"]}
    assert wide == {}


def test_search_finds_results(report):
    assert all(n > 0 for n in report["search"].values()), report["search"]


def _offenders(report, key: str) -> list[str]:
    """Every page's offenders of one kind (none are allowed), with what the report says of each."""
    problems = []
    for name, r in report["pages"].items():
        if r[key]:
            detail = r[key] if key == "no_alt" else [f"{w['kind']} {w['width']} px: {w['text']}" for w in r[key]]
            problems.append(f"{name}: {len(r[key])}: {detail}")
    return problems


def test_images_have_real_alt_text(report):
    assert _offenders(report, "no_alt") == []


def test_nothing_wider_than_the_text_column(report):
    assert _offenders(report, "wide") == []
