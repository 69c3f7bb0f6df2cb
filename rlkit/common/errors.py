"""The base type of every error a user can fix: a recipe, a data file, a model, a reward, a
checkpoint, a port. The CLI catches this one type (rlkit/cli.py) and prints its message without
a traceback; anything else is a bug and keeps its traceback.

Why here: every package of rlkit (rollout, train, rlkit) already depends on `buffers`, and
`buffers` depends on nothing of theirs (docs/design.md: dependencies point one way), so this is the
one place all of them may import without creating a cycle. It is pure Python, like the rest of
`buffers`, so importing it costs nothing.
"""

from __future__ import annotations


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
