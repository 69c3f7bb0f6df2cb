"""The `rollout` recipe section: sampling, group sizes, the scheduling policy and its knobs."""

from __future__ import annotations

import copy
import difflib
import re
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlkit.buffers.staleness import StalenessPolicy
from rlkit.rollout.engines.config import EngineConfig, RouterConfig
from rlkit.rollout.policy_names import POLICIES, POLICY_NAMES

PolicyName = Literal[POLICY_NAMES]  # type: ignore[valid-type]  # rollout.policy_names': one source


class PromptDataConfig(BaseModel):
    """Where prompts come from and how rows are read: the loader options of the recipe's `data`
    section and of each `eval` dataset (one definition for both)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        "builtin:arithmetic",
        min_length=1,
        description="Prompts: a .jsonl or .parquet file, a folder saved by datasets' save_to_disk, "
        "or a data set the project generates ('builtin:arithmetic').",
    )
    prompt_key: str = Field(
        "prompt",
        min_length=1,
        description="Column with the prompt: a non-empty string, or a list of chat messages "
        "({role, content}).",
    )
    label_key: str | None = Field(
        "label", description="Column with the reference answer given to the reward; None for none."
    )
    metadata_keys: list[str] = Field(
        default_factory=list,
        description="Extra columns passed to the reward function as keyword arguments.",
    )
    apply_chat_template: bool = Field(
        True, description="Wrap prompts in the tokenizer's chat template (if it has one)."
    )
    system_prompt: str | None = Field(
        None, description="System message prepended when the chat template is applied."
    )
    max_prompt_tokens: int = Field(
        1024, ge=1, description="Longer prompts are bad rows (see on_bad_row)."
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error",
        description="A malformed row (missing prompt or label key, empty or non-string prompt, "
        "over-long prompt): 'error' stops at load time naming the file and row; 'skip' drops it "
        "and counts it by reason.",
    )


class SamplingConfig(BaseModel):
    """Sampling parameters sent with every /generate request."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature (> 0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 disables it.")
    max_new_tokens: int = Field(
        512, ge=1, description="Response length cap in tokens (a resumed partial counts what it has)."
    )
    min_new_tokens: int = Field(0, ge=0, description="Tokens generated before EOS is allowed.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    ignore_eos: bool = Field(
        False, description="Keep generating past EOS (benchmarks replaying a length trace)."
    )

    @model_validator(mode="after")
    def _check(self) -> "SamplingConfig":
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"sampling.min_new_tokens ({self.min_new_tokens}) exceeds "
                f"sampling.max_new_tokens ({self.max_new_tokens})"
            )
        return self


class TailBatchingConfig(BaseModel):
    """Tail batching (Flexes / RollPacker; policy `tail_batching`): short rounds with speculative
    over-launch defer the prompts that do not finish to a long queue; long rounds run them
    together. Read only when rollout.policy=tail_batching; under any other policy it is ignored
    (the loader warns when it is written)."""

    model_config = ConfigDict(extra="forbid")

    eta_prompts: float = Field(
        1.25,
        ge=1.0,
        le=4.0,
        description="Short rounds launch ceil(eta_prompts x batch_size) prompts and end once "
        "batch_size of them are done; the rest go to the long queue. So a short round defers "
        "about (eta_prompts - 1) x batch_size prompts and a long round follows every "
        "long_round_size / that many short rounds (4 at 1.25). Higher cuts short rounds' tails "
        "further but makes long rounds more frequent (the paper saw 1.5 lose to 1.25 at 32k).",
    )
    eta_responses: float = Field(
        1.25,
        ge=1.0,
        le=4.0,
        description="Short rounds launch ceil(eta_responses x n_samples_per_prompt) responses per "
        "prompt; a prompt is done at its first n finished responses and the rest are aborted "
        "(counted as speculative waste). Long rounds never speculate. Above 1 it biases "
        "short-round groups toward shorter responses; a replayed trace needs this many response "
        "slots per prompt.",
    )
    long_round_size: int = Field(
        0,
        ge=0,
        description="A long round starts when the long queue holds this many prompts; 0 means "
        "batch_size. A long round trains batch_size prompts like any step: the oldest deferred "
        "ones, topped up with fresh prompts (no speculation) when fewer are queued, so a value "
        "below batch_size runs earlier, mixed long rounds.",
    )
    deferred: Literal["restart", "resume"] = Field(
        "restart",
        description="How a long round runs a deferred prompt: 'restart' generates it again from "
        "the prompt with the long round's weights (on-policy, as the paper; the short round's "
        "tokens are discarded and counted in rollout/deferred_tokens_discarded); 'resume' "
        "continues the tokens the short round made, as APRIL does (nothing discarded, but "
        "responses span policy versions: train.algorithm.off_policy_correction must then be "
        "chosen explicitly, and rollout.max_staleness / staleness_policy bound how old they "
        "may get).",
    )
    max_deferrals: int = Field(
        2,
        ge=1,
        le=100,
        description="A prompt parked in the long queue this many times (a long round that was "
        "interrupted, a ranker that deferred it up front) is not deferred again: the next round "
        "that runs it waits for it to finish.",
    )
    proactive: bool = Field(
        False,
        description="Short rounds send the prompts rollout.ranker predicts long straight to the "
        "long queue instead of running them: predicted at or above the 1/eta_prompts quantile "
        "of recent groups' mean lengths (the longest 1 - 1/eta_prompts share, which a short "
        "round defers anyway); each takes one of the round's over-launch places, so the round "
        "defers as many in all as without a ranker. Needs a ranker; off until a batch's worth of groups has finished, "
        "and for the rest of a round that has deferred 4 x its launch (a ranker predicting "
        "everything long must not drain the data into the long queue).",
    )
    adaptive: bool = Field(
        True,
        description="Size each short round's over-launch from the estimated long share q (recent "
        "finished groups whose mean length is at least long_fraction x the longest recent "
        "response, plus the prompts in the long queue; with a ranker, at least the share of "
        "fresh prompts it predicts that long): the fewest prompts L at which the expected short "
        "ones, L(1-q) less cover_sigmas binomial standard deviations, still make batch_size, "
        "within [eta_prompts, max_eta_prompts] x batch_size. When even max_eta_prompts x "
        "batch_size prompts hold fewer than batch_size short ones on average, the short round "
        "would wait for long prompts anyway, so deferring cannot pay: the step runs as sync "
        "does instead (batch_size prompts, long queue first, no "
        "speculation, every response to its end; rollout/round 'sync'). False: the paper's fixed "
        "eta_prompts.",
    )
    max_eta_prompts: float = Field(
        3.0,
        ge=1.0,
        le=8.0,
        description="The most an adaptive short round launches, as a multiple of batch_size "
        "(with eta_responses x n requests each). Tail batching falls back to sync rounds at a "
        "long share above 1 - 1/max_eta_prompts (2/3 at 3.0).",
    )
    long_fraction: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Adaptive sizing counts a finished group as long when its mean response "
        "length is at least this share of the longest recent response (about the cap).",
    )
    cover_sigmas: float = Field(
        1.0,
        ge=0.0,
        le=4.0,
        description="Safety margin of the adaptive launch, in binomial standard deviations of "
        "the number of short prompts among those launched: a short round that finds too few "
        "short prompts waits for a long one (a whole sync step), where each extra prompt costs "
        "only its short-round decode.",
    )


class FilterConfig(BaseModel):
    """Dynamic sampling (DAPO): a group filter applied to every complete, rewarded group."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None,
        description="Group filter: a built-in name ('zero_variance': drop groups whose rewards "
        "are all equal, i.e. zero GRPO advantage), an entry point in the 'rlkit.filters' group, "
        "or a dotted path 'pkg.module:function' taking (group, **kwargs) and returning True "
        "(keep), False or a reason string (filter out); None trains every complete group. A "
        "filtered group does not count toward batch_size, so every policy keeps sampling until "
        "the batch is full; it is dropped with reason 'filtered:<reason>' (never sent to the "
        "long queue) and counted in rollout/filtered_*.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the filter (zero_variance: "
        "tolerance)."
    )
    max_filtered_ratio: float = Field(
        10.0,
        gt=0,
        le=1000,
        description="Once a step has filtered this many times batch_size groups, the filter "
        "stands down for the rest of the step (counted in rollout/filter_exhausted) rather than "
        "sample forever when nearly every group is filtered.",
    )


class RankerConfig(BaseModel):
    """Output-length ranker (StreamRL): predicts each group's response length; drives
    ranked_dispatch, tail_batching.proactive and adaptive over-provisioning, and every step
    logs its recall of the truly longest 20 / 10 / 5% of groups (rollout/ranker_recall@*)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        "history",
        description="'history' (per-prompt running mean from earlier epochs, partial progress as "
        "a lower bound; the default), 'learned' (a scikit-learn regressor on prompt token "
        "statistics, refit online: it predicts prompts never seen), 'prompt_length' (baseline), "
        "'oracle' (a trace's true lengths, benchmarks only: kwargs {trace: path}), an entry "
        "point in 'rlkit.rankers', or a dotted path to a factory; None: no ranker. Its state is "
        "saved with the buffer.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Arguments for the ranker's factory (history: decay, window; learned: "
        "buckets, window, refit_every, min_samples).",
    )


class EngineModelConfig(BaseModel):
    """What one engine can run, for the policies that plan with predicted lengths: ranked
    dispatch (placement and admission) and partial.adaptive (groups in flight). Read only by
    them; the loader warns when it is written and neither is selected."""

    model_config = ConfigDict(extra="forbid")

    profile: str | None = Field(
        None,
        description="Engine profile (per-token latency by batch size, KV capacity): a packaged "
        "profile name or a JSON file `rlkit bench engine` wrote; None: per-token latency "
        "independent of the batch, so ranked dispatch's split only balances predicted work and "
        "partial.adaptive counts every engine slot as peak throughput.",
    )
    slots_per_engine: int | None = Field(
        None, ge=1,
        description="Requests one engine runs at once in the plans, and that ranked dispatch "
        "lets run on one engine at once, admitting the longest predicted remaining work first "
        "as slots free (LPT); None: rollout.engine.max_running_requests. Set it to the batch "
        "the engine really runs.",
    )


class AdaptiveOverProvisionConfig(BaseModel):
    """Partial rollouts sizing their groups in flight from the ranker's predictions instead of
    the fixed rollout.partial.over_provision."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        False,
        description="Keep just enough groups in flight that the engines run at `utilization` of "
        "their peak throughput until the step's last needed group completes, by the ranker's "
        "predicted remaining lengths and the filter's recent pass rate; between min and max x "
        "batch_size. Fewer groups in flight park fewer tokens. Needs a ranker (and a "
        "rollout.engine_model.profile for the peak; without one, every engine slot counts).",
    )
    min: float = Field(1.0, ge=1.0, le=16.0, description="Fewest groups in flight, x batch_size.")
    max: float = Field(2.0, ge=1.0, le=16.0, description="Most groups in flight, x batch_size.")
    utilization: float = Field(
        0.9, gt=0, le=1,
        description="Share of peak throughput the engines should keep until the target is met.",
    )

    @model_validator(mode="after")
    def _check(self) -> "AdaptiveOverProvisionConfig":
        if self.min > self.max:
            raise ValueError(f"partial.adaptive.min ({self.min}) exceeds max ({self.max})")
        return self


class PartialConfig(BaseModel):
    """Policy 'partial' (APRIL active partial rollouts): over-provision, abort once batch_size
    groups are complete, resume the rest first next step. Read when rollout.policy=partial and
    by ranked_dispatch with base 'partial'; under any other policy it is ignored (the loader
    warns when it is written)."""

    model_config = ConfigDict(extra="forbid")

    over_provision: float = Field(
        2.0,
        ge=1.0,
        le=16.0,
        description="Groups in flight = over_provision x batch_size (2.0 mirrors APRIL); "
        "adaptive.enabled replaces it.",
    )
    adaptive: AdaptiveOverProvisionConfig = Field(
        default_factory=AdaptiveOverProvisionConfig,
        description="Groups in flight sized by the ranker (adaptive over-provisioning).",
    )


class RankedDispatchConfig(BaseModel):
    """Policy ranked_dispatch (StreamRL): a base policy whose groups a dispatcher places on
    engines by predicted length (skewness-aware dispatch, StreamRL Algorithm 2) and admits
    longest first. Read only when rollout.policy=ranked_dispatch (the loader warns when it is
    written under another policy); it also reads rollout.engine_model, and rollout.partial when
    its base is 'partial'."""

    model_config = ConfigDict(extra="forbid")

    base: Literal["sync", "partial"] = Field(
        "sync",
        description="The policy under the dispatcher: 'sync', or 'partial' (configured by "
        "rollout.partial; off-policy, so it needs an explicit correction).",
    )
    alpha: float = Field(
        0.2, gt=0, lt=1,
        description="Share of a step's groups, longest predicted first, treated as long-tail: "
        "they run on engines of their own, in small batches that decode fast.",
    )
    cost_model: Literal["fluid", "streamrl"] = Field(
        "fluid",
        description="How many engines serve the long tail alone: 'fluid' predicts each engine's "
        "makespan under continuous batching from every placed request's predicted length and "
        "may choose no split (every engine serves every class, longest first, evenly); "
        "'streamrl' is Algorithm 2 as published (Eq. 2 with the P90 / P50 of recent lengths, "
        "always a split). docs/policies.md compares them.",
    )
    min_recall: float = Field(
        0.5, ge=0, le=1,
        description="cost_model=fluid splits engines only while the ranker's recall of the "
        "longest alpha share of recent groups is at least this (below it, every engine serves "
        "every group, still longest predicted first): a split on wrong predictions sends the "
        "wrong groups to the long-tail engines.",
    )
    objective: Literal["max", "sum"] = Field(
        "max",
        description="cost_model=streamrl: how the long-tail and regular engines' predicted "
        "latencies combine: 'max' (they run in parallel) or 'sum' (as StreamRL's pseudocode "
        "writes it).",
    )


# sglang-router's cache_aware balances load only past a difference of 64 requests (and 1.5x):
# with a system prompt shared by every prompt, each request matches the first engine's prefix
# tree, and a few engines with tens of requests in flight would all be served by one (measured:
# 316 of 316 requests on one of two engines). Later arguments win: rollout.router.extra_args
# may still set it.
CACHE_AWARE_BALANCE = ["--balance-abs-threshold", "2"]

CHATML_OBSERVATION = "<|im_end|>\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"


class EpisodeConfig(BaseModel):
    """Multi-turn rollouts (rollout/episodes.py): each sample is an episode of model turns and
    environment steps. Off (generator null): one request per sample, as always."""

    model_config = ConfigDict(extra="forbid")

    generator: str | None = Field(
        None,
        description="Runs one episode per sample: 'multi_turn' (model turn, environment step, "
        "observation, until the environment says done or the token budget ends), an entry point "
        "in the 'rlkit.generators' group, or a dotted path 'pkg.module:function'. null: one "
        "request per sample. Every policy and mode works with it: an abort parks an episode "
        "mid-turn (resumed from its tokens) or on a tool call (re-run on resume).",
    )
    environment: str | None = Field(
        None,
        description="The environment each episode steps (needed with a generator): 'calculator', "
        "'guess_number', an entry point in 'rlkit.environments', or a dotted path to a factory "
        "fn(EpisodePrompt, **env_kwargs).",
    )
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to the environment's factory.")
    turn_stop: list[str] = Field(
        default_factory=list,
        description="Stop strings that end a model turn (besides EOS), e.g. ['</calc>']: the "
        "environment reads the turn. rollout.sampling.max_new_tokens bounds the whole episode "
        "(model and observation tokens).",
    )
    observation_template: str = Field(
        CHATML_OBSERVATION,
        description="How an observation is tokenized (once, with loss mask 0): the text around "
        "'{observation}' closes the model's turn and opens its next one. The default is ChatML "
        "(SmolLM2, Qwen); set your model's turn markers.",
    )
    tool_concurrency: int = Field(32, ge=1, description="Environment steps (tool calls) running at once, per rollout actor.")
    tool_timeout_s: float = Field(
        30.0, gt=0,
        description="Seconds an environment step may take; past it the episode gets an error "
        "observation and goes on, and rollout/tool_failures/timeout counts it.",
    )

    @model_validator(mode="after")
    def _check(self) -> "EpisodeConfig":
        if self.generator is not None and self.environment is None:
            raise ValueError("rollout.episode.generator needs rollout.episode.environment")
        if "{observation}" not in self.observation_template:
            raise ValueError("rollout.episode.observation_template must contain '{observation}'")
        return self


class RewardConfig(BaseModel):
    """How each finished sample is scored."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        "math",
        description="Reward function: a built-in name (math, exact_match, format, judge: a "
        "frozen engine group's verdict, rlkit.rewards.judge), an entry point in the "
        "'rlkit.rewards' group, or a dotted path 'pkg.module:function'.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments passed to the reward function."
    )
    timeout_s: float = Field(30.0, gt=0, description="Seconds one reward call may take.")
    on_error: Literal["drop_group", "fail_step"] = Field(
        "drop_group",
        description="A reward that raises or times out: drop the sample's group (recorded with the "
        "error) or fail the step.",
    )
    isolation: Literal["process", "thread"] = Field(
        "process",
        description="Where a synchronous reward function runs. 'process': a pool of worker "
        "processes; a call past timeout_s kills its worker, so a reward that never returns "
        "holds nothing (the function must be importable at module level: built-ins, entry "
        "points and dotted paths are). 'thread': daemon threads in this process, for functions "
        "that cannot be pickled or need its state; a timed-out thread cannot be stopped and is "
        "abandoned (see max_stuck). Async rewards always run on the event loop.",
    )
    workers: int = Field(
        4, ge=1, description="Sync reward calls running at once (worker processes or threads)."
    )
    max_stuck: int = Field(
        8, ge=1,
        description="isolation 'thread': at this many abandoned threads still running timed-out "
        "calls, later sync reward calls fail at once (counted as errors) instead of adding more.",
    )


class HealthConfig(BaseModel):
    """Engine and router health: probes, removal from the router, restarts (rollout.health)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True,
        description="Watch the engines and the router: a dead or hung engine leaves the router "
        "at once, its unfinished requests go on elsewhere with their tokens, and it is "
        "restarted; a dead or hung router is restarted and the requests that went through it "
        "are sent again, with their tokens, once it is back. Off: a failed request fails its "
        "sample (its group is dropped, counted).",
    )
    interval_s: float = Field(
        2.0, gt=0, description="Seconds between two probes of every engine and of the router (a "
        "failed request also probes at once). A hung engine or router is found within "
        "hung_after_timeouts x (interval_s + probe_timeout_s), plus one probe_timeout_s for "
        "an engine that stopped during a probe (the progress read after it).",
    )
    probe_timeout_s: float = Field(
        10.0, gt=0, description="A probe (an engine's: a one-token /generate; the router's: its "
        "/health) that takes longer has timed out. An engine's probe queues behind its prefills "
        "and running requests, so a busy engine's may time out: it then counts only if the "
        "engine made no progress since its previous probe (its schedulers' last report in "
        "/v1/loads, read within the same timeout, did not change; as SGLang's /health_generate). "
        "Keep it above the longest an engine goes without reporting under full load (SGLang: a "
        "prefill chunk or 15 decode steps; the built-in engine: one decoder layer of a forward).",
    )
    hung_after_timeouts: int = Field(
        2, ge=1, description="Consecutive timed-out probes that declare an engine (or the router) "
        "hung; for an engine, only probes that timed out while it made no progress count, and "
        "one that timed out while it progressed (busy, metric engines/busy_probes) ends the "
        "run. A refused or reset connection declares it dead at the first probe.",
    )
    max_restarts: int = Field(
        3, ge=0, description="Restarts per engine over the run, and of the router (0: never "
        "restart; without an engine the run goes on with the others, without the router it "
        "stops with RouterDown, every group parked with its tokens).",
    )
    restart_backoff_s: float = Field(
        2.0, ge=0, description="Wait before a restart (an engine's or the router's), doubled "
        "after each failed attempt.",
    )
    relaunches_per_sample: int = Field(
        3, ge=0, description="Times one response is sent again after its engine was lost, in a "
        "step, before it fails (recorded as an engine failure).",
    )
    wait_for_engine_s: float = Field(
        600.0, gt=0, description="How long a step waits for an engine to serve again when none "
        "does, or for the router to route again (restarts pending). After that, or when no "
        "restart is left, the run stops (EnginesDown, RouterDown) with every group parked with "
        "its tokens; resume=auto continues from there.",
    )


# -- the per-policy layout's moved keys ----------------------------------------------------
# Each policy's knobs are the section of its name; engine_model serves the two policies that
# plan with predicted lengths. The loader warns when one of these is written but the selected
# policy does not read it (RolloutConfig.sections_read).
POLICY_SECTIONS: tuple[str, ...] = ("partial", "tail_batching", "ranked_dispatch", "engine_model")

# Keys of the earlier feature-grouped layout -> their place now, both under `rollout.`; a
# section (adaptive_over_provision) moves key by key. Read at the new place, with a
# DeprecatedKeyWarning each, for one release. TODO(next release): remove, with move_keys.
MOVED_KEYS: dict[str, str] = {
    "over_provision": "partial.over_provision",
    "adaptive_over_provision": "partial.adaptive",
    "dispatch.alpha": "ranked_dispatch.alpha",
    "dispatch.cost_model": "ranked_dispatch.cost_model",
    "dispatch.min_recall": "ranked_dispatch.min_recall",
    "dispatch.objective": "ranked_dispatch.objective",
    "dispatch.profile": "engine_model.profile",
    "dispatch.slots_per_engine": "engine_model.slots_per_engine",
}
MOVED_ROOTS: tuple[str, ...] = tuple(dict.fromkeys(k.split(".")[0] for k in MOVED_KEYS))


class DeprecatedKeyWarning(FutureWarning):
    """A recipe key that moved: it still loads, at its new place, until the next release.
    (A FutureWarning, so a user running `rlkit` sees it: DeprecationWarning is hidden.)"""


class MovedKeyError(ValueError):
    """A moved key set at its old and its new place to different values, or an unknown key
    under a section that moved; `path` is the old key path (under rollout.) as written."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


def deprecation_message(old: str, new: str) -> str:
    return (f"rollout.{old} is deprecated: read as rollout.{new}; write that instead "
            "(the old key is accepted until the next release)")


def moved_to(old: str) -> str | None:
    """The new path (under rollout.) of an old one, or None if it did not move."""
    for before, after in MOVED_KEYS.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before):]
    return None


def move_keys(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Move every MOVED_KEYS key in `data` (a `rollout` mapping as written) to its new place,
    in place, leaf by leaf; returns the (old, new) paths moved. Both places set to different
    values, or an unknown key under a moved section, raise MovedKeyError."""
    moved = []
    for root in MOVED_ROOTS:
        if root not in data:
            continue
        for sub, value in _leaves(data.pop(root)):
            old = ".".join((root, *sub))
            new = moved_to(old)
            if new is None:
                raise MovedKeyError(old, _unknown_under_moved(root, sub))
            _put(data, old, new, value)
            moved.append((old, new))
    return moved


def _leaves(value: Any, at: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*at, str(k)))]
    return [(at, value)]


def _unknown_under_moved(root: str, sub: tuple[str, ...]) -> str:
    keys = {k.split(".", 1)[1]: v for k, v in MOVED_KEYS.items() if k.startswith(root + ".")}
    to: dict[str, list[str]] = {}
    for k, v in keys.items():
        to.setdefault(v.split(".")[0], []).append(k)
    where = " and ".join(f"rollout.{s} ({', '.join(ks)})" for s, ks in to.items())
    if not sub:
        return f"rollout.{root}: this section no longer exists: its keys moved to {where}"
    close = difflib.get_close_matches(sub[0], list(keys), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"rollout.{'.'.join((root, *sub))}: unknown key{hint}; rollout.{root} no longer "
            f"exists: its keys moved to {where}")


def _put(data: dict[str, Any], old: str, new: str, value: Any) -> None:
    *parents, last = new.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise MovedKeyError(old, f"rollout.{old} moved to rollout.{new}, but rollout."
                                f"{'.'.join(parents[: i + 1])} is set to a value, not a section")
        node = child
    if value == {} and isinstance(node.get(last, {}), dict):  # an empty section: nothing moves
        node.setdefault(last, {})
    elif last in node and node[last] != value:
        raise MovedKeyError(old, f"rollout.{old} and rollout.{new} are both set, to {value!r} "
                            f"and {node[last]!r}: rollout.{old} is the deprecated name of "
                            f"rollout.{new}; keep only rollout.{new}")
    else:
        node[last] = value


FROZEN_ROLES = ("teacher", "judge")


class FrozenEnginesConfig(BaseModel):
    """A group of engines serving a frozen model beside the policy's (docs/frozen-engines.md):
    never given a weight update, health-checked and restarted like the policy's engines, behind
    a router of its own, on bundles of its own."""

    model_config = ConfigDict(extra="forbid")

    role: Literal[FROZEN_ROLES] = Field(  # type: ignore[valid-type]
        ...,
        description="'teacher': scores every completed sample's response tokens (one prefill "
        "request each, at rollout.sampling.temperature) into Sample.teacher_logprobs, which "
        "train.algorithm.distill_coef turns into the distillation advantage; at most one group "
        "is the teacher. 'judge': serves reward plugins that call it by the group's name "
        "(rlkit.rewards.engine_group; the built-in reward 'judge').",
    )
    model: str = Field(
        ...,
        min_length=1,
        description="The frozen model: an HF folder (e.g. one `rlkit export` wrote from an "
        "earlier run), or a demo model name as model.path takes ('tiny', 'smollm2'). It must "
        "share the policy's tokenizer when role is 'teacher' (it scores the policy's token ids; "
        "checked at start).",
    )
    engine: EngineConfig = Field(
        default_factory=lambda: EngineConfig(num_engines=1),
        description="The group's engine servers (kind, count, device, ...; one by default). "
        "They get bundles of their own (cluster.cpus_per_engine CPUs, and GPUs as the policy's "
        "engines get them) beside the policy's and the trainer's, also in a colocated run: "
        "frozen engines never sleep and never share the trainer's GPUs.",
    )
    router: RouterConfig = Field(default_factory=RouterConfig, description="The group's own router.")

    @field_validator("engine", mode="before")
    @classmethod
    def _one_engine_unless_said(cls, value: Any) -> Any:
        """A group's engine section without num_engines means one engine (the policy's default,
        two, is for the policy)."""
        if isinstance(value, dict) and "num_engines" not in value:
            value = {**value, "num_engines": 1}
        return value

    max_concurrency: int = Field(
        32, ge=1, description="Requests to the group in flight at once, from every caller "
        "(teacher scoring, judge rewards); more wait their turn.")
    requests_per_minute: float = Field(
        0.0, ge=0, description="Rate limit on requests to the group (a token bucket holding a "
        "second's worth); 0: unlimited.")
    timeout_s: float = Field(
        60.0, gt=0, description="Seconds one request to the group may take, waiting for its "
        "turn excluded; a timed-out request is retried (retries) and counted.")
    retries: int = Field(
        2, ge=0, description="Retries of a failed request (an error, a timeout, an engine or "
        "router lost), after the group's health monitor has an engine serving again. A request "
        "that fails every try fails its sample like a failing reward (rollout.reward.on_error).")


class RolloutConfig(BaseModel):
    """Generation side: engines, router, sampling and the scheduling policy over the buffer."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine servers.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="The sglang-router.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling.")
    batch_size: int = Field(
        8, ge=1, description="Prompt groups per training step (slime's rollout_batch_size)."
    )
    n_samples_per_prompt: int = Field(
        4, ge=1, le=1024, description="Responses per prompt: the GRPO group size."
    )
    policy: PolicyName = Field(
        "sync",
        description="Scheduling policy: 'sync' launches exactly batch_size groups and waits for "
        "all; 'partial' (APRIL) over-provisions, aborts once batch_size groups are complete and "
        "resumes the unfinished ones first next step (requires an explicit "
        "train.algorithm.off_policy_correction); 'tail_batching' (Flexes/RollPacker) runs "
        "speculative short rounds and defers the prompts that do not finish to long rounds "
        "(on-policy unless deferred=resume); 'ranked_dispatch' (StreamRL) runs sync or partial "
        "with every group placed and admitted by predicted length. Each policy's knobs are the "
        "section of its name (rollout.partial, rollout.tail_batching, rollout.ranked_dispatch); "
        "a policy's section written while another policy is selected is ignored, with a "
        "warning, so one recipe can switch policies from the command line. The ranker, the "
        "filter and the staleness bounds serve every policy.",
    )
    partial: PartialConfig = Field(
        default_factory=PartialConfig,
        description="Policy 'partial': over-provisioning. Read under rollout.policy=partial and "
        "ranked_dispatch with base 'partial'; otherwise ignored (with a warning when written).",
    )
    tail_batching: TailBatchingConfig = Field(
        default_factory=TailBatchingConfig,
        description="Policy 'tail_batching': short and long rounds. Read under "
        "rollout.policy=tail_batching; otherwise ignored (with a warning when written).",
    )
    ranked_dispatch: RankedDispatchConfig = Field(
        default_factory=RankedDispatchConfig,
        description="Policy 'ranked_dispatch': its base policy and the dispatcher. Read under "
        "rollout.policy=ranked_dispatch; otherwise ignored (with a warning when written).",
    )
    engine_model: EngineModelConfig = Field(
        default_factory=EngineModelConfig,
        description="Engine capacity and latency for the policies that plan with predicted "
        "lengths: read by ranked_dispatch and by partial with adaptive.enabled; otherwise "
        "ignored (with a warning when written).",
    )
    filter: FilterConfig = Field(
        default_factory=FilterConfig, description="Dynamic sampling: the group filter."
    )
    ranker: RankerConfig = Field(default_factory=RankerConfig, description="Output-length ranker.")
    max_staleness: int = Field(
        4,
        ge=0,
        le=1000,
        description="Most policy versions a group's oldest token may lag behind the trainer.",
    )
    staleness_policy: StalenessPolicy = Field(
        StalenessPolicy.DROP,
        description="What happens to a group past max_staleness: 'drop' it (counted), "
        "'regenerate' it from the prompt, or 'correct' (keep it; the trainer's off-policy "
        "correction must be on).",
    )
    max_token_lag: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Most policy versions any trained token may lag behind the trainer "
        "(null: no bound). Per sample, keeping the group (max_staleness bounds whole groups): "
        "a parked sample about to be resumed whose oldest token would lag more than this when "
        "trained is restarted from its prompt instead (its tokens discarded, counted in "
        "rollout/lag_restarts and rollout/lag_restart_tokens), and so is a ready sample still "
        "untrained when the trainer's version moves past it. Async mode generates one version "
        "ahead, so 0 there admits no overlap (sync, step for step). With partial rollouts a "
        "step waits for the groups on their last chance, at most its target of them: in async "
        "mode under a bound of 1 every group is, so over_provision has no effect there.",
    )
    max_resume_log_ratio: float | None = Field(
        None,
        gt=0,
        description="Bound on a resumed sample's measured mismatch (null: none). When a parked "
        "sample resumes, the engine also scores its parked tokens under the weights it resumes "
        "with (SGLang's input_token_logprobs, from the prefill the resume does anyway) and the "
        "mean log(pi_now / pi_rollout) over them is taken: the geometric-level log-ratio, as "
        "train.algorithm.off_policy_correction's reject: geometric judges a whole sample at "
        "training. Past this bound in absolute value, the request is cut at its first chunk and "
        "the sample restarted from its prompt (counted in rollout/mismatch_restarts and "
        "rollout/mismatch_restart_tokens; rollout/resume_abs_log_ratio is the mean measured). "
        "Where max_token_lag bounds versions, this bounds what they changed. Single-turn "
        "rollouts only: an episode's environment cannot rewind.",
    )
    reward: RewardConfig = Field(
        default_factory=RewardConfig,
        description="Reward function (an episode whose environment gives a reward is not scored by it).")
    episode: EpisodeConfig = Field(
        default_factory=EpisodeConfig, description="Multi-turn rollouts: a generator and its environment.")
    health: HealthConfig = Field(
        default_factory=HealthConfig, description="Engine health checks and restarts (the "
        "frozen groups' engines and routers too)."
    )
    frozen_engines: dict[str, FrozenEnginesConfig] = Field(
        default_factory=dict,
        description="Frozen engine groups beside the policy's engines, by name (letters, digits, "
        "'_' and '-'): a teacher for on-policy distillation, judges and reward models for reward "
        "plugins (docs/frozen-engines.md).",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """The keys MOVED_KEYS lists, read at their new place for one release, with a warning
        each (the recipe loader moves them first, naming the file; this catches the rest:
        Python callers, recipe.yaml files of older runs)."""
        if isinstance(data, dict) and any(k in data for k in MOVED_ROOTS):
            data = copy.deepcopy(data)  # the caller's nested mappings stay as given
            for old, new in move_keys(data):
                warnings.warn(deprecation_message(old, new), DeprecatedKeyWarning, stacklevel=2)
        return data

    @model_validator(mode="after")
    def _needs_ranker(self) -> "RolloutConfig":
        wants = [why for why, on in (
            ("rollout.policy=ranked_dispatch", self.policy == "ranked_dispatch"),
            ("rollout.tail_batching.proactive", self.policy == "tail_batching"
             and self.tail_batching.proactive),
            ("rollout.partial.adaptive", self.base_policy == "partial"
             and self.partial.adaptive.enabled),
        ) if on]
        if wants and self.ranker.name is None:
            raise ValueError(f"{', '.join(wants)} needs a length ranker: set rollout.ranker.name "
                             "(history, learned, ...)")
        return self

    @model_validator(mode="after")
    def _episodes_route_by_prefix(self) -> "RolloutConfig":
        """A multi-turn recipe that does not name rollout.router.policy routes cache_aware,
        balanced past a difference of 2 requests (CACHE_AWARE_BALANCE; the description of
        rollout.router.policy says why); a policy the recipe sets is kept as it is."""
        if self.episode.generator is not None and "policy" not in self.router.model_fields_set:
            self.router = self.router.model_copy(update={
                "policy": "cache_aware", "extra_args": [*CACHE_AWARE_BALANCE, *self.router.extra_args]})
        return self

    @model_validator(mode="after")
    def _frozen_groups(self) -> "RolloutConfig":
        for name in self.frozen_engines:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
                raise ValueError(f"rollout.frozen_engines: group name {name!r} may hold letters, "
                                 "digits, '_' and '-' only (it names log files and metrics)")
        teachers = [n for n, g in self.frozen_engines.items() if g.role == "teacher"]
        if len(teachers) > 1:
            raise ValueError(f"rollout.frozen_engines: {teachers} all have role 'teacher'; one "
                             "group scores the samples")
        return self

    @property
    def teacher(self) -> str | None:
        """The name of the frozen group with role 'teacher', if any."""
        return next((n for n, g in self.frozen_engines.items() if g.role == "teacher"), None)

    @model_validator(mode="after")
    def _rescore_single_turn(self) -> "RolloutConfig":
        if self.max_resume_log_ratio is not None and self.episode.generator is not None:
            raise ValueError("rollout.max_resume_log_ratio restarts single-turn samples; it cannot "
                             "be set with rollout.episode.generator (an episode's environment "
                             "cannot rewind)")
        return self

    @property
    def samples_per_step(self) -> int:
        """Responses one training step trains on: batch_size x n_samples_per_prompt."""
        return self.batch_size * self.n_samples_per_prompt

    @property
    def base_policy(self) -> str:
        """The policy that launches and ends the step: ranked_dispatch's base, else the policy."""
        return self.ranked_dispatch.base if self.policy == "ranked_dispatch" else self.policy

    def sections_read(self) -> set[str]:
        """Which of POLICY_SECTIONS the selected policy reads (the others are ignored)."""
        read = set()
        if self.policy in ("tail_batching", "ranked_dispatch"):
            read.add(self.policy)
        if self.base_policy == "partial":
            read.add("partial")
        if self.policy == "ranked_dispatch" or "partial" in read and self.partial.adaptive.enabled:
            read.add("engine_model")
        return read

    def _at(self, path: str) -> Any:
        """The value at a dotted key path under this section (`tail_batching.deferred`)."""
        node: Any = self
        for part in path.split("."):
            node = getattr(node, part)
        return node

    def off_policy_reason(self) -> str | None:
        """Why this rollout set-up can train on tokens of older policy versions (the recipe then
        requires an explicit off-policy correction), or None. Each policy declares when
        (rollout.policy_names); staleness_policy=correct says it for every policy."""
        rule, why = POLICIES[self.policy].off_policy, None
        if rule is not None and all(self._at(key) == value for key, value in rule.when.items()):
            why = rule.reason
        if why is None and self.staleness_policy is StalenessPolicy.CORRECT:
            why = "rollout.staleness_policy=correct keeps stale groups"
        return why
