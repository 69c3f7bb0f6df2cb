"""A ranker that learns from prompt content: a small regressor on token statistics of the
prompt (its length, the share of distinct tokens, a hashed bag of its token ids), fitted to the
log of recent groups' mean response lengths, refit online every `refit_every` observations on
the last `window` of them. It generalizes to prompts never seen, where `history` can only fall
back to a mean. scikit-learn does the fitting (imported at the first fit).

Episodes' turns (`predict_turns`) are fitted the same way by a second regressor, once the
window holds an episode of more than one turn (before that every group is predicted 1 turn).

Its state is the observation window, not the fitted model: a checkpoint is plain data and the
model is refit from it on load (deterministic: a fixed random_state).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Sequence

from rlkit.buffers.group import Group
from rlkit.rollout.rankers.lengths import group_lengths, mean_turns


class LearnedRanker:
    name = "learned"

    def __init__(self, *, buckets: int = 256, window: int = 4096, refit_every: int = 64,
                 min_samples: int = 32, seed: int = 0) -> None:
        if buckets < 1 or window < min_samples or refit_every < 1 or min_samples < 2:
            raise ValueError("learned ranker: need buckets >= 1, refit_every >= 1, "
                             "2 <= min_samples <= window")
        self.buckets, self.window, self.refit_every = buckets, window, refit_every
        self.min_samples, self.seed = min_samples, seed
        self._data: deque[tuple[list[float], float]] = deque(maxlen=window)
        self._turns: deque[float] = deque(maxlen=window)  # mean turns, aligned with _data
        self._since_fit = 0
        self._model: Any = None
        self._turns_model: Any = None

    def features(self, ids: Sequence[int]) -> list[float]:
        n = len(ids)
        bag = [0.0] * self.buckets
        for t in ids:
            bag[(t * 2654435761) % 4294967296 % self.buckets] += 1.0
        scale = 1.0 / max(1, n)
        return [float(n), math.log1p(n), len(set(ids)) * scale, *(b * scale for b in bag)]

    def predict(self, groups: Sequence[Group]) -> list[float]:
        if not groups:
            return []
        if self._model is None:
            mean = math.expm1(sum(t for _, t in self._data) / len(self._data)) if self._data else 0.0
            return [mean] * len(groups)
        x = [self.features(g.prompt.ids) for g in groups]
        return [max(0.0, math.expm1(float(y))) for y in self._model.predict(x)]

    def predict_turns(self, groups: Sequence[Group]) -> list[float]:
        """Expected mean model turns of each group's episodes."""
        if self._turns_model is None:
            return [1.0] * len(groups)
        x = [self.features(g.prompt.ids) for g in groups]
        return [max(1.0, math.expm1(float(y))) for y in self._turns_model.predict(x)]

    def observe(self, group: Group) -> None:
        lengths, exact = group_lengths(group)
        if not exact or not lengths:
            return  # a lower bound is not a label
        self._data.append((self.features(group.prompt.ids), math.log1p(sum(lengths) / len(lengths))))
        self._turns.append(mean_turns(group))
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self._data) >= self.min_samples:
            self._fit()

    def _fit(self) -> None:
        x = [x for x, _ in self._data]
        self._model = self._regressor().fit(x, [y for _, y in self._data])
        self._turns_model = (self._regressor().fit(x, [math.log1p(t) for t in self._turns])
                             if max(self._turns, default=1.0) > 1.0 else None)
        self._since_fit = 0

    def _regressor(self) -> Any:
        from sklearn.ensemble import HistGradientBoostingRegressor

        return HistGradientBoostingRegressor(max_iter=150, learning_rate=0.1, max_leaf_nodes=15,
                                             early_stopping=False, random_state=self.seed)

    def state_dict(self) -> dict[str, Any]:
        return {"buckets": self.buckets, "since_fit": self._since_fit,
                "data": [[round(v, 6) for v in x] + [round(y, 6)] for x, y in self._data],
                "turns": [round(t, 6) for t in self._turns]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["buckets"]) != self.buckets:
            raise ValueError(f"learned ranker: saved with {state['buckets']} buckets, this one "
                             f"has {self.buckets}")
        self._data = deque(((list(map(float, row[:-1])), float(row[-1])) for row in state["data"]),
                           maxlen=self.window)
        # (absent in states saved before rankers learned turns: one turn each)
        self._turns = deque(map(float, state.get("turns") or [1.0] * len(self._data)), maxlen=self.window)
        self._model = self._turns_model = None
        if len(self._data) >= self.min_samples:
            self._fit()
        self._since_fit = int(state["since_fit"])
