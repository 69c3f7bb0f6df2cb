"""The viewer's Advice page: a few rules that read a run and say something useful about its
recipe. Each rule sees the same `RunFacts` (steps' rows, recipe, timeline shares) and returns
an `Advice` or None; RULES is the list, in the order the page shows them. A rule reads only
the steps after the first (warm-up: compilation, a cold prefix cache) when there are several.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable


@dataclass
class Advice:
    rule: str
    level: str  # "warn" | "info"
    message: str
    evidence: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunFacts:
    rows: list[dict[str, float]]  # per step, RunData.steps()
    recipe: dict[str, Any]
    source: str = "real"

    def key(self, *path: str, default: Any = None) -> Any:
        d: Any = self.recipe
        for p in path:
            if not isinstance(d, dict) or p not in d:
                return default
            d = d[p]
        return d

    def mean(self, metric: str) -> float:
        """The mean of a metric over the steps after the first (all of them if only one)."""
        rows = self.rows[1:] if len(self.rows) > 1 else self.rows
        values = [r[metric] for r in rows if metric in r and math.isfinite(r[metric])]
        return statistics.fmean(values) if values else math.nan


Rule = Callable[[RunFacts], "Advice | None"]


def engines_idle(f: RunFacts) -> Advice | None:
    """Engines idle more than half of the rollout: the long tail holds the step."""
    idle = f.mean("timeline/engine_idle_share")
    if not idle > 0.5:
        return None
    mode, policy = f.key("run", "mode", default="sync"), f.key("rollout", "policy", default="sync")
    fixes = []
    if policy in ("sync", None):
        fixes.append("rollout.policy: partial (active partial rollouts: over-provision and park "
                     "the tail) or tail_batching")
    elif policy == "partial":
        fixes.append("raise rollout.partial.over_provision (or turn on rollout.partial.adaptive)")
    if mode == "sync":
        fixes.append("run.mode: stream or async (training overlaps generation)")
    return Advice("engines_idle", "warn",
                  f"Engines sat idle {idle:.0%} of the rollout time: the step waits for its "
                  f"longest responses. Try " + "; or ".join(fixes or ["more groups in flight"]) + ".",
                  f"timeline/engine_idle_share mean {idle:.2f} (policy {policy}, mode {mode})")


def zero_variance(f: RunFacts) -> Advice | None:
    """Most groups with all-equal rewards: GRPO learns nothing from them."""
    share = f.mean("batch/zero_variance_share")
    if not share > 0.5:
        return None
    if f.key("rollout", "filter", "name"):
        return Advice("zero_variance", "info",
                      f"{share:.0%} of trained groups still have one reward for every response "
                      "although a filter is set: the filter's limit is reached (rollout."
                      "filter.max_filtered_ratio) or it keeps them; the prompts may be too easy "
                      "or too hard for the model.",
                      f"batch/zero_variance_share mean {share:.2f}")
    return Advice("zero_variance", "warn",
                  f"{share:.0%} of trained groups have the same reward for every response, so "
                  "their advantage is zero and they teach nothing. Turn on dynamic sampling "
                  "(rollout.filter.name: zero_variance), or raise n_samples_per_prompt.",
                  f"batch/zero_variance_share mean {share:.2f}")


def truncated(f: RunFacts) -> Advice | None:
    """Responses cut at the cap: the reward sees unfinished answers."""
    cap = f.key("rollout", "sampling", "max_new_tokens")
    longest = f.mean("batch/response_length_max")
    mean = f.mean("batch/response_length_mean")
    if not cap or not mean > 0.8 * cap:
        return None
    return Advice("truncated", "warn",
                  f"Responses average {mean:.0f} tokens against a cap of {cap}: most are cut "
                  "short. Raise rollout.sampling.max_new_tokens, or reward length (an "
                  "overlong penalty) so the policy learns to stop.",
                  f"batch/response_length_mean {mean:.0f}, max {longest:.0f}, cap {cap}")


def train_bound(f: RunFacts) -> Advice | None:
    """Sync mode where training and the sync take longer than the rollout."""
    if f.key("run", "mode", default="sync") != "sync":
        return None
    rollout = f.mean("rollout/seconds")
    waited = f.mean("train/seconds") + (0.0 if math.isnan(f.mean("sync/seconds")) else f.mean("sync/seconds"))
    if not (rollout > 0 and waited > rollout):
        return None
    return Advice("train_bound", "info",
                  f"Training and the weight sync take {waited:.1f} s a step against "
                  f"{rollout:.1f} s of rollout, and in sync mode the engines wait through them. "
                  "run.mode: async overlaps the next rollout with training (one step stale), "
                  "or give the trainer more GPUs (`rlkit plan`).",
                  f"train+sync {waited:.1f} s, rollout {rollout:.1f} s per step")


def stale_mismatch(f: RunFacts) -> Advice | None:
    """Off-policy tokens that disagree with the trainer far more than on-policy ones."""
    fresh = f.mean("mismatch/lag0/kl_k3")
    stale = max((f.mean(f"mismatch/{b}/kl_k3") for b in ("lag1", "lag2", "lag3plus")),
                key=lambda x: -1 if math.isnan(x) else x, default=math.nan)
    if not (stale > 0 and fresh >= 0 and stale > 10 * max(fresh, 1e-6)):
        return None
    correction = f.key("train", "algorithm", "off_policy_correction", "estimator", default=None)
    correction = None if correction in ("none", "unset") else correction
    mode, policy = f.key("run", "mode", default="sync"), f.key("rollout", "policy", default="sync")
    where = []  # where stale tokens come from in this recipe
    if policy in ("partial", "tail_batching"):
        where.append("partial responses resumed after a sync: bound their age with "
                     "rollout.max_token_lag")
    if mode == "async":
        where.append("async staleness: lower rollout.max_staleness")
    fix = "; ".join(where) or "lower rollout.max_staleness"
    return Advice("stale_mismatch", "warn",
                  f"Tokens generated one or more versions ago are far from the trainer's policy "
                  f"(KL {stale:.1e} against {fresh:.1e} on-policy). They come from {fix}. "
                  + ("Or correct for them (train.algorithm.off_policy_correction: tis, mis or "
                     "icepop)." if not correction else f"The correction ({correction}) weights "
                     "them; bound it harder if the reward stalls."),
                  f"mismatch/lag*/kl_k3 worst {stale:.2e}, lag0 {fresh:.2e} (policy {policy}, mode {mode})")


def failures(f: RunFacts) -> Advice | None:
    """Requests or rewards that failed: counted, and worth a look at the logs."""
    keys = ("rollout/engine_failures", "rollout/reward_failures", "rollout/requests_relaunched")
    total = {k: sum(r.get(k, 0.0) for r in f.rows) for k in keys}
    if not any(total.values()):
        return None
    said = ", ".join(f"{k.split('/')[1]} {v:.0f}" for k, v in total.items() if v)
    return Advice("failures", "info",
                  f"Failures during the run ({said}). Nothing was lost (they are counted and "
                  "retried or dropped with a reason), but see RUN/logs/ for the cause.",
                  said)


RULES: list[Rule] = [engines_idle, zero_variance, truncated, train_bound, stale_mismatch, failures]


def advise(facts: RunFacts) -> list[dict[str, Any]]:
    return [a.to_json() for rule in RULES if (a := rule(facts)) is not None]
