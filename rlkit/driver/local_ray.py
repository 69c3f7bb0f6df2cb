"""A Ray of a run's own, closed to the network.

Ray 2.60 binds its servers on every interface whatever it is told (measured with `ss -ltnp`
during a local run: gcs_server, the raylet's node and object managers, the driver's and every
worker's core-worker port on *:PORT, the runtime-env agent on the node's address; neither
`_node_ip_address="127.0.0.1"` nor anything else binds them to loopback). So a local Ray runs
with Ray's own token authentication (RAY_AUTH_MODE=token) and a fresh token per run
(RAY_AUTH_TOKEN) in the environment its processes start with and inherit: without the token,
every gRPC call to any of those ports is refused (UNAUTHENTICATED), the runtime-env agent's
HTTP answers 401, and `ray.init(address=...)` fails (tests/e2e/test_interrupt.py probes every
listening port of a run). The token is written nowhere: given in the environment, Ray does not
create ~/.ray/auth_token, a file every later run of the user would share.

The same environment keeps gloo's and NCCL's sockets on loopback where the user has not chosen
an interface (every rank is on this machine): the trainer's world, the weight-sync group and
SGLang's own groups.

A joined cluster is the operator's to secure (docs/reliability.md, "Who can reach a run").
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from rlkit.common.control_token import COLLECTIVE_INTERFACE_ENV, collectives_on_loopback

class LocalRay:
    """`start()` a local Ray with a fresh token, `stop()` it and restore the environment (a
    later Ray in this process, another run's or a test's, starts from what was there)."""

    def __init__(self) -> None:
        self._saved: dict[str, str | None] | None = None

    def start(self, num_cpus: int | float, **options: Any) -> None:
        import ray

        env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_urlsafe(32)}
        chosen = {k: os.environ.get(k, "") for k in COLLECTIVE_INTERFACE_ENV}
        env.update(collectives_on_loopback(environ=chosen))
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        reload_ray_auth()
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     log_to_driver=False, configure_logging=False, **options)
        except BaseException:
            self._restore()
            raise

    def stop(self) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            self._restore()

    def _restore(self) -> None:
        if self._saved is None:
            return
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved = None
        reload_ray_auth()

    def __enter__(self) -> "LocalRay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def local_ray(num_cpus: int | float, **options: Any) -> LocalRay:
    """A started LocalRay, for `with local_ray(2): ...` (benchmarks, tests)."""
    ray = LocalRay()
    ray.start(num_cpus, **options)
    return ray


def reload_ray_auth() -> None:
    """Make this process's Ray core read the auth mode and token again: it caches both on first
    use (ray._private.authentication does the same when it turns token mode on)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
