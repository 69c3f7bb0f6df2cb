"""What rankers read from a group (its response lengths, its episodes' turns, its prompt's
identity): apart from the package so the built-in rankers import it without importing the
package that lists them."""

from __future__ import annotations

from rlkit.buffers.group import Group
from rlkit.rollout.episodes import episode_turns


def _kept(group: Group) -> list:
    """The samples a ranker reads: the kept responses once complete, else all so far."""
    return group.first_finished() if group.is_complete else group.samples


def group_lengths(group: Group) -> tuple[list[int], bool]:
    """The response lengths a group shows a ranker, and whether they are exact (every kept
    response finished) or lower bounds (parked mid-generation)."""
    return [len(s.response_ids) for s in _kept(group)], group.is_complete


def group_turns(group: Group) -> tuple[list[int], bool]:
    """The model turns of a group's episodes (multi-turn rollouts; 1 each for single requests),
    read as `group_lengths` reads lengths: exact once complete, else lower bounds."""
    return [max(1, episode_turns(s)) for s in _kept(group)], group.is_complete


def mean_turns(group: Group) -> float:
    turns, _ = group_turns(group)
    return sum(turns) / len(turns) if turns else 0.0


def mean_length(group: Group) -> float:
    """A group's mean response length as rankers see it (exact once complete, else a lower
    bound): what a prediction is scored against."""
    lengths, _ = group_lengths(group)
    return sum(lengths) / len(lengths) if lengths else 0.0


def prompt_key(group: Group) -> int:
    """A prompt's identity across epochs: its data row (or its tokens, when it has none)."""
    p = group.prompt
    return p.source_index if p.source_index >= 0 else hash(p.ids) & 0x7FFFFFFF
