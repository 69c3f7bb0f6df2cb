"""One trajectory and the single mutator that keeps its per-token lists aligned.

Everything generated for a sample goes through `Sample.append`: response token ids, the rollout
log-probability of each token, the policy version that produced each token, and the loss mask.
`append` checks that the lists stay equally long and that nothing is appended once the sample is
terminal, so partial rollouts resumed across several policy versions cannot drift out of alignment
(the class of bug slime#1440/#2207 fixed after the fact).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Sequence


# Sample.metadata key of a sample picked for the run viewer (rollout/sample_rows.py): the
# trainer reports its own logprobs of its tokens with the step's metrics.
TRACE_KEY = "rlkit/trace"
# The key of the training metrics that holds them ("<group>/<index>" -> logprobs); not a number,
# the driver takes it out of the step's row.
TRACED_LOGPROBS = "trace/trainer_logprobs"


class SampleStatus(str, enum.Enum):
    PENDING = "pending"  # nothing generated yet
    RUNNING = "running"  # a request is in flight
    PARTIAL = "partial"  # aborted mid-generation; tokens kept, resumed later
    DONE = "done"  # the engine stopped (EOS or a stop token)
    TRUNCATED = "truncated"  # the response hit its token budget
    FAILED = "failed"  # generation or reward failed; `error` says why

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({SampleStatus.DONE, SampleStatus.TRUNCATED, SampleStatus.FAILED})

# SGLang's meta_info.finish_reason.type -> the status it leaves a sample in.
FINISH_REASON_STATUS = {
    "stop": SampleStatus.DONE,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.PARTIAL,
}


class SampleError(ValueError):
    """A mutation that would break a sample's invariants."""


@dataclass(eq=False, slots=True)
class Sample:
    """One response to one prompt.

    `prompt_ids` is shared with the group's prompt record (not copied). The per-token lists
    `response_ids`, `logprobs`, `versions` and `loss_mask` always have the same length, and
    `versions` never decreases along the response.
    """

    index: int  # unique per buffer, stable across save/load
    group_id: int
    prompt_ids: Sequence[int]
    slot: int = 0  # position in its group at creation: the k-th response to this prompt
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    status: SampleStatus = SampleStatus.PENDING
    finish_reason: str | None = None
    reward: float | None = None
    error: str | None = None
    requests: int = 0  # generate calls that contributed tokens (1 + number of resumptions)
    resumes: int = 0  # requests that continued a parked response (PARTIAL: a partial rollout)
    finished_at: float | None = None  # clock time it became finished (first-n selection)
    metadata: dict[str, Any] = field(default_factory=dict)
    # This request's re-score of the parked tokens (rollout.max_resume_log_ratio): the mean
    # log(pi_now / pi_rollout) over them; None unless the running request re-scored them.
    resume_log_ratio: float | None = None
    # The teacher's logprob of each response token (a frozen engine group with role teacher,
    # rollout.frozen_engines): set with the reward once the response is complete, never for a
    # parked one; None without a teacher. Same length as response_ids.
    teacher_logprobs: list[float] | None = None

    # -- the one mutator ------------------------------------------------------------------
    def append(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        version: int,
        *,
        finish_reason: str | None = None,
        trainable: bool = True,
    ) -> None:
        """Append a generated span, then apply `finish_reason` (stop | length | abort) if given.

        A span produced by one request carries one policy version (engines stamp it per
        request). An empty span with a finish reason is valid: an aborted request may have
        produced no token, and a stop can arrive in a final chunk without new tokens. Having no
        tokens, it stamps no version, so its `version` is not checked against earlier tokens
        (a resumed sample's last token may be newer than the version a caller has at hand).
        """
        if self.status.terminal:
            raise SampleError(
                f"sample {self.index}: append after terminal status {self.status.value}"
            )
        if len(token_ids) != len(logprobs):
            raise SampleError(
                f"sample {self.index}: {len(token_ids)} tokens but {len(logprobs)} logprobs"
            )
        if not isinstance(version, int) or version < 0:
            raise SampleError(f"sample {self.index}: version must be an int >= 0, got {version!r}")
        if token_ids and self.versions and version < self.versions[-1]:
            raise SampleError(
                f"sample {self.index}: version {version} is older than the last token's "
                f"({self.versions[-1]}); policy versions only move forward"
            )
        if finish_reason is not None and finish_reason not in FINISH_REASON_STATUS:
            raise SampleError(
                f"sample {self.index}: unknown finish reason {finish_reason!r}; "
                f"expected one of {sorted(FINISH_REASON_STATUS)}"
            )
        n = len(token_ids)
        self.response_ids.extend(map(int, token_ids))
        self.logprobs.extend(map(float, logprobs))
        self.versions.extend([version] * n)
        self.loss_mask.extend([1 if trainable else 0] * n)
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self.status = FINISH_REASON_STATUS[finish_reason]
        elif self.status is SampleStatus.PENDING or self.status is SampleStatus.PARTIAL:
            self.status = SampleStatus.RUNNING

    def restamp(self, start: int, versions: Sequence[int]) -> None:
        """Correct the versions of the response tokens from `start` on with the engine's exact
        per-token ones (SGLang 0.5.23's `weight_versions` spans, sent on a request's final chunk:
        a chunk's own stamp is the version when it was sent, so under a retract/in_place update
        up to stream_interval - 1 tokens the old weights made carry the new version)."""
        end = start + len(versions)
        if start < 0 or end > len(self.versions):
            raise SampleError(f"sample {self.index}: restamp of tokens {start}..{end} of a "
                              f"{len(self.versions)}-token response")
        stamped = [*self.versions[:start], *map(int, versions), *self.versions[end:]]
        if any(v < 0 for v in versions) or any(b < a for a, b in zip(stamped, stamped[1:])):
            raise SampleError(f"sample {self.index}: restamp to {list(versions)} at {start} would "
                              "make versions decrease along the response")
        self.versions = stamped

    # -- status transitions around generation -----------------------------------------
    def start_request(self) -> None:
        """A request for this sample is about to be sent (fresh or resumed)."""
        if self.status.terminal:
            raise SampleError(f"sample {self.index}: cannot start a request, status {self.status.value}")
        if self.status is SampleStatus.PARTIAL:
            self.resumes += 1
        self.status = SampleStatus.RUNNING
        self.requests += 1
        self.resume_log_ratio = None

    def rescore(self, logprobs_now: Sequence[float | None]) -> float | None:
        """The engine re-scored the first len(logprobs_now) response tokens under the weights
        the sample resumes with (SGLang's input_token_logprobs). Records and returns the mean
        log(pi_now / pi_rollout) over those of them the model generated (loss mask 1) with both
        logprobs finite: the geometric-level log-ratio (verl's geo rejection), the only one
        whose size does not grow with the response's length. None when no token counts."""
        if len(logprobs_now) > len(self.response_ids):
            raise SampleError(f"sample {self.index}: {len(logprobs_now)} re-scored tokens for a "
                              f"{len(self.response_ids)}-token response")
        diffs = [now - then for now, then, m in zip(logprobs_now, self.logprobs, self.loss_mask)
                 if m and now is not None and math.isfinite(now) and math.isfinite(then)]
        self.resume_log_ratio = math.fsum(diffs) / len(diffs) if diffs else None
        return self.resume_log_ratio

    def rescored_past(self, bound: float | None) -> bool:
        """Whether this request's re-score is past rollout.max_resume_log_ratio (None: off)."""
        ratio = self.resume_log_ratio
        return bound is not None and ratio is not None and abs(ratio) > bound

    def reopen(self) -> None:
        """A multi-turn episode goes on after a model turn stopped (rlkit/rollout/episodes.py):
        the stop ended the turn, not the response. Back to RUNNING, no finish reason."""
        if self.status is not SampleStatus.DONE or self.reward is not None:
            raise SampleError(f"sample {self.index}: reopen of a {self.status.value} sample"
                              + (" with a reward" if self.reward is not None else ""))
        self.status = SampleStatus.RUNNING
        self.finish_reason = None
        self.finished_at = None

    def relabel_finish(self, finish_reason: str) -> None:
        """Correct how a finished sample ended (stop <-> length), e.g. a replayed trace whose
        response reached its natural length below the cap: a stop, not a truncation."""
        if self.status not in (SampleStatus.DONE, SampleStatus.TRUNCATED):
            raise SampleError(f"sample {self.index}: relabel of a {self.status.value} sample")
        if finish_reason not in ("stop", "length"):
            raise SampleError(f"sample {self.index}: relabel to {finish_reason!r}; stop or length")
        self.finish_reason = finish_reason
        self.status = FINISH_REASON_STATUS[finish_reason]

    def interrupt(self) -> None:
        """The in-flight request ended without a finish reason (abort, lost connection)."""
        if not self.status.terminal:
            self.status = self._parked_status()

    def _parked_status(self) -> SampleStatus:
        """Where a stopped request leaves the sample: PARTIAL with tokens, else PENDING."""
        return SampleStatus.PARTIAL if self.response_ids else SampleStatus.PENDING

    def fail(self, error: str) -> None:
        """Record a failure (engine or reward). The sample is terminal and keeps its tokens."""
        self.status = SampleStatus.FAILED
        self.error = error

    def set_reward(self, reward: float) -> None:
        if self.status not in (SampleStatus.DONE, SampleStatus.TRUNCATED):
            raise SampleError(
                f"sample {self.index}: reward for a sample with status {self.status.value}"
            )
        self.reward = float(reward)

    def reset(self) -> None:
        """Forget the response (regenerate from the prompt, e.g. when too stale)."""
        self.response_ids = []
        self.logprobs = []
        self.versions = []
        self.loss_mask = []
        self.resumes = 0
        self.resume_log_ratio = None
        self.teacher_logprobs = None
        self.status = SampleStatus.PENDING
        self.finish_reason = None
        self.reward = None
        self.error = None
        self.finished_at = None

    # -- derived views ------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        """Terminal and, unless failed, rewarded: nothing more will happen to it."""
        return self.status is SampleStatus.FAILED or (
            self.status.terminal and self.reward is not None
        )

    def input_ids(self) -> list[int]:
        """What to send to resume: prompt + response ids (resumption is by tokens, never text)."""
        return [*self.prompt_ids, *self.response_ids]

    def remaining_tokens(self, max_new_tokens: int) -> int:
        return max(0, max_new_tokens - len(self.response_ids))

    def oldest_version(self) -> int | None:
        return self.versions[0] if self.versions else None  # versions never decrease

    def check(self) -> None:
        """Raise SampleError if an invariant does not hold (used after load and in tests)."""
        n = len(self.response_ids)
        if not (len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n):
            raise SampleError(
                f"sample {self.index}: per-token lists misaligned "
                f"(ids {n}, logprobs {len(self.logprobs)}, versions {len(self.versions)}, "
                f"mask {len(self.loss_mask)})"
            )
        if any(b < a for a, b in zip(self.versions, self.versions[1:])):
            raise SampleError(f"sample {self.index}: versions decrease along the response")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise SampleError(f"sample {self.index}: {len(self.teacher_logprobs)} teacher logprobs "
                              f"for a {n}-token response")

    # -- persistence ----------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """Plain data (prompt ids are stored once, by the group)."""
        return {
            "index": self.index,
            "group_id": self.group_id,
            "slot": self.slot,
            "response_ids": self.response_ids,
            "logprobs": self.logprobs,
            "versions": self.versions,
            "loss_mask": self.loss_mask,
            # A request in flight at save time is resumed later: RUNNING is saved as PARTIAL/PENDING.
            "status": (
                self._parked_status() if self.status is SampleStatus.RUNNING else self.status
            ).value,
            "finish_reason": self.finish_reason,
            "reward": self.reward,
            "error": self.error,
            "requests": self.requests,
            "resumes": self.resumes,
            "finished_at": self.finished_at,
            "metadata": self.metadata,
            "teacher_logprobs": self.teacher_logprobs,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], prompt_ids: Sequence[int]) -> "Sample":
        s = cls(
            index=int(state["index"]),
            group_id=int(state["group_id"]),
            prompt_ids=prompt_ids,
            slot=int(state["slot"]),
            response_ids=list(state["response_ids"]),
            logprobs=list(state["logprobs"]),
            versions=list(state["versions"]),
            loss_mask=list(state["loss_mask"]),
            status=SampleStatus(state["status"]),
            finish_reason=state["finish_reason"],
            reward=state["reward"],
            error=state["error"],
            requests=int(state["requests"]),
            resumes=int(state.get("resumes", 0)),  # absent from checkpoints before it existed
            finished_at=state["finished_at"],
            metadata=dict(state["metadata"]),
            # absent from checkpoints before it existed
            teacher_logprobs=(None if state.get("teacher_logprobs") is None
                              else [float(x) for x in state["teacher_logprobs"]]),
        )
        s.check()
        return s
