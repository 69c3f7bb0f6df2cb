"""The per-run control token: who may change an engine server's or the router's state.

Contract (other parts rely on these names):
- the token travels in the environment variable `RLKIT_CONTROL_TOKEN` (`CONTROL_TOKEN_ENV`);
  every process of a run inherits it, it is never put in a recipe or a log;
- clients send `Authorization: Bearer <token>` on every request (`auth_headers`);
- a server with a token refuses its control endpoints without the header (401) or with another
  token (403); /generate, /health and the read-only info endpoints stay open;
- a server bound beyond loopback without a token refuses to start (`check_bind`).

Here, at the bottom of the package graph and stdlib only, because both sides need it: the
engine servers and the client (rollout, through rollout.auth) and the trainer's weight sync
(train, which imports no rollout code).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from typing import Mapping

CONTROL_TOKEN_ENV = "RLKIT_CONTROL_TOKEN"

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
