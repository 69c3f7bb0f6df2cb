"""`rlkit bench view`: how fast `rlkit view` shows a large run, in headless Chromium.

On a run folder (`--run`) or, by default, a simulator run of at least `--requests` requests
(partial rollouts on 8 simulated engines, 64 groups of 8 a step), it serves the viewer and
loads each page `--repeats` times in Debian's Chromium (driven by Playwright, the test extra),
timing the navigation until the page is drawn (the charts' canvases, the timeline's canvas
with every request in view, the group table). It also times one redraw of the whole timeline
(a zoom or pan), and the server's answer for each page's data, cold and cached, with its size.
Reported as medians, with any console error the page logged; nothing here is asserted (the
CLI smoke test runs it small and checks the pages loaded clean).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from rlkit.bench.report import add_out_argument, out_folder, write_report

CHROMIUM = "/usr/bin/chromium"
READY = {"steps": "#step-panels .panel canvas, #step-panels .empty",
         "engines": "#engine-canvas[data-drawn]",
         "groups": "#group-summary:not(:empty)",
         "advice": "#advice-list > *"}
REDRAW = "() => { const t = performance.now(); for (let i = 0; i < 5; i++) drawEngines(); return (performance.now() - t) / 5; }"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=10_000,
                        help="simulate a run with at least this many requests (ignored with --run)")
    parser.add_argument("--run", type=Path, help="measure on this run folder instead")
    parser.add_argument("--repeats", type=int, default=3, help="loads of each page (median reported)")
    parser.add_argument("--chromium", default=CHROMIUM, help="the browser (Debian's chromium)")
    add_out_argument(parser, "view")


def simulated_run(folder: Path, requests: int) -> int:
    """A simulator run folder with at least `requests` requests; how many it has."""
    from rlkit.rollout.engines.profile import constant_profile
    from rlkit.rollout.policies import PartialPolicy
    from rlkit.sim.engine import SimConfig
    from rlkit.sim.simulate import run_simulation
    from rlkit.sim.trace import TraceSpec, generate_trace
    from rlkit.sim.train_time import TrainTimeModel
    from rlkit.view.run_data import RunData

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "timeline.jsonl").unlink(missing_ok=True)
    batch, group = 64, 8
    per_step = batch * group * 7 // 4  # over-provisioned 2x, less the groups parked early
    steps = max(1, -(-requests // per_step))
    trace = generate_trace(TraceSpec(rows=max(256, 2 * steps * batch), epochs=2, cap=4096,
                                     group_size=group, batch_size=batch))
    run_simulation(SimConfig(8, constant_profile([0.01, 0.02, 0.04], [1, 64, 256],
                                                 prefill_s_per_token=1e-5)),
                   trace, PartialPolicy(2.0), steps=steps, batch_size=batch,
                   timeline_path=folder / "timeline.jsonl",
                   train=TrainTimeModel(params=4e9, gpus=8), mode="async")
    return len(RunData(folder).timeline()["spans"]["lane"])


def measure(folder: Path, repeats: int, chromium: str = CHROMIUM) -> dict[str, Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise SystemExit("rlkit: bench view needs playwright (pip install 'rlkit[test]') and "
                         f"Chromium at {chromium} (Debian: apt-get install chromium)") from None
    from rlkit.view.run_data import RunData
    from rlkit.view.server import ViewServer

    run = RunData(folder)
    server = ViewServer(run).start()
    api: dict[str, dict[str, float]] = {}
    for what in ("overview", "steps", "timeline", "groups", "advice"):
        t0 = time.perf_counter()
        body = server.api(what, {})
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        server.api(what, {})
        api[what] = {"cold_s": cold, "cached_s": time.perf_counter() - t0, "bytes": len(body or b"")}
    loads: dict[str, list[float]] = {name: [] for name in READY}
    errors: list[str] = []  # what the page said went wrong (reported: a bench asserts nothing)
    redraw: list[float] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=[
                "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"])
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.goto(server.url)  # the token's cookie, once
            for _ in range(repeats):
                for name, ready in READY.items():
                    page.goto("about:blank")
                    t0 = time.perf_counter()
                    page.goto(server.url.split("?")[0] + f"#{name}")
                    page.wait_for_selector(ready)
                    loads[name].append(time.perf_counter() - t0)
                    if name == "engines":
                        redraw.append(page.evaluate(REDRAW) / 1e3)
            browser.close()
    finally:
        server.stop()
    return {"run": str(folder), "requests": len(run.timeline()["spans"]["lane"]),
            "engines": len([w for w in run.timeline()["workers"] if not w.startswith("frozen:")]),
            "page_load_s": {k: statistics.median(v) for k, v in loads.items()},
            "timeline_redraw_s": statistics.median(redraw), "api": api, "repeats": repeats,
            "page_errors": errors}


def table(r: dict[str, Any]) -> str:
    lines = [f"`rlkit view` on {r['requests']:,} requests, {r['engines']} engines "
             f"(median of {r['repeats']} loads each, headless Chromium):", "",
             "| page | load until drawn (s) | data (bytes) | server, cold (s) | server, cached (s) |",
             "|---|---|---|---|---|"]
    for name, s in r["page_load_s"].items():
        a = r["api"].get("timeline" if name == "engines" else name, {})
        lines.append(f"| {name} | {s:.2f} | {a.get('bytes', 0):,} | {a.get('cold_s', 0):.3f} | "
                     f"{a.get('cached_s', 0):.4f} |")
    lines += ["", f"Timeline redraw (a zoom or pan, every request): {r['timeline_redraw_s'] * 1e3:.1f} ms"]
    if r["page_errors"]:
        lines += ["", "Errors the page reported: " + "; ".join(r["page_errors"][:5])]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    out = out_folder(args.out)
    folder = args.run
    if folder is None:
        folder = out / "simulated-run"
        n = simulated_run(folder, args.requests)
        print(f"simulated a run of {n:,} requests in {folder}")
    result = measure(Path(folder), args.repeats, args.chromium)
    text = table(result)
    print(text)
    write_report(out, "view", result, text)
    return 0
