"""The emulated-cluster harness (testing/emulated_cluster.py): nodes reach each other only over their links,
at their rates, a cut link cuts, and nothing is left behind."""

from __future__ import annotations

import sys

import pytest

from weightplan.testing import emulated_cluster
from weightplan.testing.emulated_cluster import EmulatedCluster, EmulatedClusterError

PORT = 29611
SERVE = ("import socket, sys\n"
         "s = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
         "while True:\n"
         "    c, _ = s.accept()\n"
         "    n = 0\n"
         "    while (b := c.recv(1 << 16)):\n"
         "        n += len(b)\n"
         "    c.sendall(str(n).encode()); c.close()\n")
SEND = ("import socket, sys, time\n"
        "c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))\n"
        "t = time.perf_counter(); c.sendall(b'x' * int(sys.argv[3])); c.shutdown(socket.SHUT_WR)\n"
        "got = int(c.recv(64)); print(got, time.perf_counter() - t)\n")


def _send(cluster: EmulatedCluster, node: str, to: str, nbytes: int, timeout: float = 5.0) -> tuple[int, float]:
    done = cluster.run(node, [sys.executable, "-c", SEND, cluster.address(to), str(PORT), str(nbytes), str(timeout)],
                       timeout=timeout + 30)
    if done.returncode != 0:
        raise ConnectionError(done.stderr.strip().splitlines()[-1])
    got, seconds = done.stdout.split()
    return int(got), float(seconds)


def _namespaces() -> set[str]:
    return emulated_cluster._namespaces()


def test_nodes_talk_over_their_links_at_their_rate_and_a_cut_link_cuts():
    with EmulatedCluster({"a": None, "b": 40.0}, tag="wpt-link") as cluster:
        cluster.popen("a", [sys.executable, "-c", SERVE, cluster.address("a"), str(PORT)])
        cluster.wait_reachable("b", cluster.address("a"), PORT, timeout=60)  # the server binds (slowly, under load)
        got, _ = _send(cluster, "b", "a", 1000)
        assert got == 1000
        nbytes = 4_000_000  # 0.8 s at 40 Mbit/s; over an unlimited veth, milliseconds
        got, seconds = _send(cluster, "b", "a", nbytes, timeout=60)
        assert got == nbytes
        assert nbytes * 8 / seconds / 1e6 < 2 * 40, "the tbf limit did not hold"
        cluster.link_down("b")
        with pytest.raises(ConnectionError):
            _send(cluster, "b", "a", 1000, timeout=2)
        cluster.link_up("b")
        cluster.wait_reachable("b", cluster.address("a"), PORT, timeout=30)  # neighbour entries re-resolve first
        assert _send(cluster, "b", "a", 1000, timeout=10)[0] == 1000
        assert {"wpt-link-a", "wpt-link-b", "wpt-link-bridge"} <= _namespaces()
    assert not {n for n in _namespaces() if n.startswith("wpt-link")}


def test_a_failing_test_leaves_no_namespace_or_process_behind():
    with pytest.raises(RuntimeError, match="inside"):
        with EmulatedCluster({"a": None, "b": None}, tag="wpt-fail") as cluster:
            proc = cluster.popen("a", [sys.executable, "-c", "import time; time.sleep(600)"])
            raise RuntimeError("inside")
    assert proc.poll() is not None
    assert not {n for n in _namespaces() if n.startswith("wpt-fail")}


def test_bad_setups_are_one_line(monkeypatch):
    with EmulatedCluster({"a": None}, tag="wpt-dup"):
        with pytest.raises(EmulatedClusterError, match=r"^network namespace 'wpt-dup-bridge' exists already"):
            EmulatedCluster({"a": None}, tag="wpt-dup").__enter__()
        assert {"wpt-dup-a", "wpt-dup-bridge"} <= _namespaces()  # the refused second cluster deleted nothing of the first
    assert not {n for n in _namespaces() if n.startswith("wpt-dup")}
    with pytest.raises(EmulatedClusterError, match=r"rate must be positive"):
        with EmulatedCluster({"a": 0.0}, tag="wpt-rate"):
            pass
    assert not {n for n in _namespaces() if n.startswith("wpt-rate")}
    monkeypatch.setattr(emulated_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(EmulatedClusterError, match=r"^an emulated cluster needs root"):
        EmulatedCluster({"a": None}).__enter__()
    monkeypatch.setattr(emulated_cluster.shutil, "which", lambda tool: None)
    with pytest.raises(EmulatedClusterError, match=r"needs iproute2's ip and tc"):
        EmulatedCluster({"a": None}).__enter__()
