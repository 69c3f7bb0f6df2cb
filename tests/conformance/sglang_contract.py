"""Checks of what rlkit sends and expects against a real SGLang package's own code; run in a
subprocess by tests/conformance/test_sglang.py, never imported by the test session (it hollows
out the `sglang` package and stubs `triton`, which must not leak into other tests).

    python tests/conformance/sglang_contract.py SITE DEPS CASES.json

SITE holds the unpacked sglang wheel (`pip install --no-deps --target SITE`), DEPS the three
small packages its argument and API modules import (msgspec, pybase64, pyzmq). CASES.json is
what the test recorded of rlkit: `calls` ([method, path, body] as sent to a worker), `fixtures`
(recorded /generate answers and SSE chunks), `argvs` (sglang_server_argv outputs). Prints one
JSON object: {"checks": [[name, ok, detail], ...]}.

Sources read (sglang 0.5.23): the routes, their request classes and auth levels by parsing
srt/entrypoints/http_server.py and v1_loads.py; request-class fields by parsing
srt/managers/io_struct.py; /generate's contract gate and response schema from the generated
sglang.api.v1.api_types (pure msgspec, imported); the server flags from ServerArgs.add_cli_args
(imported: torch CPU, a triton stub); the auth rule from srt/utils/auth.decide_request_auth.
"""

from __future__ import annotations

import argparse
import ast
import importlib.machinery
import json
import sys
import types
from pathlib import Path

ROUTE_DECORATORS = {"get", "post", "put", "delete", "api_route"}


def hollow_package(name: str, path: Path) -> None:
    """Register `name` as a package at `path` without running its heavy __init__ (sglang's
    imports transformers and its frontend language)."""
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = module


def stub_module(name: str) -> None:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = module


def routes(*files: Path) -> dict[str, dict]:
    """path -> {methods, handler, request_class, auth} for every route declared in `files`."""
    found: dict[str, dict] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            auth, paths = "normal", []
            for d in node.decorator_list:
                if not isinstance(d, ast.Call):
                    continue
                fn = d.func
                if isinstance(fn, ast.Name) and fn.id == "auth_level" and d.args:
                    auth = getattr(d.args[0], "attr", "NORMAL").lower()
                elif isinstance(fn, ast.Attribute) and fn.attr in ROUTE_DECORATORS and d.args \
                        and isinstance(d.args[0], ast.Constant):
                    methods = [fn.attr.upper()]
                    for kw in d.keywords:
                        if kw.arg == "methods":
                            methods = [e.value for e in kw.value.elts]  # type: ignore[attr-defined]
                    paths.append((d.args[0].value, methods))
            args = node.args.args
            cls = _class_name(args[0].annotation) if args else None
            for path, methods in paths:
                entry = found.setdefault(path, {"methods": set(), "handler": node.name,
                                                "request_class": cls, "auth": auth})
                entry["methods"].update(methods)
    return found


def _class_name(annotation: ast.expr | None) -> str | None:
    """`X` of a parameter annotated `X` or `Annotated[X, Body()]`."""
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "Annotated":
        annotation = annotation.slice.elts[0] if isinstance(annotation.slice, ast.Tuple) else annotation.slice
    return annotation.id if isinstance(annotation, ast.Name) else None


def struct_fields(io_struct: Path) -> dict[str, set[str]]:
    """class name -> its annotated fields, those of its bases (in the same file) included."""
    classes = {n.name: n for n in ast.parse(io_struct.read_text()).body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> set[str]:
        node = classes.get(name)
        if node is None:
            return set()
        own = {s.target.id for s in node.body
               if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        for b in node.bases:
            if isinstance(b, ast.Name):
                own |= fields(b.id)
        return own

    return {name: fields(name) for name in classes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("site")
    ap.add_argument("deps")
    ap.add_argument("cases")
    a = ap.parse_args()
    site = Path(a.site)
    sys.path[:0] = [str(site), a.deps]
    hollow_package("sglang", site / "sglang")
    stub_module("triton")  # sglang.srt.utils imports it; nothing checked here runs a kernel
    cases = json.loads(Path(a.cases).read_text())
    checks: list[list] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append([name, bool(ok), detail])

    srt = site / "sglang" / "srt"
    table = routes(srt / "entrypoints" / "http_server.py", srt / "entrypoints" / "v1_loads.py")
    fields = struct_fields(srt / "managers" / "io_struct.py")

    # 1. every endpoint rlkit calls exists with that method, and its body names only fields of
    #    the request class the handler takes (FastAPI would 422 an unknown one, or drop it)
    for method, path, body in cases["calls"]:
        route = table.get(path)
        check(f"route {method} {path}", route is not None and method in route["methods"],
              "" if route is None else f"methods {sorted(route['methods'])}")
        if route is None or not isinstance(body, dict) or path == "/generate":
            continue
        cls = route["request_class"] if route["request_class"] in fields else None
        if cls is None:  # the handler reads no body (e.g. /flush_cache takes query args)
            check(f"body {path}", not body, f"{path} takes no body, rlkit sends {sorted(body)}")
            continue
        unknown = sorted(set(body) - fields.get(cls, set()))
        check(f"body {path} ({cls})", not unknown, f"fields not in {cls}: {unknown}")

    # 2. /generate bodies pass SGLang's own contract gate (unknown sampling keys are refused)
    from sglang.api.v1 import api_types

    for i, (method, path, body) in enumerate(cases["calls"]):
        if path != "/generate":
            continue
        try:
            api_types.GenerateRequest.from_json_value(body)
            check(f"/generate body {i}", True)
        except Exception as e:  # noqa: BLE001 - reported
            check(f"/generate body {i}", False, f"{type(e).__name__}: {e}: {body}")

    # 3. recorded answers and stream chunks decode as SGLang's response type
    for name, payload in cases["fixtures"]:
        try:
            api_types.GenerateResponse.from_json_value(payload)
            check(f"response {name}", True)
        except Exception as e:  # noqa: BLE001
            check(f"response {name}", False, f"{type(e).__name__}: {e}")

    # 4. the control token: rlkit's own calls carry it, the router's probes do not; under
    #    --admin-api-key generation and info stay open and control needs the key
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    for method, path, _ in cases["calls"]:
        route = table.get(path)
        if route is None:
            continue
        level = AuthLevel(route["auth"])
        kw = dict(method=method, path=path, api_key=None, admin_api_key="k", auth_level=level)
        open_ = decide_request_auth(authorization_header=None, **kw).allowed
        keyed = decide_request_auth(authorization_header="Bearer k", **kw).allowed
        control = path not in cases["open_paths"]
        check(f"auth {path}", keyed and open_ != control,
              f"level {level.value}: without the key {'allowed' if open_ else 'refused'}")

    # 5. rlkit's launcher argv parses with SGLang's own parser, every flag known
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    for i, (argv, expect) in enumerate(cases["argvs"]):
        try:
            ns, unknown = parser.parse_known_args(argv)
            wrong = {k: getattr(ns, k, None) for k, v in expect.items() if getattr(ns, k, None) != v}
            check(f"argv {i}", not unknown and not wrong, f"unknown {unknown}, parsed {wrong}: {argv}")
        except SystemExit:
            check(f"argv {i}", False, f"argparse refused {argv}")

    print(json.dumps({"checks": checks}))


if __name__ == "__main__":
    main()
