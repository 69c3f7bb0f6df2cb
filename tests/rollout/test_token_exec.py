"""rlkit.rollout.http.token_exec: the token reaches the program's arguments, never its command line,
and never its output (SGLang logs every server argument, its keys included, at start)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlkit.common.control_token import CONTROL_TOKEN_ENV
from rlkit.rollout.engines.process import spawn
from rlkit.rollout.http.token_exec import REDACTED, TOKEN_PLACEHOLDER, Redactor, fill_token

TOKEN = "tOk3n-_0123456789abcdefghijklmnopqrstuvwxyzAB"  # url-safe, as secrets.token_urlsafe


def test_fill_token_replaces_every_placeholder():
    args = ["--api-key", TOKEN_PLACEHOLDER, "--keys", f"a:b:admin:{TOKEN_PLACEHOLDER}", "--port", "1"]
    assert fill_token(args, TOKEN) == ["--api-key", TOKEN, "--keys", f"a:b:admin:{TOKEN}", "--port", "1"]


@given(pieces=st.lists(st.sampled_from([b"x", b"\n", b"tOk", TOKEN.encode(), TOKEN.encode()[:7],
                                        TOKEN.encode()[7:], b"<", b"server_args={'api_key': '"]),
                       max_size=30),
       cuts=st.lists(st.integers(0, 400), max_size=8))
def test_the_redactor_blanks_every_token_however_the_stream_is_cut(pieces, cuts):
    stream = b"".join(pieces)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    redactor = Redactor(TOKEN)
    out = b"".join(redactor.feed(stream[a:b]) for a, b in zip(bounds, bounds[1:])) + redactor.close()
    assert out == stream.replace(TOKEN.encode(), REDACTED)
    assert TOKEN.encode() not in out


PROGRAM = textwrap.dedent("""
    import subprocess, sys
    print("argv", sys.argv[1:], flush=True)
    sys.stderr.write("traceback quoting --api-key " + sys.argv[2] + "\\n")
    subprocess.run([sys.executable, "-c", "import sys; print('child got ' + sys.argv[1])", sys.argv[2]])
    sys.exit(int(sys.argv[4]))
""")


@pytest.fixture
def program(tmp_path, monkeypatch):
    (tmp_path / "fake_server.py").write_text(PROGRAM)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    return tmp_path


def test_the_program_gets_the_token_and_its_output_and_its_childrens_never_show_it(program):
    argv = [sys.executable, "-m", "rlkit.rollout.http.token_exec", "fake_server", "--api-key",
            TOKEN_PLACEHOLDER, "--exit", "3"]
    proc = spawn("fake", argv, log_path=program / "fake.log")
    assert proc.process.wait(60) == 3  # the program's exit status
    proc.stop()
    log = (program / "fake.log").read_text()
    assert TOKEN not in log
    assert f"argv ['--api-key', '{REDACTED.decode()}', '--exit', '3']" in log  # it had the token
    assert f"traceback quoting --api-key {REDACTED.decode()}" in log  # stderr too
    assert f"child got {REDACTED.decode()}" in log  # and a process it started


def test_sigterm_to_the_group_ends_the_program_and_keeps_its_last_words(program):
    (program / "slow_server.py").write_text(textwrap.dedent("""
        import signal, sys, time
        def bye(*_):
            print("shutting down, key " + sys.argv[2], flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        time.sleep(600)
    """))
    argv = [sys.executable, "-m", "rlkit.rollout.http.token_exec", "slow_server", "--api-key", TOKEN_PLACEHOLDER]
    proc = spawn("slow", argv, log_path=program / "slow.log")
    with open(program / "slow.log") as log:  # wait for the program to be up: its first line
        while "ready" not in log.read():
            assert proc.alive(), (program / "slow.log").read_text()
            log.seek(0)
            time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.process.wait(60) == 0
    proc.stop()
    text = (program / "slow.log").read_text()
    assert f"shutting down, key {REDACTED.decode()}" in text and TOKEN not in text


def test_without_a_token_it_refuses_to_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != CONTROL_TOKEN_ENV}
    out = subprocess.run([sys.executable, "-m", "rlkit.rollout.http.token_exec", "json.tool"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0 and f"{CONTROL_TOKEN_ENV} is not set" in out.stderr
