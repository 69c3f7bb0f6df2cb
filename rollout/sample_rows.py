"""A few trained samples of each step, whole, for the run viewer and wandb
(`tracking.samples_per_step`): RUN/samples/step_<N>.json (rlkit.tracking), a wandb Table.

The rollout side picks them as it hands groups to the trainer, round-robin over the step's
groups (the k-th pick is from the (k mod B)-th group handed, B the groups per step), so a
step's picks span its groups and, in stream mode, are made as the groups leave one by one.
Which response of a group rotates with the version, so a run shows every slot in turn.

A row holds each response token's text, id, weight version, loss mask (1: the model's token;
0: an observation of a multi-turn episode), rollout logprob and, under distillation, the
teacher's; the group's rewards, so the viewer can step through the group. A picked sample is
marked (Sample.metadata[TRACE_KEY]) before it leaves: the trainer computes its own logprobs of
its tokens with the weights the batch trains from (train/stream.py), which come back with the
step's training metrics and join the row as `trainer_logprobs` (rlkit/driver/loop.py).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rlkit.buffers.sample import TRACE_KEY

Decode = Callable[[Sequence[int]], str]
PROMPT_CHARS = 4000  # the prompt's tail kept in a row: what the response continues


class SamplePicker:
    def __init__(self, per_step: int, batch_size: int, decode: Decode | None = None) -> None:
        self.per_step = per_step
        self.batch_size = max(1, batch_size)
        self.decode = decode
        self._version: int | None = None
        self._handed = 0  # groups handed for the current consumer version

    def pick(self, groups: Sequence[Any], version: int) -> list[dict[str, Any]]:
        """Rows for the picks among `groups`, handed now for training at `version`."""
        if self.per_step <= 0:
            return []
        if version != self._version:
            self._version, self._handed = version, 0
        rows = []
        for g in groups:
            i = self._handed
            self._handed += 1
            picks = range(i, self.per_step, self.batch_size)  # the k-th pick: group k mod B
            samples = list(g.samples)
            for j, _ in enumerate(picks):
                if j >= len(samples):
                    break
                s = samples[(j + version) % len(samples)]
                s.metadata[TRACE_KEY] = True  # the trainer's logprobs of it come back too
                rows.append(sample_row(g, s, self.decode))
        return rows


def sample_row(group: Any, s: Any, decode: Decode | None) -> dict[str, Any]:
    ids = list(s.response_ids)
    text = (lambda xs: decode(xs)) if decode is not None else (lambda xs: " ".join(map(str, xs)))
    prompt = text(list(s.prompt_ids))
    return {
        "group_id": group.group_id, "sample_index": s.index, "slot": s.slot,
        "source_index": group.prompt.source_index,
        "prompt": prompt[-PROMPT_CHARS:], "prompt_tokens": len(s.prompt_ids),
        "response": text(ids),
        "tokens": [text([t]) for t in ids], "ids": ids,
        "versions": list(s.versions), "loss_mask": list(s.loss_mask),
        "logprobs": [round(x, 5) for x in s.logprobs],
        "teacher_logprobs": None if s.teacher_logprobs is None
        else [round(x, 5) for x in s.teacher_logprobs],
        "reward": s.reward, "finish_reason": s.finish_reason, "status": s.status.value,
        "requests": s.requests, "resumes": s.resumes,
        "group_rewards": [x.reward for x in group.samples],
        "group_slots": [x.slot for x in group.samples],
    }
