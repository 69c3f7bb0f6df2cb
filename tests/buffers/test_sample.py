"""Sample invariants: per-token lists stay aligned; nothing is appended after a terminal status."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlkit.buffers import FINISH_REASON_STATUS, Sample, SampleError, SampleStatus

span = st.integers(min_value=0, max_value=5)
op = st.one_of(
    st.tuples(st.just("append"), span, st.integers(0, 3), st.sampled_from([None, "stop", "length", "abort"])),
    st.tuples(st.just("bad_lengths"), span, st.integers(1, 2)),
    st.tuples(st.just("start")),
    st.tuples(st.just("interrupt")),
    st.tuples(st.just("fail")),
    st.tuples(st.just("reward")),
    st.tuples(st.just("reset")),
)


@given(st.lists(op, max_size=40))
def test_lists_stay_aligned_and_terminal_is_final(ops):
    s = Sample(index=0, group_id=0, prompt_ids=(1, 2))
    for o in ops:
        before = (list(s.response_ids), s.status)
        terminal = s.status.terminal
        if o[0] == "append":
            _, n, dv, reason = o
            version = (s.versions[-1] if s.versions else 0) + dv
            if terminal:
                with pytest.raises(SampleError, match="terminal"):
                    s.append([7] * n, [-0.5] * n, version, finish_reason=reason)
                assert (s.response_ids, s.status) == before
            else:
                s.append([7] * n, [-0.5] * n, version, finish_reason=reason)
                assert len(s.response_ids) == len(before[0]) + n
                if reason:
                    assert s.status is FINISH_REASON_STATUS[reason]
        elif o[0] == "bad_lengths":
            _, n, extra = o
            with pytest.raises(SampleError):
                s.append([7] * n, [-0.5] * (n + extra), 10**6)
            assert (s.response_ids, s.status) == before
        elif o[0] == "start":
            if terminal:
                with pytest.raises(SampleError):
                    s.start_request()
            else:
                s.start_request()
                assert s.status is SampleStatus.RUNNING
        elif o[0] == "interrupt":
            s.interrupt()
            if not terminal:
                assert s.status in (SampleStatus.PARTIAL, SampleStatus.PENDING)
                assert (s.status is SampleStatus.PARTIAL) == bool(s.response_ids)
        elif o[0] == "fail":
            s.fail("boom")
            assert s.status is SampleStatus.FAILED and s.error == "boom"
        elif o[0] == "reward":
            if s.status in (SampleStatus.DONE, SampleStatus.TRUNCATED):
                s.set_reward(1.0)
                assert s.is_finished
            else:
                with pytest.raises(SampleError):
                    s.set_reward(1.0)
        elif o[0] == "reset":
            s.reset()
            assert s.status is SampleStatus.PENDING and not s.response_ids
        s.check()  # aligned lists, non-decreasing versions


def test_versions_never_go_back():
    s = Sample(0, 0, (1,))
    s.append([1], [-0.1], 3)
    with pytest.raises(SampleError, match="older"):
        s.append([2], [-0.1], 2)


def test_resume_input_is_prompt_plus_response_tokens():
    s = Sample(0, 0, (1, 2, 3))
    s.append([4, 5], [-0.1, -0.2], 0, finish_reason="abort")
    assert s.status is SampleStatus.PARTIAL
    assert s.input_ids() == [1, 2, 3, 4, 5]
    assert s.remaining_tokens(10) == 8
    s.append([6], [-0.3], 1, finish_reason="length")
    assert s.versions == [0, 0, 1] and s.status is SampleStatus.TRUNCATED


def test_unknown_finish_reason_is_refused():
    s = Sample(0, 0, (1,))
    with pytest.raises(SampleError, match="unknown finish reason"):
        s.append([1], [-0.1], 0, finish_reason="eos")


def test_state_round_trip_saves_running_as_resumable():
    s = Sample(3, 1, (1, 2))
    s.start_request()
    s.append([9, 8], [-1.0, -2.0], 2)
    assert s.status is SampleStatus.RUNNING
    t = Sample.from_state(s.to_state(), (1, 2))
    assert t.status is SampleStatus.PARTIAL
    assert (t.response_ids, t.logprobs, t.versions, t.loss_mask) == ([9, 8], [-1.0, -2.0], [2, 2], [1, 1])


def test_versions_only_move_forward_but_an_empty_finishing_span_stamps_none():
    s = Sample(group_id=0, index=0, slot=0, prompt_ids=[1])
    s.start_request()
    s.append([5, 6], [-0.1, -0.2], 3)
    with pytest.raises(SampleError, match="older than the last token's"):
        s.append([7], [-0.3], 2)
    s.append([], [], 2, finish_reason="stop")  # no tokens, no version: nothing to order
    assert s.versions == [3, 3] and s.status is SampleStatus.DONE


def test_restamp_corrects_versions_and_keeps_them_non_decreasing():
    s = Sample(index=0, group_id=0, prompt_ids=[1])
    s.append([5, 6], [-0.1, -0.2], 2)
    s.append([7, 8, 9], [-0.1] * 3, 4)
    s.restamp(2, [3, 4, 4])  # the engine's exact per-token versions of the last request
    assert s.versions == [2, 2, 3, 4, 4]
    with pytest.raises(SampleError, match="decrease"):
        s.restamp(2, [1, 4, 4])  # older than the token before it
    with pytest.raises(SampleError, match="decrease"):
        s.restamp(2, [4, 3, 4])
    with pytest.raises(SampleError, match="restamp of tokens 4..6"):
        s.restamp(4, [4, 4])
    assert s.versions == [2, 2, 3, 4, 4]  # a refused restamp changes nothing
