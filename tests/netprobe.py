"""What a run listens on, and whether a stranger gets in: every listening TCP socket of a
process tree (from /proc), and an unauthenticated request to each from this machine's
non-loopback address.

    python -m tests.netprobe PID [--token-env]   # a table of the sockets of PID's tree

Ray's servers speak gRPC: a socket is asked for one harmless method of each Ray service (node
info at the GCS, node stats at a raylet, object pull at an object manager, worker stats at a
core worker); a server answers UNIMPLEMENTED for the services it does not serve and
UNAUTHENTICATED, before running anything, for the one it does when the caller has no token.
Other sockets get a plain HTTP GET. Used by tests/e2e/test_interrupt.py during a run, and to
list a run's sockets for docs/reliability.md.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# a refusal comes at once; the deadline only bounds a server that takes the connection and
# never answers (as torch's store does), generous so that a loaded machine is not misread
PROBE_TIMEOUT_S = 30
RAY_METHODS = (
    "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
    "/ray.rpc.NodeManagerService/GetNodeStats",
    "/ray.rpc.ObjectManagerService/Pull",
    "/ray.rpc.CoreWorkerService/GetCoreWorkerStats",
)


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str  # what the process calls itself (Ray actors: ray::Name)
    address: str  # the bound address: 0.0.0.0 / :: is every interface
    port: int

    @property
    def loopback_only(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def own_address() -> str | None:
    """This machine's first non-loopback IPv4 address (`hostname -I`), if it has one."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for addr in out.split():
        if ":" not in addr and not ipaddress.ip_address(addr).is_loopback:
            return addr
    return None


def descendants(root: int) -> list[int]:
    """Every process descended from `root` (not `root`), from /proc (the walk `rlkit bench peer`
    measures memory with)."""
    from rlkit.bench.peer import process_tree as tree

    return tree(root)[1:]


def process_tree(root: int) -> dict[int, str]:
    """pid -> name of `root` and every process descended from it."""
    return {pid: _name(pid) for pid in sorted([root, *descendants(root)])}


def environ_of(pid: int) -> dict[str, str]:
    """A process's environment ({} once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.split("\0") if "=" in x)


def _name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace")
    if first.startswith("ray::") or "/" not in first:
        return first.split()[0] if first else "?"
    if Path(first).name.startswith("python"):  # python -m module / python script
        rest = [a.decode(errors="replace") for a in argv[1:] if a]
        while rest and rest[0] in ("-B", "-u", "-s", "-E", "-I"):
            rest = rest[1:]
        if rest[:1] in (["-m"], ["-c"]) and len(rest) > 1:
            return f"python {rest[0]} {rest[1][:50]}"
        return f"python {Path(rest[0]).name}" if rest else "python"
    return Path(first).name


def listeners(pids: dict[int, str]) -> list[Listener]:
    """Every listening TCP socket owned by one of `pids` (pid -> the name to give it)."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owner.setdefault(target[8:-1], pid)
        except OSError:
            pass
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] != "0A" or parts[9] not in owner:  # 0A: LISTEN
                continue
            hex_addr, hex_port = parts[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as host-order 32-bit words
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            pid = owner[parts[9]]
            found.add(Listener(pid, pids[pid], socket.inet_ntop(family, raw), int(hex_port, 16)))
    return sorted(found, key=lambda x: (x.process, x.port))


def reachable_at(listener: Listener, host: str) -> bool:
    """Whether `listener` takes connections at `host` (a socket on 127.0.0.1 does not at the
    machine's own address)."""
    if listener.loopback_only:
        return False
    try:
        socket.create_connection((host, listener.port), timeout=5).close()
        return True
    except OSError:
        return False


def probe(host: str, port: int, token: str | None = None) -> str:
    """What an unauthenticated (or `token`-carrying) caller gets from host:port: 'grpc:<codes>'
    (one status per RAY_METHODS entry, OK where a call went through), 'http:<status>', or
    'other:<what>'."""
    import grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        codes = []
        for method in RAY_METHODS:
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            try:
                call(b"", timeout=PROBE_TIMEOUT_S, metadata=metadata)  # b"": every request's empty message
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
    if any(c not in ("UNAVAILABLE", "UNKNOWN", "INTERNAL") for c in codes):
        return "grpc:" + ",".join(codes)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/", headers=headers),
                                    timeout=PROBE_TIMEOUT_S) as r:
            return f"http:{r.status}"
    except urllib.error.HTTPError as e:
        return f"http:{e.code}"
    except Exception as e:  # noqa: BLE001 - described, not raised
        return f"other:{type(e).__name__}"


def refused(outcome: str) -> bool:
    """Whether a probe's outcome is a refusal: no gRPC call went through and at least one was
    refused for want of a token, or HTTP 401/403."""
    kind, _, detail = outcome.partition(":")
    if kind == "grpc":
        codes = detail.split(",")
        return "OK" not in codes and "UNAUTHENTICATED" in codes
    return kind == "http" and detail in ("401", "403")


def table(root: int) -> str:
    host = own_address()
    rows = ["| process | address:port | from the network without a token |", "|---|---|---|"]
    for s in listeners(process_tree(root)):
        if host is None or not reachable_at(s, host):
            what = "not reachable (loopback only)"
        else:
            what = probe(host, s.port)
        rows.append(f"| {s.process} | {s.address}:{s.port} | {what} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(int(sys.argv[1])))
