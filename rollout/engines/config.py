"""Recipe sections for the engine servers and the router (`rollout.engine`, `rollout.router`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    """Engine servers that generate rollouts. All of them sit behind one sglang-router."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["hf", "sglang"] = Field(
        "hf",
        description="Engine server: 'hf' is rlkit's built-in server (transformers model, batched "
        "KV-cache decoder; CPU or CUDA); 'sglang' launches real SGLang servers (GPU machines, "
        "`pip install rlkit[gpu]`). Both speak the same HTTP protocol behind the router.",
    )
    num_engines: int = Field(2, ge=1, le=1024, description="Number of engine servers.")
    host: str = Field("127.0.0.1", description="Interface the engine servers bind to.")
    max_running_requests: int = Field(
        64,
        ge=1,
        le=65536,
        description="Requests one engine decodes together (continuous-batching slots); more wait "
        "in its queue.",
    )
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        description="KV-cache capacity of one engine in tokens (prompt + generated, all running "
        "requests). None: bounded only by max_running_requests x (prompt + max_new_tokens).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Device of the built-in engine; auto picks cuda when available."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations dtype; auto is float32 on CPU, bfloat16 on CUDA."
    )
    max_prefill_tokens: int = Field(
        8192,
        ge=1,
        description="Built-in engine: padded prompt tokens (rows x longest prompt) admitted into "
        "one prefill forward; bounds how long a burst of arrivals stalls decoding.",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="Built-in engine: torch intra-op threads per engine. None: the machine's cores "
        "divided by num_engines, at least 1 (oversubscribing cores makes OpenMP spin and slows "
        "everything on a shared machine).",
    )
    stream_interval: int = Field(
        8,
        ge=1,
        description="Tokens between two streamed chunks (SGLang's --stream-interval, default 1 "
        "there). A request's last chunk (finish or abort) always carries every token at once, "
        "so a larger interval loses nothing for rollouts; each chunk costs CPU in the engine, "
        "the router and the client (about 100 us per chunk on a CPU machine).",
    )
    incremental_streaming_output: bool = Field(
        True,
        description="Streamed chunks carry only the new tokens (SGLang's "
        "--incremental-streaming-output) instead of repeating the whole output in every chunk, "
        "which costs O(n^2) bytes for long responses. The client accepts both forms.",
    )
    seed: int = Field(0, description="Engine i samples unseeded requests from seed + i.")
    startup_timeout_s: float = Field(
        600.0, gt=0, description="Seconds to wait for an engine to answer /health after start."
    )
    gpus_per_engine: int = Field(
        1, ge=1, description="GPUs per SGLang server (its tensor-parallel size); ignored by 'hf'."
    )
    sglang_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra SGLang server arguments passed through unchanged "
        "(e.g. {mem_fraction_static: 0.8, chunked_prefill_size: 8192}).",
    )


class RouterConfig(BaseModel):
    """The sglang-router process in front of the engines."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] = Field(
        "round_robin",
        description="Router load-balancing policy for /generate. Left unset in a multi-turn "
        "recipe (rollout.episode.generator set), it becomes 'cache_aware': each turn resends "
        "the episode so far, and the router sends it to the engine whose prefix tree matches "
        "it best (the one that served the previous turn, where SGLang's radix cache holds the "
        "prefix), as it does a parked sample's continuation; that default also puts "
        "'--balance-abs-threshold 2' first in extra_args, so that a load difference of more "
        "than 2 requests (and 1.5x) goes to the least loaded engine (the router's own 64 lets "
        "one engine take every request of a prompt set sharing its system prompt). Set "
        "explicitly, the policy is kept as set, with the router's own thresholds.",
    )
    host: str = Field("127.0.0.1", description="Interface the router binds to.")
    port: int = Field(0, ge=0, le=65535, description="Router port; 0 picks a free port.")
    prometheus_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Router metrics port; 0 picks a free port (the router's default 29000 "
        "collides between jobs).",
    )
    request_timeout_s: float = Field(
        3600.0, gt=0, description="Router-side timeout of one forwarded request."
    )
    health_check_interval_s: int = Field(
        10, ge=1, description="Seconds between the router's health checks of each worker."
    )
    health_failure_threshold: int = Field(
        3, ge=1, description="Failed health checks before the router marks a worker unhealthy."
    )
    circuit_breaker: bool = Field(
        False,
        description="Let the router stop sending to a worker after a run of failed requests. "
        "Off by default (slime does the same): a worker that is slow under load (long prompts, "
        "a busy CPU) is not broken, and a 503 'No available workers' would fail the step.",
    )
    max_retries: int = Field(
        5, ge=0, description="Times the router retries a /generate on another worker after a "
        "connection failure (0 disables retries)."
    )
    worker_startup_timeout_s: int = Field(
        300, ge=1, description="How long the router keeps trying to reach a worker it was given "
        "before dropping it (its default, 1800 s, hides dead workers)."
    )
    startup_timeout_s: float = Field(
        60.0, gt=0, description="Seconds to wait for the router's /health after start."
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Extra command-line arguments for the router binary, passed through.",
    )

    @model_validator(mode="after")
    def _check(self) -> "RouterConfig":
        if self.port and self.port == self.prometheus_port:
            raise ValueError(f"router.port and router.prometheus_port are both {self.port}")
        return self
