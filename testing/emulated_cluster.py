"""Emulated nodes on one machine: network namespaces on one bridge, each node's link rate-limited like a NIC.

Each node is a namespace with one veth link to a bridge that lives in a namespace of its own; the node
end has an address in 198.18.0.0/24 (the benchmarking range, inside namespaces this harness creates,
never anything outside them). A node's rate is enforced in both directions with `tbf` (the node's
egress on its end of the link, its ingress on the bridge's end). Processes started with `popen` run
inside their node and, as on a real cluster, reach other nodes only through the network: UCX is told
to use TCP (processes of namespaces on one host still share PIDs and the filesystem, so UCX's `cma`
and shared-memory transports would otherwise cross the emulated links). `link_down` cuts a node off
the bridge and `link_up` restores it, addresses and processes untouched. Leaving the `with` block,
also on error, kills the processes and deletes every namespace (which deletes the links).
Needs root and iproute2 (`ip`, `tc`); anything missing is one `EmulatedClusterError` line.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

SUBNET = ipaddress.ip_network("198.18.0.0/24")
TCP_ONLY = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "all"}


class EmulatedClusterError(RuntimeError):
    """The emulated cluster cannot be set up here (not root, no iproute2, a name or address in use)."""


@dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, its end of the link, its address, and its link rate (None: unlimited)."""

    name: str
    namespace: str
    link: str  # the node's end of its veth pair
    bridge_port: str  # the bridge's end
    address: str
    rate_mbit: float | None


class EmulatedCluster:
    """Nodes as network namespaces on one bridge; use as a context manager."""

    def __init__(self, rates: Mapping[str, float | None], tag: str | None = None):
        """`rates`: node name -> link rate in Mbit/s (None: unlimited), in address order (the first is .1)."""
        if not rates or len(rates) > SUBNET.num_addresses - 2:
            raise EmulatedClusterError(f"an emulated cluster has 1..{SUBNET.num_addresses - 2} nodes, not {len(rates)}")
        self.tag = tag or f"wp{os.getpid() % 100000}"
        hosts = SUBNET.hosts()
        self.nodes = {name: Node(name, f"{self.tag}-{name}", f"{self.tag}n{i}", f"{self.tag}b{i}", str(next(hosts)), rate)
                      for i, (name, rate) in enumerate(rates.items())}
        self.bridge_namespace = f"{self.tag}-bridge"
        self._procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []

    # --- set up and tear down ------------------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        _check_host()
        try:
            self._add_namespace(self.bridge_namespace)
            self._ip("-n", self.bridge_namespace, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.bridge_namespace, "link", "set", "br0", "up")
            for node in self.nodes.values():
                self._add_node(node)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, namespace: str) -> None:
        if namespace in _namespaces():
            raise EmulatedClusterError(f"network namespace {namespace!r} exists already (another run, or a leftover: "
                                       f"`ip netns del {namespace}`)")
        self._ip("netns", "add", namespace)
        self._namespaces.append(namespace)
        self._ip("-n", namespace, "link", "set", "lo", "up")

    def _add_node(self, node: Node) -> None:
        self._add_namespace(node.namespace)
        self._ip("link", "add", node.link, "netns", node.namespace, "type", "veth", "peer", "name", node.bridge_port,
                 "netns", self.bridge_namespace)
        self._ip("-n", self.bridge_namespace, "link", "set", node.bridge_port, "master", "br0", "up")
        self._ip("-n", node.namespace, "addr", "add", f"{node.address}/{SUBNET.prefixlen}", "dev", node.link)
        self._ip("-n", node.namespace, "link", "set", node.link, "up")
        if node.rate_mbit is not None:
            self.set_rate(node.name, node.rate_mbit)

    def close(self) -> None:
        """Kill every process started here and delete every namespace (idempotent)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._procs.clear()
        for namespace in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._namespaces.clear()

    # --- what a test does with it --------------------------------------------------------------

    def address(self, node: str) -> str:
        return self.nodes[node].address

    def command(self, node: str, argv: list[str]) -> list[str]:
        """`argv` run inside `node`'s namespace."""
        return ["ip", "netns", "exec", self.nodes[node].namespace, *argv]

    def popen(self, node: str, argv: list[str], *, env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start `argv` inside `node` with TCP as UCX's only transport between nodes; killed when the cluster closes."""
        proc = subprocess.Popen(self.command(node, argv), env={**(env if env is not None else os.environ), **TCP_ONLY},
                                **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, node: str, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(node, argv), capture_output=True, text=True, timeout=timeout)

    def link_down(self, node: str) -> None:
        """Cut `node` off the bridge (its address and processes stay)."""
        self._ip("-n", self.bridge_namespace, "link", "set", self.nodes[node].bridge_port, "down")

    def link_up(self, node: str) -> None:
        self._ip("-n", self.bridge_namespace, "link", "set", self.nodes[node].bridge_port, "up")

    def wait_reachable(self, node: str, address: str, port: int, timeout: float = 10.0) -> float:
        """Wait until a TCP connect from inside `node` to `address:port` succeeds (a link that came back carries
        traffic); returns the seconds it took, or raises EmulatedClusterError after `timeout`."""
        probe = ("import socket, sys, time\n"
                 "start = time.monotonic()\n"
                 "while time.monotonic() - start < float(sys.argv[3]):\n"
                 "    try:\n"
                 "        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()\n"
                 "        print(time.monotonic() - start)\n"
                 "        sys.exit(0)\n"
                 "    except OSError:\n"
                 "        time.sleep(0.05)\n"
                 "sys.exit(1)\n")
        done = self.run(node, [sys.executable, "-c", probe, address, str(port), str(timeout)], timeout=timeout + 10)
        if done.returncode != 0:
            raise EmulatedClusterError(f"node {node!r} cannot reach {address}:{port} within {timeout:g} s")
        return float(done.stdout)

    def tcp_goodput(self, flows: list[tuple[str, str]], nbytes: int, port: int = 29612, timeout: float = 120.0) -> float:
        """Payload bytes per second that TCP connections carry when every (src node, dst node) of `flows` sends
        `nbytes` at once (a sink per flow started in its dst): what the links leave after TCP/IP headers and TCP's
        own behaviour (slow start, sharing), with no UCX in the way. Total bytes over the time until the last lands."""
        sinks, sources = [], []
        try:
            for i, (_, dst) in enumerate(flows):
                sinks.append(self.popen(dst, [sys.executable, "-c", _SINK, self.address(dst), str(port + i)],
                                        stdout=subprocess.PIPE, text=True))
                if sinks[-1].stdout.readline().strip() != "listening":
                    raise EmulatedClusterError(f"node {dst!r}: a TCP sink did not start")
            start = time.time() + 1.0  # every source starts sending at this instant
            for i, (src, dst) in enumerate(flows):
                sources.append(subprocess.Popen(self.command(src, [sys.executable, "-c", _SOURCE, self.address(dst),
                                                                   str(port + i), str(nbytes), str(start)]),
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            ends = []
            for (src, dst), source in zip(flows, sources):
                out, err = source.communicate(timeout=timeout)
                if source.returncode != 0:
                    raise EmulatedClusterError(f"node {src!r} cannot send to {dst!r}: {err.strip()[-200:]}")
                ends.append(float(out))
            return len(flows) * nbytes / (max(ends) - start)
        finally:
            for proc in sinks + sources:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()

    def set_rate(self, node: str, mbit: float) -> None:
        """Limit `node`'s link to `mbit` Mbit/s in each direction (tbf: burst of 1 ms at that rate, at least 64 KiB)."""
        if not mbit > 0:
            raise EmulatedClusterError(f"node {node!r}: a link rate must be positive, not {mbit}")
        found = self.nodes[node]
        burst = max(64 * 1024, int(mbit * 1e6 / 8 / 1000))
        for namespace, device in ((found.namespace, found.link), (self.bridge_namespace, found.bridge_port)):
            self._tc("-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
                     "burst", str(burst), "latency", "100ms")

    @staticmethod
    def _ip(*args: str) -> None:
        _run_tool("ip", args)

    @staticmethod
    def _tc(*args: str) -> None:
        _run_tool("tc", args)


_SINK = ("import socket, sys\n"
         "server = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
         "print('listening', flush=True)\n"
         "conn, _ = server.accept()\n"
         "got = 0\n"
         "while (chunk := conn.recv(1 << 20)):\n"
         "    got += len(chunk)\n"
         "conn.sendall(str(got).encode())\n")
# Connects, waits for the common start instant, sends, and prints when the sink had counted every byte.
_SOURCE = ("import socket, sys, time\n"
           "conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)\n"
           "payload = memoryview(bytearray(int(sys.argv[3])))\n"
           "time.sleep(max(0.0, float(sys.argv[4]) - time.time()))\n"
           "conn.sendall(payload)\n"
           "conn.shutdown(socket.SHUT_WR)\n"
           "assert int(conn.recv(64)) == len(payload)\n"
           "print(time.time())\n")


def _run_tool(tool: str, args: tuple[str, ...]) -> None:
    done = subprocess.run([tool, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise EmulatedClusterError(f"`{tool} {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _check_host() -> None:
    """Root and iproute2, or one line saying which is missing."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulatedClusterError(f"an emulated cluster needs iproute2's {' and '.join(missing)} (apt install iproute2)")
    if os.geteuid() != 0:
        raise EmulatedClusterError("an emulated cluster needs root (network namespaces and tc); run as root")
