"""The per-run control token: who may change an engine server's or the router's state.

Contract (other parts rely on these names):
- the token travels in the environment variable `RLKIT_CONTROL_TOKEN` (`CONTROL_TOKEN_ENV`);
  every process of a run inherits it, it is never put in a recipe or a log;
- clients send `Authorization: Bearer <token>` on every request (`auth_headers`);
- a server with a token answers every path but the probes (`OPEN_PREFIXES`: /health*, /ready*,
  /metrics*, which carry no secret) only with the header: 401 without it, 403 with another
  token (`needs_token`, `check_authorization`). It is SGLang's rule with `--api-key` and
  `--admin-api-key` both set to the token (sglang/srt/utils/auth.py): generation and the info
  endpoints are guarded too, because SGLang's /server_info returns every server argument, the
  keys included, to whoever may read it;
- a server bound beyond loopback without a token refuses to start (`check_bind`).

Also here: `collectives_on_loopback`, which keeps the sockets of torch.distributed's gloo and
NCCL on the loopback interface when every process of a group is on this machine.

Here, at the bottom of the package graph (rlkit.common) and stdlib only, because both sides
need it: the engine servers and the client (rollout, through rollout.http.auth) and the trainer's
weight sync (train, which imports no rollout code).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from typing import Mapping, MutableMapping

CONTROL_TOKEN_ENV = "RLKIT_CONTROL_TOKEN"
# Paths a server answers without the token: liveness, readiness and metrics probes (SGLang
# matches them by prefix, so /health_generate is one)
OPEN_PREFIXES = ("/health", "/ready", "/metrics")

class ControlTokenMissing(ValueError):
    """A server would listen beyond loopback with nothing guarding its control endpoints."""


def control_token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The run's control token, or None when unset or empty."""
    value = (os.environ if environ is None else environ).get(CONTROL_TOKEN_ENV, "").strip()
    return value or None


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and 'localhost'. The wildcards 0.0.0.0 and :: are not loopback (they
    listen on every interface), nor is any other name (it may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, what: str) -> None:
    """Refuse to serve beyond loopback without a control token (raise ControlTokenMissing)."""
    if token is None and not is_loopback(host):
        raise ControlTokenMissing(
            f"{what} would listen on {host!r}, beyond loopback, with no control token: anyone "
            f"who can reach it could change its weights or abort its requests. Set "
            f"{CONTROL_TOKEN_ENV} (rlkit's cluster launcher sets a fresh one per run), or bind "
            "127.0.0.1 (rollout.engine.host / rollout.router.host)")


def needs_token(path: str) -> bool:
    """Whether a server with a token refuses `path` without it (every path but the probes)."""
    return not path.startswith(OPEN_PREFIXES)


def auth_headers(token: str | None) -> dict[str, str]:
    """Headers that carry the token (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_authorization(header: str | None, token: str) -> int | None:
    """None when `header` carries `token`; else 401 (no bearer token) or 403 (another one)."""
    if not header:
        return 401
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return 401
    # constant time: a wrong guess tells nothing about how much of it was right
    return None if hmac.compare_digest(given.strip().encode(), token.encode()) else 403


# The variables gloo and NCCL read for the interface their sockets bind (gloo's pairs, NCCL's
# bootstrap and socket transport). Unset, each picks an interface of its own: the address the
# machine's hostname resolves to, or the first one that is up, either of them beyond loopback.
COLLECTIVE_INTERFACE_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_interface() -> str:
    """The loopback interface's name ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def collectives_on_loopback(master_address: str = "127.0.0.1",
                            environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """For a group that meets at `master_address`: when that is loopback (every rank is on this
    machine: a local run, a trainer world of one node), set gloo's and NCCL's interface to
    loopback in `environ` (this process's environment by default) where the user has not chosen
    one, so their sockets take no connection from another machine (torch.distributed's sockets
    have no authentication). What it set."""
    if not is_loopback(master_address):
        return {}
    env = os.environ if environ is None else environ
    chosen = {k: loopback_interface() for k in COLLECTIVE_INTERFACE_ENV if not env.get(k)}
    env.update(chosen)
    return chosen
