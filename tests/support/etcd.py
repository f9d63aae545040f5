"""etcd clusters for the tests: members started from the system's etcd binary on free loopback ports (skipped without one)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ETCD = shutil.which("etcd")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class EtcdCluster:
    """`members` etcd processes on free loopback ports, each with a data directory under `root`."""

    def __init__(self, root: Path, members: int, client_ports: list[int] | None = None):
        if ETCD is None:
            pytest.skip("no etcd binary on PATH (Debian: apt-get install etcd-server)")
        root.mkdir(exist_ok=True)
        self.clients = client_ports or [free_port() for _ in range(members)]
        peers = [free_port() for _ in range(members)]
        initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peers))
        self.procs: list[subprocess.Popen] = []
        for i, (client, peer) in enumerate(zip(self.clients, peers)):
            log = open(root / f"etcd-m{i}.log", "w")
            self.procs.append(subprocess.Popen(
                [ETCD, "--name", f"m{i}", "--data-dir", str(root / f"etcd-m{i}"),
                 "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", initial, "--initial-cluster-token", root.name,
                 "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "error"],
                stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while not all(self._healthy(c) for c in self.clients):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.close()
                raise AssertionError(f"etcd did not start: {(root / 'etcd-m0.log').read_text()[-2000:]}")
            time.sleep(0.1)

    @staticmethod
    def _healthy(port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                return json.loads(answer.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    @property
    def address(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.clients)

    def kill(self, member: int) -> None:
        self.procs[member].kill()
        self.procs[member].wait()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
