"""Tracker.progress: a live line on a terminal; into a log, a line at most every
PLAIN_PROGRESS_EVERY_S seconds plus the step's first and final one (issue 14)."""

import io

from rich.console import Console

from rlkit.config.schema import TrackingConfig
from rlkit.tracking import PLAIN_PROGRESS_EVERY_S, Tracker


def _tracker(tmp_path, terminal):
    t = Tracker(TrackingConfig(wandb="disabled", progress=True), tmp_path, "r", {})
    out = io.StringIO()
    t._console = Console(file=out, force_terminal=terminal, width=200)
    now = [0.0]
    t._clock = lambda: now[0]
    return t, out, now


def _poll(t, now, step, target, seconds):
    """The driver's poll every 0.5 s for `seconds`, groups done rising to target."""
    polls = int(seconds / 0.5)
    for i in range(polls + 1):
        t.progress(step, target * i // polls, target, 100 * i, max(now[0], 0.1))
        now[0] += 0.5


def test_progress_into_a_log_is_throttled_and_keeps_the_final_line(tmp_path):
    t, out, now = _tracker(tmp_path, terminal=False)
    _poll(t, now, 1, 64, 35.0)  # 71 polls
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # the first, one each PLAIN_PROGRESS_EVERY_S (35 s: 3 more), and the final 64/64
    assert len(lines) == 1 + int(35.0 // PLAIN_PROGRESS_EVERY_S) + 1, lines
    assert lines[0].startswith("  step 1: 0/64") and lines[-1].startswith("  step 1: 64/64")
    _poll(t, now, 2, 8, 2.0)  # a short step: its first line and its final one
    lines = out.getvalue().splitlines()[len(lines):]
    assert [line.split(",")[0] for line in lines] == ["  step 2: 0/8 groups", "  step 2: 8/8 groups"]
    t.close()


def test_progress_on_a_terminal_redraws_one_line_every_poll(tmp_path):
    t, out, now = _tracker(tmp_path, terminal=True)
    _poll(t, now, 1, 64, 5.0)
    assert out.getvalue().count("\r") == 11 and "\n" not in out.getvalue()
    t.close()
