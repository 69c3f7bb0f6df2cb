"""The samples a step saves whole (tracking.samples_per_step): picked round-robin over the
step's groups however they are handed (all at once, or one by one in stream mode), written
atomically per step, dropped by a rewind past their step."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.buffers.group import Group, PromptRecord
from rlkit.buffers.sample import TRACE_KEY
from rlkit.config.schema import TrackingConfig
from rlkit.rollout.sample_rows import SamplePicker, sample_row
from rlkit.tracking import Tracker, rewind


def group(gid: int, n: int = 4) -> Group:
    g = Group.new(gid, PromptRecord((1, 2, 3), "p", source_index=gid), n, first_index=gid * 100, version=0)
    for s in g.samples:
        s.append([7, 8, 9], [-0.5, -1.0, -2.0], version=0, finish_reason=None)
        s.append([10], [-0.25], version=1, finish_reason="stop")
        s.reward = float(s.slot % 2)
    return g


@settings(max_examples=60, deadline=None)
@given(per_step=st.integers(0, 12), batch=st.integers(1, 6), size=st.integers(1, 4),
       chunks=st.lists(st.integers(1, 3), min_size=1, max_size=6), version=st.integers(0, 5))
def test_round_robin_over_the_steps_groups_however_handed(per_step, batch, size, chunks, version):
    picker = SamplePicker(per_step, batch)
    groups = [group(i, size) for i in range(sum(chunks))][:batch]
    rows, at = [], 0
    for c in chunks:
        rows += picker.pick(groups[at:at + c], version)
        at += c
    want = sum(min(len(range(i, per_step, batch)), size) for i in range(len(groups)))
    assert len(rows) == want
    assert len({(r["group_id"], r["sample_index"]) for r in rows}) == len(rows)
    marked = {(g.group_id, s.index) for g in groups for s in g.samples if s.metadata.get(TRACE_KEY)}
    assert marked == {(r["group_id"], r["sample_index"]) for r in rows}  # the trainer scores them
    if rows:  # the first pick of each group handed before the count runs out
        assert sorted({r["group_id"] for r in rows}) == list(range(min(per_step, len(groups))))
    # a new consumer version is a new step: counting starts again
    assert len(picker.pick(groups[:1], version + 1)) == min(len(range(0, per_step, batch)), size)


def test_a_row_holds_what_the_token_view_needs():
    g = group(3)
    row = sample_row(g, g.samples[1], lambda ids: "".join(chr(96 + i % 26) for i in ids))
    assert row["tokens"] == ["g", "h", "i", "j"] and row["ids"] == [7, 8, 9, 10]
    assert row["versions"] == [0, 0, 0, 1] and row["loss_mask"] == [1, 1, 1, 1]
    assert row["logprobs"] == [-0.5, -1.0, -2.0, -0.25]
    assert row["group_rewards"] == [0.0, 1.0, 0.0, 1.0] and row["group_slots"] == [0, 1, 2, 3]
    assert (row["reward"], row["finish_reason"], row["prompt"], row["teacher_logprobs"]) == (1.0, "stop", "abc", None)
    json.dumps(row)


def test_tracker_writes_each_steps_samples_whole_and_rewind_drops_later_ones(tmp_path):
    t = Tracker(TrackingConfig(wandb="disabled", progress=False), tmp_path, "r", {})
    g = group(1)
    rows = [sample_row(g, s, None) for s in g.samples[:2]]
    for step in (1, 2, 3):
        t.log_samples(step, rows)
    t.log_samples(4, [])  # nothing picked: no file
    t.log_groups(1, [], dropped=[{"group_id": 9, "dropped": "filtered:zero_variance", "rewards": [float("nan")]}])
    t.close()
    files = sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert files == ["step_000001.json", "step_000002.json", "step_000003.json"]  # no temporary left
    assert json.loads((tmp_path / "samples" / "step_000002.json").read_text())["samples"] == rows
    assert json.loads((tmp_path / "dropped.jsonl").read_text()) == {
        "step": 1, "group_id": 9, "dropped": "filtered:zero_variance", "rewards": [None]}
    rewind(tmp_path, 1)
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step_000001.json"]
