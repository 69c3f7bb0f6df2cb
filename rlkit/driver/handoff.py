"""Ready groups leave the rollout actor split by data-parallel replica: each replica's ranks
fetch only their share (train.stream.ReplicaShare), not every group.

The placement is the trainer's own rule (train.microbatch_plan.ReplicaAssigner: each trained
sample, in arrival order, to the least-loaded replica of its global batch), run here on the
same lengths in the same order, so every rank trains exactly the samples it trained when each
fetched every group and chose its own. A share keeps the others' samples without tokens: their
rewards make the group's advantages. The assigner starts afresh with each rollout batch, which
is handed out between two weight updates (RolloutService.set_version calls `new_batch`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rlkit.buffers import Group
from rlkit.driver.rollout_box import Handed, group_record
from rlkit.train.batch import trained_samples
from rlkit.train.microbatch_plan import ReplicaAssigner
from rlkit.train.stream import ReplicaShare, part_size_for


class ReplicaHandOff:
    """`hand(groups)` for a run whose trainer has `dp_size` replicas: per group one reference
    per replica (`put`: ray.put in the rollout actor), in Handed.refs as a list."""

    def __init__(self, dp_size: int, attention_weight: float = 0.0, part_size: int = 0,
                 put: Callable[[Any], Any] | None = None) -> None:
        if put is None:
            import ray

            put = ray.put
        self.dp_size, self.attention_weight, self.part_size, self.put = dp_size, attention_weight, part_size, put
        self.new_batch()

    @classmethod
    def for_recipe(cls, recipe: Any, attention_weight: float, put: Callable[[Any], Any] | None = None
                   ) -> "ReplicaHandOff":
        """With the recipe's data parallelism and global batch (train.stream's parts)."""
        return cls(recipe.train.parallelism.data, attention_weight,
                   part_size_for(recipe.rollout.samples_per_step, recipe.train.global_batch_size), put)

    def new_batch(self) -> None:
        self.assigner = ReplicaAssigner(self.dp_size, self.attention_weight, self.part_size)

    def shares(self, group: Group) -> list[ReplicaShare]:
        """The group's share for each replica."""
        trained = trained_samples(group)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in trained]
        owner = {id(s): r for s, (_, r) in zip(trained, self.assigner.assign(lengths))}
        return [ReplicaShare(dataclasses.replace(group, samples=[
            s if owner.get(id(s)) == d else _without_tokens(s) for s in group.samples]), lengths)
            for d in range(self.dp_size)]

    def __call__(self, groups: list[Group]) -> Handed:
        return Handed([[self.put(share) for share in self.shares(g)] for g in groups],
                      [group_record(g) for g in groups])


def _without_tokens(sample: Any) -> Any:
    """Another replica's sample (or one nobody trains): its status and reward, no tokens."""
    return dataclasses.replace(sample, response_ids=[], logprobs=[], versions=[], loss_mask=[],
                               teacher_logprobs=None, metadata={})
