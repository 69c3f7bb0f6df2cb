"""Staleness of a sample whose tokens span policy versions is measured from its oldest token."""

import pytest

from rlkit.buffers import StalenessPolicy
from tests.buffers.helpers import make_buffer


def span_group(buf, versions_of_spans):
    """Acquire one group (n=1) and generate its sample span by span, the buffer's version moving
    to each span's version first (a partial rollout resumed across weight updates)."""
    (g,) = buf.acquire(1)
    s = g.samples[0]
    s.start_request()
    last = len(versions_of_spans) - 1
    for i, (version, tokens) in enumerate(versions_of_spans):
        if version > buf.version:
            buf.set_version(version)
        s.append([7] * tokens, [-0.5] * tokens, version, finish_reason="stop" if i == last else None)
    s.set_reward(1.0)
    return g


def test_tokens_of_versions_0_0_2_are_dropped_at_version_3_with_max_staleness_2():
    buf = make_buffer(n=1, max_staleness=2, staleness_policy=StalenessPolicy.DROP)
    g = span_group(buf, [(0, 2), (2, 1)])
    assert g.samples[0].versions == [0, 0, 2]
    assert buf.complete(g).queued  # at version 2 the lag is 2: fits
    buf.set_version(3)  # lag from the oldest token 3 > 2 (from the newest it would be 1)
    assert buf.take_nowait(1) == []
    stats = buf.stats()
    assert (stats["ready"], stats["trained"], stats["dropped_by_reason"]) == (0, 0, {"stale": 1})
    assert stats["discarded_tokens"] == 3 and stats["balanced"]


def test_a_span_sample_completed_after_the_bump_is_not_queued():
    buf = make_buffer(n=1, max_staleness=2)
    g = span_group(buf, [(0, 2), (2, 1)])
    buf.set_version(3)
    assert not buf.complete(g).queued
    assert buf.stats()["dropped_by_reason"] == {"stale": 1}


@pytest.mark.parametrize("spans, kept", [([(1, 2), (2, 1)], True), ([(0, 2), (3, 1)], False)])
def test_the_oldest_token_decides_at_the_boundary(spans, kept):
    # versions [1, 1, 2] lag 2 at version 3 (kept); [0, 0, 3] lags 3 although its last token is new
    buf = make_buffer(n=1, max_staleness=2)
    buf.set_version(spans[0][0])
    g = span_group(buf, spans)
    buf.complete(g)
    buf.set_version(3)
    assert len(buf.take_nowait(1)) == int(kept)
    assert buf.stats()["dropped_by_reason"] == ({} if kept else {"stale": 1})
