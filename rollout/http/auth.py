"""Control-token checks of rlkit's servers: the contract lives in common.control_token (the
trainer side needs it too); this adds which endpoints of an engine change its state."""

from __future__ import annotations

from rlkit.common.control_token import (  # noqa: F401 - re-exported: the rollout side's one import
    CONTROL_TOKEN_ENV,
    OPEN_PREFIXES,
    ControlTokenMissing,
    auth_headers,
    check_authorization,
    check_bind,
    control_token_from_env,
    is_loopback,
    needs_token,
)

# Engine endpoints that change server state (SGLang's names; SGLang's admin endpoints). With a
# token every endpoint but the probes needs it (needs_token), these included; the list says
# which calls steer an engine (the fuzz and the docs read it). The router's own state-changing
# endpoints (/workers, /flush_cache) are guarded by the router itself (rollout/http/router.py).
CONTROL_PATHS = frozenset({
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weight_version",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/rlkit/decode_stats",  # ?reset=1 clears the counters a benchmark reads
})
