"""The viewer's pages in headless Chromium over a simulator run folder (a tiny-model run's
folder: tests/e2e/test_train_tiny.py)."""

from __future__ import annotations

import pytest

from tests.view.browser import check_pages

pytestmark = pytest.mark.integration


def test_every_page_of_a_simulator_run_loads_in_chromium(sim_run, tmp_path):
    folder, _ = sim_run
    from tests.view.conftest import simulate_run

    simulate_run(tmp_path / "other", steps=2)
    out = check_pages(folder, screenshots=tmp_path / "shots", compare=tmp_path / "other")
    assert out["engines"] == 2
    for name in ("steps", "engines", "groups", "advice", "recipe"):
        png = (tmp_path / "shots" / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000

