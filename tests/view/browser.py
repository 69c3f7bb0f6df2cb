"""Every page of `rlkit view` in a real browser: Debian's Chromium, driven by Playwright
(tools/test.sh installs both; without them the check skips, except in CI where it fails).

`check_pages(folder)` serves the run folder, loads each page, and checks its structure against
the data layer's answer (panels, lanes = engines, requests drawn, groups, sample tokens,
advice), no console error or page error, and a screenshot of each page that is not blank."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from rlkit.view.run_data import RunData
from rlkit.view.server import ViewServer

CHROMIUM = os.environ.get("RLKIT_CHROMIUM", "/usr/bin/chromium")
# what this machine's closed network needs of Chromium (no background connections), as root
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = ("steps", "engines", "groups", "advice", "recipe")


def browser_or_skip():
    """Playwright's sync API, or a skip (a failure in CI, which installs both)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if sync_playwright is None or not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        why = f"needs playwright and Chromium at {CHROMIUM} (tools/test.sh installs them)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return sync_playwright


def check_pages(folder: Path, screenshots: Path | None = None, compare: Path | None = None) -> dict[str, Any]:
    sync_playwright = browser_or_skip()
    run = RunData(folder, compare=compare)
    steps, timeline, advice = run.steps(), run.timeline(), run.advice()
    groups = run.groups()
    engines = [w for w in timeline["workers"] if not w.startswith("frozen:")]
    server = ViewServer(run).start()
    problems: list[str] = []
    seconds: dict[str, float] = {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            for name in PAGES:
                t0 = time.perf_counter()
                page.goto(server.url + f"#{name}" if name == "steps" else server.url.split("?")[0] + f"#{name}")
                if name == "steps":
                    page.wait_for_selector("#step-panels .panel canvas" if steps["panels"] else "#step-panels .empty")
                    assert page.locator("#step-panels .panel").count() == len(steps["panels"])
                elif name == "engines":
                    page.wait_for_selector("#engine-canvas[data-drawn]")
                    canvas = page.locator("#engine-canvas")
                    assert int(canvas.get_attribute("data-lanes")) == len(engines)
                    assert int(canvas.get_attribute("data-drawn")) == len(timeline["spans"]["lane"])
                    assert page.evaluate(INKED, "engine-canvas") > 0.01
                elif name == "groups":
                    page.wait_for_selector("#group-summary:not(:empty)")
                    assert page.locator("#group-table tbody tr").count() == len(groups["groups"])
                    if groups["samples"]:
                        first = groups["samples"][0]
                        assert page.locator("#sample-tokens span").count() == len(first["ids"])
                        for mode in ("mask", "logprob", "trainer", "teacher", "version"):
                            page.select_option("#sample-colour", mode)
                        if len(groups["samples"]) > 1:
                            page.click("#sample-next")
                            assert page.locator("#sample-tokens span").count() == len(groups["samples"][1]["ids"])
                elif name == "advice":
                    page.wait_for_selector("#advice-list > *")
                    assert page.locator("#advice-list .advice").count() == len(advice)
                else:
                    page.wait_for_selector("#run-files div")
                    assert page.locator("#recipe-text").inner_text().strip() == (
                        run.overview()["recipe"].strip() or "(no recipe.yaml: a simulator run)")
                seconds[name] = time.perf_counter() - t0
                if screenshots is not None:
                    screenshots.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(screenshots / f"{name}.png"), full_page=True)
            browser.close()
    finally:
        server.stop()
    assert problems == [], problems
    return {"seconds": seconds, "engines": len(engines), "requests": len(timeline["spans"]["lane"])}


# the share of a canvas's pixels that are not white: the timeline was drawn
INKED = """(id) => {
  const c = document.getElementById(id), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let inked = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i] < 240 || d[i + 1] < 240 || d[i + 2] < 240) inked++;
  return inked / (d.length / 4);
}"""


def docs_screenshots(folder: Path, out: Path) -> None:
    """The pages of a run as docs/viewer/ shows them: every page checked (check_pages), then the
    Engines page zoomed on the step of the first saved sample that spans two weight versions,
    and that sample on the Groups page, coloured by version."""
    check_pages(folder, screenshots=out)
    run = RunData(folder)
    step, index = next(((s, i) for s in run.sample_steps() for i, x in enumerate(run.samples(s))
                        if len(set(x["versions"])) > 1), (None, 0))
    if step is None:
        return
    sync_playwright = browser_or_skip()
    server = ViewServer(run).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(server.url)  # the token's cookie
            page.goto(server.url.split("?")[0] + "#engines")
            page.wait_for_selector("#engine-canvas[data-drawn]")
            page.select_option("#engine-step", str(step))
            page.screenshot(path=str(out / f"engines-step{step}.png"), full_page=True)
            page.goto(server.url.split("?")[0] + "#groups")
            page.wait_for_selector("#group-summary:not(:empty)")
            page.select_option("#group-step", str(step))
            page.wait_for_timeout(500)  # the step's groups: drawn once fetched (docs only)
            for _ in range(index):
                page.click("#sample-next")
            page.screenshot(path=str(out / f"groups-step{step}.png"), full_page=True)
            browser.close()
    finally:
        server.stop()


if __name__ == "__main__":  # python -m tests.view.browser RUN OUT: docs/viewer's screenshots
    import sys

    docs_screenshots(Path(sys.argv[1]), Path(sys.argv[2]))
