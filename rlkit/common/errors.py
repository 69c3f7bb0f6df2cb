"""The base type of every error a user can fix: a recipe, a data file, a model, a reward, a
checkpoint, a port. The CLI catches this one type (rlkit/cli.py) and prints its message without
a traceback; anything else is a bug and keeps its traceback.

Why here: rlkit.common is the leaf every package of rlkit (rollout, train, rlkit) may import
without creating a cycle (docs/design.md: dependencies point one way). It is pure Python, so
importing it costs nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class UserError(Exception):
    """Something the user can act on. The message says what is wrong and where (the key path,
    the file, the port) and, where there is one, what to do about it."""

    exit_code = 2  # what `rlkit` exits with when it reports one


def find_user_error(exc: BaseException) -> UserError | None:
    """The UserError behind `exc`, if any: itself, or the error a wrapper carries. Ray wraps an
    actor's exception in a RayTaskError whose `.cause` is the original (its own class may also
    derive from the cause's, but its message is Ray's traceback, so `.cause` is preferred);
    `raise X from err` chains through `__cause__`."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            e = cause
            continue
        if isinstance(e, UserError):
            return e
        e = e.__cause__
    return None


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written, read or resumed (a full disk, an unwritable folder,
    a truncated file, one from another model or parallel layout); the message names the path.
    One type for the run's checkpoint (rlkit.checkpoint) and the trainer's files inside it
    (train.megatron.checkpoint), which is why it lives here."""


class ProcessDied(UserError):
    """A process of the run died (killed, out of memory, a crash in native code): a trainer
    rank, the rollout actor, an engine's actor. The run cannot go on without it; the driver
    (rlkit.driver.run) adds the step and the checkpoint `run.resume=auto` continues from."""

    exit_code = 1  # not bad input: the run failed, and can be resumed


@dataclass(frozen=True)
class ActorDeath:
    """What Ray says of an actor whose process died (read from its ActorDiedError)."""

    actor_id: str | None
    class_name: str | None
    pid: int | None
    exit_type: str | None  # Ray's worker exit type: SYSTEM_ERROR (killed, OOM, crash), ...

    def reason(self) -> str:
        if self.exit_type == "SYSTEM_ERROR":
            return "its process is gone, Ray's exit type SYSTEM_ERROR: killed, out of memory or crashed"
        return f"its process is gone, Ray's exit type {self.exit_type or 'unknown'}"


def actor_death(exc: BaseException) -> ActorDeath | None:
    """The actor death behind `exc` (Ray's RayActorError, possibly inside a RayTaskError's
    `.cause` or a `raise ... from`), or None. Stdlib only: it reads the error's `actor_id` and
    the lines Ray writes into its message (class_name, pid, Worker exit type)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(c.__name__ == "RayActorError" for c in type(e).__mro__):
            text = str(e)

            def field(pattern: str) -> str | None:
                m = re.search(pattern, text)
                return m.group(1) if m else None

            pid = field(r"\bpid: (\d+)")
            return ActorDeath(getattr(e, "actor_id", None) or field(r"actor_id: (\w+)"),
                              field(r"class_name: (\w+)"), int(pid) if pid else None,
                              field(r"Worker exit type: (\w+)"))
        cause = getattr(e, "cause", None)
        e = cause if isinstance(cause, BaseException) else (e.__cause__ or e.__context__)
    return None
