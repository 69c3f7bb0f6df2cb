"""Locked-down servers: the control token contract (rollout.http.auth) on a real built-in engine
server and the real sglang-router, the bind checks, where the trainer's weight-sync store
listens, and a property-based fuzz of the engine server: any malformed request gets a 4xx,
never a 5xx, and the server still generates correctly afterwards."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rlkit.rollout.http.auth import (CONTROL_PATHS, CONTROL_TOKEN_ENV, ControlTokenMissing, auth_headers,
                          check_authorization, check_bind, is_loopback)
from rlkit.rollout.engines.config import EngineConfig, RouterConfig
from tests.netprobe import own_address

TOKEN = "-test-token-0123456789"  # a leading '-', as secrets.token_urlsafe may give


# -- the decision functions ---------------------------------------------------------------------
def test_loopback_and_bind_decisions():
    assert is_loopback("127.0.0.1") and is_loopback("127.3.2.1") and is_loopback("::1")
    assert is_loopback("localhost") and is_loopback("[::1]")
    for host in ("0.0.0.0", "::", "10.0.0.5", "192.0.2.2", "node-7"):
        assert not is_loopback(host)
        with pytest.raises(ControlTokenMissing, match=f"listen on '{host}'.*{CONTROL_TOKEN_ENV}"):
            check_bind(host, None, "the engine")
        check_bind(host, TOKEN, "the engine")  # with a token: fine
    check_bind("127.0.0.1", None, "the engine")


def test_authorization_header_decisions():
    assert check_authorization(None, TOKEN) == 401
    assert check_authorization("", TOKEN) == 401
    assert check_authorization(f"Basic {TOKEN}", TOKEN) == 401
    assert check_authorization("Bearer ", TOKEN) == 401
    assert check_authorization("Bearer nope", TOKEN) == 403
    assert check_authorization(f"Bearer {TOKEN}x", TOKEN) == 403
    assert check_authorization(f"Bearer {TOKEN}", TOKEN) is None
    assert check_authorization(f"bearer {TOKEN}", TOKEN) is None
    assert auth_headers(None) == {} and auth_headers(TOKEN) == {"Authorization": f"Bearer {TOKEN}"}


def test_defaults_bind_loopback():
    assert EngineConfig().host == "127.0.0.1" and RouterConfig().host == "127.0.0.1"


# -- a real engine server with a token ----------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from rlkit.rollout.engines.process import start_hf_server

    old = os.environ.get(CONTROL_TOKEN_ENV)
    os.environ[CONTROL_TOKEN_ENV] = TOKEN  # the server reads it at start
    try:
        proc = start_hf_server(str(tiny_model_dir), EngineConfig(num_engines=1, cpu_threads=1),
                               log_path=tmp_path_factory.mktemp("engine") / "engine.log")
    finally:
        if old is None:
            os.environ.pop(CONTROL_TOKEN_ENV, None)
        else:
            os.environ[CONTROL_TOKEN_ENV] = old
    yield proc
    proc.stop()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def generate_ok(url: str, **headers: str) -> list[int]:
    r = requests.post(f"{url}/generate", json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                    "ignore_eos": True},
        "return_logprob": True}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    ids = [t for _, t, _ in r.json()["meta_info"]["output_token_logprobs"]]
    assert len(ids) == 4
    return ids


def _routes() -> set[tuple[str, str]]:
    """(method, path) of every route the built-in engine server has (its app, not started)."""
    from rlkit.rollout.engines.builtin.hf_server import EngineServer, build_arg_parser

    app = EngineServer(build_arg_parser().parse_args(["--model", "unused"])).app()
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


OPEN = {"/health", "/health_generate"}  # the probes: liveness and a one-token generation


def test_every_endpoint_but_the_probes_needs_the_token_and_none_returns_it(server):
    """SGLang's rule with --api-key and --admin-api-key set to the token: generation, the info
    endpoints and every control endpoint answer 401 without it and 403 with another; only the
    probes stay open. No answer, with or without the token, carries the token."""
    url = server.url
    routes = _routes()
    assert {p for _, p in routes} >= CONTROL_PATHS | OPEN | {"/generate", "/server_info"}
    bodies: list[str] = []
    for method, path in sorted(routes | {("POST", "/no_such_path")}):
        if path in OPEN:
            continue
        missing = requests.request(method, f"{url}{path}", json={}, timeout=30)
        wrong = requests.request(method, f"{url}{path}", json={},
                                 headers={"Authorization": "Bearer nope"}, timeout=30)
        assert (missing.status_code, wrong.status_code) == (401, 403), (method, path, missing.text)
        assert "control token" in missing.json()["message"]
        bodies += [missing.text, wrong.text]
    for path in sorted(OPEN):
        r = requests.get(f"{url}{path}", timeout=30)
        assert r.status_code == 200, path
        bodies.append(r.text)
    # with the token: accepted (the handlers run: 200, or their own 4xx for an empty body)
    assert requests.post(f"{url}/pause_generation", json={"mode": "abort"}, headers=AUTH,
                         timeout=30).status_code == 200
    assert requests.post(f"{url}/continue_generation", json={}, headers=AUTH,
                         timeout=30).status_code == 200
    assert requests.post(f"{url}/abort_request", json={"abort_all": True}, headers=AUTH,
                         timeout=30).status_code == 200
    assert requests.post(f"{url}/update_weight_version", json={}, headers=AUTH,
                         timeout=30).status_code == 400  # reached validation
    for method, path in sorted(routes):
        if method == "GET" and "memory_occupation" not in path:  # reads: every one answers
            r = requests.get(f"{url}{path}", headers=AUTH, timeout=30)
            assert r.status_code == 200, (path, r.text)
            bodies.append(r.text)
    assert generate_ok(url, **AUTH)
    assert not [b for b in bodies if TOKEN in b]


async def test_engine_client_sends_the_token_from_the_environment(server, monkeypatch):
    from rlkit.rollout.http.client import EngineClient

    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    async with EngineClient(router_url=None, worker_urls=[server.url]) as client:
        assert client.control_token == TOKEN
        async with client.session.post(f"{server.url}/flush_cache") as r:
            assert r.status == 200
    async with EngineClient(router_url=None, worker_urls=[server.url],
                            control_token="wrong") as client:
        async with client.session.post(f"{server.url}/flush_cache") as r:
            assert r.status == 403


def test_weight_sync_control_sends_the_token(server, monkeypatch):
    from rlkit.common.engine_http import EngineControlError, HttpEngine

    HttpEngine(server.url, timeout_s=30, control_token=TOKEN).flush_cache()
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    HttpEngine(server.url, timeout_s=30).pause("abort")  # default: the environment
    HttpEngine(server.url, timeout_s=30).continue_generation()
    monkeypatch.delenv(CONTROL_TOKEN_ENV)
    with pytest.raises(EngineControlError, match="HTTP 401"):
        HttpEngine(server.url, timeout_s=30).flush_cache()


def test_an_engine_beyond_loopback_without_a_token_refuses_to_start(tiny_model_dir):
    host = own_address() or "0.0.0.0"  # the wildcard is beyond loopback too
    env = {k: v for k, v in os.environ.items() if k != CONTROL_TOKEN_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "rlkit.rollout.engines.builtin.hf_server", "--model", str(tiny_model_dir),
         "--host", host, "--port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    assert f"listen on '{host}', beyond loopback, with no control token" in out.stderr
    assert CONTROL_TOKEN_ENV in out.stderr


@pytest.mark.skipif(own_address() is None, reason="no non-loopback address on this machine")
def test_an_engine_on_the_machine_address_with_a_token_guards_its_control_endpoints(
        tiny_model_dir, monkeypatch, tmp_path):
    from rlkit.rollout.engines.process import start_hf_server

    host = own_address()
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    proc = start_hf_server(str(tiny_model_dir), EngineConfig(host=host, cpu_threads=1),
                           log_path=tmp_path / "engine.log")
    try:
        assert proc.url.startswith(f"http://{host}:")
        assert requests.post(f"{proc.url}/flush_cache", timeout=30).status_code == 401
        assert requests.post(f"{proc.url}/flush_cache", headers=AUTH, timeout=30).status_code == 200
        generate_ok(proc.url, **AUTH)
        # nothing of it listens on loopback or the wildcard
        port = int(proc.url.rsplit(":", 1)[1])
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        proc.stop()


# -- the router -----------------------------------------------------------------------------------
def test_router_control_plane_needs_the_token(server, monkeypatch, tmp_path):
    from rlkit.rollout.http.router import Router, RouterError

    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    router = Router(RouterConfig(), log_path=tmp_path / "router.log")
    argv = router.argv(1, 2, [server.url])
    assert TOKEN not in " ".join(argv) and "rlkit.rollout.http.token_exec" in argv  # not on the command line
    router.start([server.url])
    try:
        with open(f"/proc/{router.process.process.pid}/cmdline", "rb") as f:
            assert TOKEN.encode() not in f.read()
        for method in ("GET", "POST"):
            r = requests.request(method, f"{router.url}/workers", json={"url": "http://x:1"},
                                 timeout=30)
            assert r.status_code == 401, (method, r.text)
        assert requests.post(f"{router.url}/workers", json={"url": "http://x:1"},
                             headers={"Authorization": "Bearer nope"}, timeout=30).status_code == 401
        assert [w.url for w in router.list_workers()] == [server.url]  # Router sends the token
        # /generate needs the token at the router, and the router hands its own to the engine
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = requests.post(f"{router.url}/generate", json={"input_ids": [1, 2]},
                              headers=headers, timeout=30)
            assert r.status_code == 401, r.text
        assert generate_ok(router.url, **AUTH) and requests.get(f"{router.url}/health").status_code == 200
        # a worker registered later (an engine restart) gets the key as well: without it the
        # router would send it none and the engine would refuse every request
        router.remove_worker(server.url)
        router.add_worker(server.url)
        assert generate_ok(router.url, **AUTH)
        assert "without API key" not in (tmp_path / "router.log").read_text()
        # the prometheus port binds the router's host, not every interface
        listening = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
        assert f"127.0.0.1:{router.prometheus_port} " in listening
    finally:
        router.stop()
    monkeypatch.delenv(CONTROL_TOKEN_ENV)
    with pytest.raises(RouterError, match="beyond loopback, with no control token"):
        Router(RouterConfig(host="0.0.0.0")).start([])


def test_weight_sync_store_listens_on_its_address_only():
    import datetime

    from rlkit.train.megatron.parallel import bound_tcp_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = bound_tcp_store("127.0.0.1", port, 1, datetime.timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v"
    listening = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
    lines = [line for line in listening.splitlines() if f":{port} " in line]
    assert lines and all(f"127.0.0.1:{port} " in line for line in lines), lines


# -- fuzzing the engine server ----------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
ints = st.integers(-5, 10) | st.integers(-(2**70), 2**70) | st.sampled_from([0, 2**31, 2**63, 10**6])
token_ids = st.lists(ints, max_size=6) | json_values
sampling = st.fixed_dictionaries({}, optional={
    "max_new_tokens": ints | json_values,
    "min_new_tokens": ints,
    "temperature": st.floats(allow_nan=True, allow_infinity=True) | json_values,
    "top_p": st.floats(allow_nan=True, allow_infinity=True),
    "top_k": ints,
    "min_p": st.floats(allow_nan=True, allow_infinity=True),
    "stop": json_values,
    "stop_token_ids": token_ids,
    "ignore_eos": json_values,
    "sampling_seed": ints | json_values,
    "n": ints,
    "repetition_penalty": st.floats(allow_nan=True, allow_infinity=True),
    "logit_bias": json_values,
}) | json_values
generate_bodies = st.fixed_dictionaries({}, optional={
    "input_ids": token_ids,
    "text": st.text(max_size=30) | json_values,
    "sampling_params": sampling,
    "rid": st.text(max_size=10) | json_values,
    "stream": st.booleans() | json_values,
    "return_logprob": st.booleans() | json_values,
    "logprob_start_len": ints,
    "top_logprobs_num": ints,
    "model": st.text(max_size=10) | json_values,
    "unknown_field": json_values,
}) | json_values


def encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN/Infinity: Python's json reads them


raw_bodies = (generate_bodies.map(encode) | st.binary(max_size=64)
              | st.sampled_from([b"", b"{", b"null", b"[]", b'{"input_ids": [1,', b"\xff\xfe",
                                 b'{"input_ids": "abc"}', b"NaN"]))
# Every endpoint the server has, with each method it does and does not take. The body goes to
# each with the token, so the fuzz reaches the handlers' validation, not only the token check.
# Not the memory endpoints: a well-formed release puts the engine to sleep until a weight update
# (tests/rollout/test_sleep_wake.py covers them, behind the token too).
ENDPOINTS = sorted(CONTROL_PATHS - {"/init_weights_update_group", "/update_weights_from_distributed",
                                    "/release_memory_occupation", "/resume_memory_occupation"}
                   | {"/generate", "/health", "/model_info", "/server_info", "/v1/loads",
                      "/v1/models", "/no_such_path"})


def _settle(url: str) -> None:
    """Undo what a well-formed control call the fuzzer made may have done (pause, an open
    weight-update session), so each example starts from a serving engine."""
    requests.post(f"{url}/continue_generation", headers=AUTH, timeout=60)
    requests.post(f"{url}/end_weight_update", headers=AUTH, timeout=60)


def _check(r: requests.Response, what: str) -> None:
    assert r.status_code < 500, f"{what}: HTTP {r.status_code}: {r.text[:500]}"
    if r.headers.get("Content-Type", "").startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") or '"abort"' in r.text, what


@settings(max_examples=int(os.environ.get("RLKIT_FUZZ_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=raw_bodies, method=st.sampled_from(["POST", "POST", "PUT", "GET", "DELETE", "PATCH"]),
       path=st.sampled_from(["/generate"] * 6 + ENDPOINTS),
       content_type=st.sampled_from(["application/json", "text/plain", None]))
def test_fuzz_malformed_requests_get_4xx_and_the_server_keeps_serving(server, body, method, path,
                                                                      content_type):
    headers = dict(AUTH)
    if content_type:
        headers["Content-Type"] = content_type
    r = requests.request(method, f"{server.url}{path}", data=body, headers=headers, timeout=120)
    _check(r, f"{method} {path} {body[:200]!r}")
    if path != "/generate":
        _settle(server.url)


@settings(max_examples=int(os.environ.get("RLKIT_FUZZ_EXAMPLES", "150")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=generate_bodies)
# what the fuzzer found (fixed in hf_server): a top_k past int64 crashed the engine core, so every
# later request got 503; a lone surrogate in text was a 500 from the tokenizer; an empty stop
# string stopped every request after one token
@example(body={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "top_k": 2**70}})
@example(body={"text": "\ud800", "sampling_params": {"max_new_tokens": 2}})
@example(body={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "stop": [""]}})
def test_fuzz_generate_bodies(server, body):
    r = requests.post(f"{server.url}/generate", data=encode(body),
                      headers={"Content-Type": "application/json", **AUTH}, timeout=120)
    _check(r, f"POST /generate {encode(body)[:300]!r}")


def test_after_the_fuzz_the_server_still_generates_the_same_tokens(server):
    _settle(server.url)
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    first = generate_ok(server.url, **AUTH)
    assert generate_ok(server.url, **AUTH) == first  # greedy: deterministic
    loads = requests.get(f"{server.url}/v1/loads", headers=AUTH, timeout=30).json()["loads"][0]
    assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 0, loads  # none leaked
