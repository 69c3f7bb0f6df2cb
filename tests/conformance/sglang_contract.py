"""Checks of what rlkit sends and expects against a real SGLang package's own code; run in a
subprocess by tests/conformance/test_sglang.py, never imported by the test session (it hollows
out the `sglang` package and stubs `triton`, which must not leak into other tests).

    python tests/conformance/sglang_contract.py SITE DEPS CASES.json

SITE holds the unpacked sglang wheel (`pip install --no-deps --target SITE`), DEPS the three
small packages its argument and API modules import (msgspec, pybase64, pyzmq). CASES.json is
what the test recorded of rlkit (see test_sglang.py). Prints one JSON object:
{"checks": [[name, ok, detail], ...], "samples": {...}}, the samples being answers built by
SGLang's own code for the test to parse with rlkit's parsers.

What is SGLang's own here (sglang 0.5.23), and what each check runs:
- routes, their request classes and auth levels: parsed from srt/entrypoints/http_server.py
  and v1_loads.py;
- control bodies: the request classes of srt/managers/io_struct.py, built from their own source
  (the module itself imports most of the runtime) as the msgspec Structs they are, validated
  with pydantic exactly as FastAPI does for a body (their `__get_pydantic_core_schema__`):
  types and values (Literal modes, int ports, str versions, the base64 tensor list), plus the
  value rules the server applies later (memory tags from srt/constants.py, dtype names read as
  `getattr(torch, name)`, the TP rank of a weight-update group member as
  srt/model_executor/model_runner_components/weight_updater.py computes it);
- update_weights_from_tensor: each TP rank's entry opened by SGLang's MultiprocessingSerializer
  (its SafeUnpickler) and compared with the tensors rlkit sent;
- /generate: the contract gate and response schema of the generated sglang.api.v1.api_types;
- server arguments: ServerArgs.add_cli_args / prepare_server_args on rlkit's launcher argv;
- the token: srt/utils/auth.decide_request_auth over every route, and what
  srt/utils/common.build_server_info returns, for each way rlkit launches SGLang;
- answers rlkit reads: /server_info from build_server_info, /v1/loads from LoadSnapshot, a
  final chunk's weight_versions from srt/utils/weight_versions.py (returned as samples).
"""

from __future__ import annotations

import argparse
import ast
import importlib.machinery
import json
import sys
import types
import typing
from pathlib import Path

ROUTE_DECORATORS = {"get", "post", "put", "delete", "api_route"}
PROBE_PREFIXES = ("/health", "/ready", "/metrics")  # what SGLang leaves open under any key


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


def request_structs(io_struct: Path, wanted: set[str]) -> dict[str, type]:
    """The request classes `wanted` (and the bases they have in the file), built from
    io_struct.py's own class definitions as msgspec Structs. Names their annotations use that
    are neither typing's nor the few imported here are taken as Any (none of rlkit's bodies
    reaches them: it never sends those fields)."""
    from sglang.srt.utils.msgspec_utils import Base64Bytes, msgspec_struct_pydantic_core_schema

    tree = ast.parse(io_struct.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    order: list[str] = []

    def need(name: str) -> None:
        if name in classes and name not in order:
            for b in classes[name].bases:
                if isinstance(b, ast.Name):
                    need(b.id)
            order.append(name)

    for name in sorted(wanted):
        need(name)
    module = types.ModuleType("sglang_io_struct_requests")
    import msgspec

    namespace = module.__dict__
    namespace.update({k: getattr(typing, k) for k in typing.__all__})
    namespace.update(msgspec=msgspec, Base64Bytes=Base64Bytes,
                     msgspec_struct_pydantic_core_schema=msgspec_struct_pydantic_core_schema,
                     __name__=module.__name__)
    used = {n.id for c in order for n in ast.walk(classes[c]) if isinstance(n, ast.Name)}
    for name in used - set(namespace) - set(order) - set(dir(__builtins__)):
        namespace[name] = typing.Any
    sys.modules[module.__name__] = module
    future = ast.ImportFrom("__future__", [ast.alias("annotations")], 0)
    source = ast.fix_missing_locations(ast.Module(body=[future, *(classes[c] for c in order)],
                                                  type_ignores=[]))
    exec(compile(source, str(io_struct), "exec"), namespace)  # noqa: S102 - SGLang's own classes
    return {c: namespace[c] for c in order}


def tp_rank_formula(weight_updater: Path) -> ast.expr:
    """The expression SGLang assigns to `rank` when a TP rank joins the weight-update group."""
    for node in ast.walk(ast.parse(weight_updater.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "init_weights_update_group":
            for stmt in ast.walk(node):
                if isinstance(stmt, ast.Assign) and [getattr(t, "id", "") for t in stmt.targets] == ["rank"]:
                    return stmt.value
    raise LookupError(f"no `rank = ...` in init_weights_update_group of {weight_updater}")


def main() -> None:  # noqa: C901 - one check after another, in the order of the docstring
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
    samples: dict[str, object] = {}

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append([name, bool(ok), detail])

    srt = site / "sglang" / "srt"
    table = routes(srt / "entrypoints" / "http_server.py", srt / "entrypoints" / "v1_loads.py")

    # 1. every endpoint rlkit calls exists with that method
    for method, path, _ in cases["calls"]:
        route = table.get(path)
        check(f"route {method} {path}", route is not None and method in route["methods"],
              "" if route is None else f"methods {sorted(route['methods'])}")

    # 2. every control body, as FastAPI takes it: the handler's request class, validated by
    #    pydantic through the class's own core schema (types and values), no key SGLang would
    #    silently drop (its schema ignores unknown keys), and the rules applied after parsing
    import pydantic
    import torch

    from sglang.srt import constants

    bodies = [(m, p, b) for m, p, b in cases["calls"] if isinstance(b, dict) and p != "/generate"]
    wanted = {table[p]["request_class"] for _, p, _ in bodies if p in table and table[p]["request_class"]}
    structs = request_structs(srt / "managers" / "io_struct.py", wanted)
    formula = tp_rank_formula(srt / "model_executor" / "model_runner_components" / "weight_updater.py")
    validated: dict[str, object] = {}
    for method, path, body in bodies:
        route = table.get(path)
        if route is None:
            continue
        cls = structs.get(route["request_class"] or "")
        if cls is None:  # the handler reads no body (e.g. /flush_cache takes query args)
            check(f"body {path}", not body, f"{path} takes no body, rlkit sends {sorted(body)}")
            continue
        import msgspec

        fields = {f.name for f in msgspec.structs.fields(cls)}
        unknown = sorted(set(body) - fields)
        try:
            obj = pydantic.TypeAdapter(cls).validate_python(body)
            error = ""
        except pydantic.ValidationError as e:
            obj, error = None, str(e).replace("\n", " ")[:500]
        check(f"body {path} ({cls.__name__})", not unknown and obj is not None,
              f"fields SGLang would drop: {unknown}; {error}: {json.dumps(body)[:300]}")
        if obj is None:
            continue
        validated.setdefault(path, obj)
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            tags = obj.tags
            check(f"value {path} tags", tags is None or set(tags) <= set(constants.GPU_MEMORY_ALL_TYPES),
                  f"{tags} not among {constants.GPU_MEMORY_ALL_TYPES}")
        if path == "/update_weights_from_distributed":
            bad = [d for d in obj.dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
            check(f"value {path} dtypes", not bad and len(obj.dtypes) == len(obj.names) == len(obj.shapes),
                  f"not torch dtypes: {bad}")
        if path == "/init_weights_update_group":
            check(f"value {path} backend", obj.backend in ("nccl", "gloo"), obj.backend)
        if path == "/update_weights_from_disk":
            check(f"value {path} load_format", obj.load_format is None, f"{obj.load_format!r}")

    # 3. the ranks of a weight-update group as SGLang numbers them: rlkit's offsets must give
    #    every engine's TP ranks the ranks 1..world-1, each once (the trainer is 0)
    layout = cases["rank_layout"]
    ranks = []
    for offset, tp in zip(layout["offsets"], layout["tp_sizes"]):
        for tp_rank in range(tp):
            ranks.append(eval(compile(ast.Expression(formula), "weight_updater", "eval"),  # noqa: S307
                              {}, {"rank_offset": offset, "self": types.SimpleNamespace(tp_rank=tp_rank)}))
    check("rank layout", sorted(ranks) == list(range(1, layout["world"])),
          f"SGLang's `rank = {ast.unparse(formula)}` gives {ranks} for world {layout['world']}")

    # 4. an in-memory update's tensors, opened by SGLang's own deserializer per TP rank
    from sglang.srt.utils.common import MultiprocessingSerializer

    tensor_update = validated.get("/update_weights_from_tensor")
    check("tensor update recorded", tensor_update is not None)
    if tensor_update is not None:
        expect = cases["tensor_update"]
        entries = tensor_update.serialized_named_tensors
        check("tensor update entries", len(entries) == expect["tp_size"], f"{len(entries)} entries")
        for tp_rank, raw in enumerate(entries):
            try:
                named = MultiprocessingSerializer.deserialize(raw)
                got = {n: [list(t.shape), str(t.dtype).removeprefix("torch."), float(t.double().sum())]
                       for n, t in named}
                check(f"tensor update rank {tp_rank}", got == expect["tensors"], f"{got} != {expect['tensors']}")
            except Exception as e:  # noqa: BLE001 - reported
                check(f"tensor update rank {tp_rank}", False, f"{type(e).__name__}: {e}")

    # 5. /generate bodies pass SGLang's own contract gate (unknown sampling keys are refused)
    from sglang.api.v1 import api_types

    for i, (method, path, body) in enumerate(cases["calls"]):
        if path != "/generate":
            continue
        try:
            api_types.GenerateRequest.from_json_value(body)
            check(f"/generate body {i}", True)
        except Exception as e:  # noqa: BLE001 - reported
            check(f"/generate body {i}", False, f"{type(e).__name__}: {e}: {body}")

    # 6. recorded answers and stream chunks decode as SGLang's response type
    for name, payload in cases["fixtures"]:
        try:
            api_types.GenerateResponse.from_json_value(payload)
            check(f"response {name}", True)
        except Exception as e:  # noqa: BLE001
            check(f"response {name}", False, f"{type(e).__name__}: {e}")

    # 7. rlkit's launcher argv: every flag SGLang's parser knows, with the values meant
    from sglang.srt.server_args import ServerArgs, prepare_server_args
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth
    from sglang.srt.utils.common import build_server_info

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    for name, argv, expect in cases["argvs"]:
        try:
            ns, unknown = parser.parse_known_args(argv)
            wrong = {k: getattr(ns, k, None) for k, v in expect.items() if getattr(ns, k, None) != v}
            check(f"argv {name}", not unknown and not wrong, f"unknown {unknown}, parsed {wrong}: {argv}")
        except SystemExit:
            check(f"argv {name}", False, f"argparse refused {argv}")

    # 8. the token, for each way rlkit launches SGLang: /server_info (build_server_info) holds
    #    it, so every route that answers without it must be a probe; with it, rlkit's calls pass
    token = cases["token"]
    for name, argv, expect in cases["argvs"]:
        try:
            server_args = prepare_server_args(argv)
            info = build_server_info(server_args, {})
        except Exception as e:  # noqa: BLE001 - reported
            check(f"server_info {name}", False, f"{type(e).__name__}: {e}")
            continue
        leaks = token in json.dumps(info, default=str)
        check(f"server_info {name} holds the token", leaks,
              "build_server_info no longer returns the keys: the guard below is moot, not wrong")
        check(f"server_info {name} tp_size", info.get("tp_size") == expect["tp_size"],
              f"tp_size {info.get('tp_size')!r}")
        check(f"server_info {name} gpu_uuids", "gpu_uuids" not in info,
              "SGLang reports gpu_uuids now: the NCCL guard can check SGLang engines")
        samples.setdefault("server_info", {k: info[k] for k in ("tp_size", "base_gpu_id", "host")})
        opened = []
        for path, route in sorted(table.items()):
            for m in sorted(route["methods"]):
                kw = dict(method=m, path=path, api_key=server_args.api_key,
                          admin_api_key=server_args.admin_api_key, auth_level=AuthLevel(route["auth"]))
                if decide_request_auth(authorization_header=None, **kw).allowed:
                    opened.append(f"{m} {path}")
        check(f"auth {name}: only probes answer without the token",
              all(p.split(" ", 1)[1].startswith(PROBE_PREFIXES) for p in opened),
              f"open without the token: {[p for p in opened if not p.split(' ', 1)[1].startswith(PROBE_PREFIXES)]}")
        for method, path, _ in cases["calls"]:
            route = table.get(path)
            if route is None:
                continue
            kw = dict(method=method, path=path, api_key=server_args.api_key,
                      admin_api_key=server_args.admin_api_key, auth_level=AuthLevel(route["auth"]))
            allowed = decide_request_auth(authorization_header=f"Bearer {token}", **kw).allowed
            check(f"auth {name}: rlkit's {method} {path} with the token", allowed)

    # 9. answers built by SGLang's own code, for the test to read with rlkit's parsers
    from sglang.srt.managers.load_snapshot import LoadSnapshot
    from sglang.srt.utils.weight_versions import (WeightVersionEvent, add_weight_versions_to_meta_info,
                                                  compute_weight_version_spans)

    samples["loads"] = {"loads": [LoadSnapshot(dp_rank=0, num_running_reqs=3, num_waiting_reqs=1).to_dict(),
                                  LoadSnapshot(dp_rank=1, num_running_reqs=2).to_dict()]}
    # the health monitor's progress mark: each entry's scheduler time (`timestamp`), before and
    # after a scheduler published again
    samples["loads_published"] = [
        {"loads": [LoadSnapshot(dp_rank=0, timestamp=t, num_running_reqs=4).to_dict()]}
        for t in (1764288000.25, 1764288000.5)]
    spans = compute_weight_version_spans([WeightVersionEvent("3", 4), WeightVersionEvent("4", 7)], "5", 9)
    meta: dict = {}
    add_weight_versions_to_meta_info(meta, spans, 9)
    samples["weight_versions_meta"] = meta
    print(json.dumps({"checks": checks, "samples": samples}))


if __name__ == "__main__":
    main()
