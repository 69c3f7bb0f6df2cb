"""RolloutBuffer behaviour: queue priorities, staleness policies, blocking and streamed
consumption, persistence (same future after save/load), refusal of bad state files."""

import asyncio
import gzip
import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.buffers import (
    BufferClosed,
    BufferError,
    BufferStateError,
    Lane,
    Place,
    RolloutBuffer,
    StalenessPolicy,
    load_buffer,
    save_buffer,
)
from tests.buffers.helpers import finish, make_buffer, make_source


def test_partial_groups_are_resumed_first_oldest_first():
    buf = make_buffer(n=2)
    g0, g1, g2, g3 = buf.acquire(4)
    g0.samples[0].start_request()
    g0.samples[0].append([1, 2], [-0.1, -0.2], 0)
    buf.requeue(g2)
    buf.requeue(g0)  # requeued later but older: still first
    for g in (g1, g3):
        finish(g, 0)
        buf.complete(g)
    again = buf.acquire(3)
    assert [g.group_id for g in again[:2]] == [0, 2]
    assert again[2].group_id == 4  # then a fresh prompt
    assert again[0].samples[0].response_ids == [1, 2]  # tokens kept
    assert again[0].attempts == 2


def test_completed_surplus_is_kept_not_lost():
    buf = make_buffer(n=1)
    (g,) = buf.acquire(1)
    finish(g, 0)
    buf.requeue(g)  # finished during the abort: goes to ready, not back to generation
    assert buf.place_of(g) is Place.READY


def test_long_queue_is_separate_and_marks_the_lane():
    buf = make_buffer(n=1)
    g0, g1 = buf.acquire(2)
    buf.defer(g1)
    buf.defer(g0)
    assert g0.lane is Lane.LONG
    assert [g.group_id for g in buf.acquire(1)] == [2]  # long groups are not in regular rounds
    assert [g.group_id for g in buf.acquire_long(5)] == [0, 1]


def test_complete_refuses_incomplete_failed_or_foreign_groups():
    buf = make_buffer(n=2)
    (g,) = buf.acquire(1)
    with pytest.raises(BufferError, match="not complete"):
        buf.complete(g)
    finish(g, 0)
    buf.complete(g)
    with pytest.raises(BufferError, match="not in flight: ready"):
        buf.complete(g)
    (h,) = buf.acquire(1)
    finish(h, 0)
    h.samples[1].fail("reward timed out after 30 s")
    with pytest.raises(BufferError, match="failed samples"):
        buf.complete(h)
    buf.drop(h, "reward_failed")
    assert buf.stats()["dropped_by_reason"] == {"reward_failed": 1}
    assert buf.stats()["balanced"]


@pytest.mark.parametrize(
    "policy, expect",
    [
        (StalenessPolicy.DROP, {"trained": 0, "dropped": 1}),
        (StalenessPolicy.REGENERATE, {"trained": 0, "partial": 1, "stale_regenerated": 1}),
        (StalenessPolicy.CORRECT, {"trained": 1, "stale_corrected": 1}),
    ],
)
def test_staleness_policy_applies_to_ready_groups(policy, expect):
    buf = make_buffer(n=1, max_staleness=1, staleness_policy=policy)
    (g,) = buf.acquire(1)
    finish(g, 0)
    buf.complete(g)
    buf.set_version(2)  # lag 2 > 1
    taken = buf.take_nowait(1)
    stats = buf.stats()
    for key, value in expect.items():
        assert stats[key] == value, (key, stats)
    if policy is StalenessPolicy.CORRECT:
        assert taken[0].stale_corrected
    if policy is StalenessPolicy.REGENERATE:
        (again,) = buf.acquire(1)
        assert again is g and not again.has_tokens and again.birth_version == 2


def test_stale_partial_is_not_resumed_under_drop():
    buf = make_buffer(n=1, max_staleness=0)
    (g,) = buf.acquire(1)
    g.samples[0].start_request()
    g.samples[0].append([1], [-0.1], 0)
    buf.requeue(g)
    buf.set_version(1)
    (fresh,) = buf.acquire(1)
    assert fresh.group_id == 1
    assert buf.stats()["dropped_by_reason"] == {"stale": 1}


def test_take_blocks_until_enough_groups_and_times_out():
    buf = make_buffer(n=1)
    groups = buf.acquire(3)
    with pytest.raises(TimeoutError):
        buf.take(1, timeout=0.05)

    def produce():
        for g in groups:
            finish(g, 0)
            buf.complete(g)

    t = threading.Timer(0.05, produce)
    t.start()
    got = buf.take(3, timeout=10)
    t.join()
    assert sorted(g.group_id for g in got) == [0, 1, 2]
    assert buf.stats()["trained"] == 3


def test_close_wakes_blocked_consumers():
    buf = make_buffer()
    threading.Timer(0.05, buf.close).start()
    with pytest.raises(BufferClosed):
        buf.take(1)


async def test_stream_yields_each_group_exactly_once_to_several_consumers():
    buf = make_buffer(n=1, rows=50)
    total, consumers = 30, 3
    groups = buf.acquire(total)
    seen: list[int] = []

    async def consume(k):
        async for g in buf.stream(k):
            seen.append(g.group_id)

    def produce():  # another thread, as the manager would be
        for g in groups:
            finish(g, 0)
            buf.complete(g)

    tasks = [asyncio.create_task(consume(total // consumers)) for _ in range(consumers)]
    await asyncio.sleep(0.01)
    producer = threading.Thread(target=produce)
    producer.start()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    producer.join()
    assert sorted(seen) == list(range(total))
    assert buf.stats()["trained"] == total and buf.stats()["balanced"]


async def test_stream_yields_in_completion_order_as_groups_complete():
    buf = make_buffer(n=1)
    g0, g1 = buf.acquire(2)
    order = []

    async def consume():
        async for g in buf.stream(2):
            order.append(g.group_id)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)
    finish(g1, 0)
    buf.complete(g1)
    await asyncio.sleep(0.01)
    assert order == [1]  # streamed before the rest of the batch exists
    finish(g0, 0)
    buf.complete(g0)
    await asyncio.wait_for(task, 5)
    assert order == [1, 0]


def test_a_row_still_deferred_when_the_data_wraps_is_held_back_not_handed_out_twice(tmp_path):
    buf = make_buffer(n=1, rows=3)
    first = buf.acquire(3)  # the whole of epoch 0
    deferred = first[0]
    buf.defer(deferred)
    for g in first[1:]:
        finish(g, 0)
        buf.complete(g)
    buf.take_nowait(2)
    row = deferred.prompt.source_index
    nxt = buf.acquire(2)  # epoch 1: the deferred row's new copy waits; the other two go out
    assert len(nxt) == 2 and row not in {g.prompt.source_index for g in nxt}
    assert buf.stats()["held"] == 1 and buf.stats()["balanced"]
    assert buf.acquire(1) == []  # every row is out: fewer groups rather than a duplicate
    path = tmp_path / "b.json.gz"
    save_buffer(buf, path)
    again = make_buffer(n=1, rows=3)
    load_buffer(again, path)
    assert again.stats()["held"] == 1
    (long,) = buf.acquire_long(1)  # the long round runs the old copy ...
    finish(long, 0)
    buf.complete(long)
    (held,) = buf.acquire(1)  # ... and the held copy comes out next, before any fresh draw
    assert (held.prompt.source_index, held.prompt.epoch) == (row, 1)
    assert buf.stats()["held"] == 0


def test_restart_and_restarting_defer_forget_tokens_and_count_them():
    buf = make_buffer(n=2)
    g0, g1 = buf.acquire(2)
    for g in (g0, g1):
        g.samples[0].start_request()
        g.samples[0].append([1, 2, 3], [-0.1] * 3, 0)
    buf.set_version(1)
    assert buf.restart(g0) == 3 and g0.tokens == 0 and g0.birth_version == 1
    assert buf.defer(g1, restart=True) == 3 and g1.tokens == 0 and g1.deferrals == 1
    stats = buf.stats()
    assert stats["discarded_tokens"] == 6 and stats["restarted"] == 1 and stats["deferred"] == 1


# -- persistence: same future --------------------------------------------------------------
step_op = st.one_of(
    st.tuples(st.just("step"), st.integers(1, 4), st.integers(1, 3)),  # acquire k, advance p tokens
    st.tuples(st.just("long_step"), st.integers(1, 3), st.integers(1, 3)),
    st.tuples(st.just("defer"), st.integers(1, 2)),
    st.tuples(st.just("take"), st.integers(1, 3)),
    st.tuples(st.just("bump"),),
)


def _run_op(buf: RolloutBuffer, op, trace: list) -> None:
    """One whole step: deterministic generation; nothing is left in flight after it."""
    kind = op[0]
    if kind in ("step", "long_step"):
        _, k, progress = op
        groups = buf.acquire(k) if kind == "step" else buf.acquire_long(k)
        for g in groups:
            trace.append(("got", g.group_id, g.prompt.source_index, g.prompt.epoch))
            for s in g.to_generate():
                target = 1 + (s.index * 7) % 6  # response length this sample will reach
                n = min(progress, target - len(s.response_ids))
                s.start_request()
                done = len(s.response_ids) + n >= target
                s.append([s.index % 97] * n, [-0.25] * n, buf.version,
                         finish_reason="stop" if done else None)
                if done:
                    s.set_reward(float(s.index % 2))
            if g.is_complete:
                buf.complete(g)
            else:
                buf.requeue(g)
    elif kind == "defer":
        for g in buf.acquire(op[1]):
            buf.defer(g)
    elif kind == "take":
        for g in buf.take_nowait(op[1]):
            trace.append(("trained", g.group_id,
                          [(s.response_ids, s.versions, s.reward) for s in g.samples]))
    else:
        buf.set_version(buf.version + 1)
    trace.append(("stats", buf.stats()))


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(step_op, max_size=25), split=st.integers(0, 25))
def test_save_load_continue_gives_the_same_future(tmp_path_factory, ops, split):
    def fresh():
        return make_buffer(n=2, rows=4, max_staleness=2, staleness_policy="regenerate")

    straight, trace_a = fresh(), []
    for op in ops:
        _run_op(straight, op, trace_a)

    first, trace_b = fresh(), []
    for op in ops[:split]:
        _run_op(first, op, trace_b)
    path = tmp_path_factory.mktemp("state") / "buffer.json.gz"
    save_buffer(first, path)
    resumed = fresh()
    load_buffer(resumed, path)
    for op in ops[split:]:
        _run_op(resumed, op, trace_b)
    assert trace_b == trace_a


# -- bad state files ---------------------------------------------------------------------
def test_corrupt_state_file_is_refused_with_the_path(tmp_path):
    buf = make_buffer()
    buf.acquire(2)
    path = save_buffer(buf, tmp_path / "b.json.gz")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BufferStateError, match=f"{path}: corrupt"):
        load_buffer(make_buffer(), path)
    path.write_bytes(b"not gzip at all")
    with pytest.raises(BufferStateError, match="corrupt or not a buffer state"):
        load_buffer(make_buffer(), path)


def test_state_from_another_setup_is_refused_naming_the_difference(tmp_path):
    path = save_buffer(make_buffer(n=2), tmp_path / "b.json.gz")
    with pytest.raises(BufferStateError, match="n_samples_per_prompt: saved 2, now 4"):
        load_buffer(make_buffer(n=4), path)
    other_data = RolloutBuffer(make_source(rows=9), n_samples_per_prompt=2)
    with pytest.raises(BufferStateError, match="source.rows: saved 7, now 9"):
        load_buffer(other_data, path)


def test_foreign_json_is_refused(tmp_path):
    path = tmp_path / "x.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"hello": 1}, f)
    with pytest.raises(BufferStateError, match="not an rlkit buffer state"):
        load_buffer(make_buffer(), path)
    with gzip.open(path, "wt") as f:
        json.dump({"format": "rlkit.buffer", "format_version": 99}, f)
    with pytest.raises(BufferStateError, match="format version 99"):
        load_buffer(make_buffer(), path)


def test_malformed_groups_in_state_are_refused(tmp_path):
    buf = make_buffer(n=2)
    (g,) = buf.acquire(1)
    buf.requeue(g)
    state = buf.state_dict()
    state["partial"][0]["samples"][0]["logprobs"] = [0.0]  # misaligned with zero tokens
    with pytest.raises(BufferStateError, match="misaligned"):
        make_buffer(n=2).load_state_dict(json.loads(json.dumps(state)))
    del state["partial"][0]["prompt"]
    with pytest.raises(BufferStateError, match="malformed"):
        make_buffer(n=2).load_state_dict(state)


def test_load_needs_a_fresh_buffer():
    state = make_buffer().state_dict()
    used = make_buffer()
    used.acquire(1)
    with pytest.raises(BufferError, match="fresh buffer"):
        used.load_state_dict(state)


def test_speculative_samples_first_to_finish_are_kept_and_the_rest_returned():
    buf = make_buffer(n=2)
    (g,) = buf.acquire(1)
    extra = buf.extend(g, 2)  # eta_R: 4 responses launched for a group of 2
    assert [s.index for s in g.samples] == [0, 1, *[s.index for s in extra]]
    assert len({s.index for s in g.samples}) == 4
    for s, t, length in zip(g.samples, (3.0, 1.0, 2.0, None), (4, 5, 6, 7)):
        s.start_request()
        s.append([1] * length, [-0.1] * length, 0, finish_reason="stop" if t else None)
        if t:
            s.set_reward(1.0)
            s.finished_at = t
    surplus = buf.complete(g).surplus
    assert [s.index for s in g.samples] == [1, 2]  # finished at t=1 and t=2
    assert sorted(s.index for s in surplus) == [0, 3]
    assert buf.stats()["discarded_tokens"] == 4 + 7


def test_parked_groups_shed_speculative_extras_keeping_the_furthest_along():
    buf = make_buffer(n=2)
    (g,) = buf.acquire(1)
    buf.extend(g, 2)
    for s, length in zip(g.samples, (1, 5, 3, 0)):
        s.start_request()
        s.append([1] * length, [-0.1] * length, 0)
    buf.requeue(g)
    assert [len(s.response_ids) for s in g.samples] == [5, 3]
    assert buf.stats()["discarded_tokens"] == 1
    (again,) = buf.acquire(1)
    assert again is g and g.n == 2


def test_dropped_tokens_are_counted_and_partial_keeps_them():
    buf = make_buffer(n=1)
    a, b = buf.acquire(2)
    for g in (a, b):
        g.samples[0].start_request()
        g.samples[0].append([1, 2, 3], [-0.1] * 3, 0)
    buf.requeue(a)  # kept: nothing thrown away
    assert buf.stats()["discarded_tokens"] == 0
    buf.drop(b, "filtered")
    assert buf.stats()["discarded_tokens"] == 3


def test_untake_puts_untrained_groups_back_first_and_uncounts_them():
    """A run stopped mid-step: groups handed to the trainer and never trained go back to the
    front of the ready queue in their order, so a checkpoint written then keeps them."""
    buf = make_buffer(rows=7)
    groups = buf.acquire(4)
    for g in groups:
        finish(g, 0)
        buf.complete(g)
    taken = buf.take(3, timeout=0)
    assert buf.stats()["trained"] == 3
    buf.untake(taken)
    st_ = buf.stats()
    assert st_["trained"] == 0 and st_["ready"] == 4 and st_["balanced"]
    again = buf.take(4, timeout=0)
    assert [g.group_id for g in again] == [g.group_id for g in groups]
    with pytest.raises(BufferError, match="twice"):
        buf.untake([again[0], again[0]])
    buf.untake(again[:1])
    with pytest.raises(BufferError, match="still in the buffer"):
        buf.untake(again[:1])
