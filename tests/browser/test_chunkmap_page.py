"""The chunk map page in a real browser: Debian's Chromium, headless, driven by Playwright.

Opens the page from disk (file://, no server), fails on any console error or page error,
finds the terminal chunk by its group/chunk label, switches episodes, and saves a screenshot
next to the page (look at it: tests/browser/README.md says where).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keytrace.analysis.diff import diff
from keytrace.format.reader import open_trace
from keytrace.report.html import write_page
from tests.conftest import chromium_path, require_vllm
from tests.unit.test_chunkmap import two_shortfalls

SHOTS = os.environ.get("KEYTRACE_SCREENSHOTS")  # a folder to keep the screenshots in


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    exe = chromium_path()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser: Any, page_path: Path) -> tuple[Any, list[str]]:
    page = browser.new_page(viewport={"width": 1500, "height": 760})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("request", lambda r: None if r.url.startswith("file:") else problems.append(r.url))
    page.goto(page_path.as_uri())
    return page, problems


def _shot(page: Any, tmp_path: Path, name: str) -> Path:
    out = Path(SHOTS) if SHOTS else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000  # a drawn page, not a blank one
    return path


def test_episodes_switch_and_chunks_explain_themselves(browser: Any, tmp_path: Path) -> None:
    trace = open_trace(str(two_shortfalls(tmp_path / "t")))
    report = diff(trace, maps=200)
    html = tmp_path / "map.html"
    write_page(str(html), report)
    page, problems = _open(browser, html)
    # the first mismatch is selected: r2, terminal group 1 chunk 4
    terminal = page.locator("rect.chunk.terminal")
    assert terminal.count() == 1
    assert (terminal.get_attribute("data-group"), terminal.get_attribute("data-chunk")) == (
        "1",
        "4",
    )
    assert "r2" in page.locator("#summary").inner_text()
    terminal.hover()
    tip = page.locator("#tooltip").inner_text()
    assert "group 1" in tip and "chunk 4" in tip and "never_offered" in tip and "MISS" in tip
    terminal.click()
    assert "TERMINAL KEY" in page.locator("#details").inner_text()
    # switch to the explained episode from the list
    page.locator("nav .ep", has_text="r5").click()
    assert "r5" in page.locator("#summary").inner_text()
    assert "TERMINAL" not in page.locator("#details").inner_text()  # r2 pinned chunk is gone
    assert page.locator("nav .ep.selected").inner_text().startswith("explained")
    page.locator("rect.chunk.terminal").hover()
    assert "stored, then evicted" in page.locator("#tooltip").inner_text()
    assert page.evaluate("location.hash") == "#ep=1"
    _shot(page, tmp_path, "two-shortfalls.png")
    # a link to an episode opens it
    page2, problems2 = _open(browser, html)
    page2.goto(html.as_uri() + "#ep=1")
    page2.reload()
    assert "r5" in page2.locator("#summary").inner_text()
    assert problems == [] and problems2 == []


def test_the_stock_17975_miss_on_the_real_scheduler(browser: Any, tmp_path: Path) -> None:
    require_vllm()
    from keytrace.analysis.geometry import builtin
    from keytrace.vllm.lab.replay import replay

    d = str(tmp_path / "trace")
    replay(builtin("dsv4"), [17_975], 17_975, trace_dir=d)
    trace = open_trace(d)
    report = diff(trace, maps=200)
    html = tmp_path / "chunkmap-17975.html"
    write_page(str(html), report)
    page, problems = _open(browser, html)
    _shot(page, tmp_path, "chunkmap-17975.png")  # as it opens: README's picture
    # group 2 (SWA, MTP): chunk 277 (tokens 17,728-17,792) was never offered by the store
    terminal = page.locator("rect.chunk.terminal")
    assert (terminal.get_attribute("data-group"), terminal.get_attribute("data-chunk")) == (
        "2",
        "277",
    )
    terminal.hover()
    tip = page.locator("#tooltip").inner_text()
    assert "tokens 17,728-17,792" in tip and "never offered by the chain" in tip
    # its neighbours in the window were stored and hit
    right = page.locator('rect.chunk[data-group="2"][data-chunk="278"]')
    assert "needed" in (right.get_attribute("class") or "")
    assert right.get_attribute("fill") == "#66bb6a"
    assert page.locator('rect.lookup[data-result="MISS"]').count() > 0
    assert "E 17,920" in (page.locator("svg#chunkmap").text_content() or "")
    assert problems == []
