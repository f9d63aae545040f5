"""Start trainer and inference processes for runtime tests around a rendezvous store hosted by the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from weightplan.runtime import Rendezvous, load_plan
from weightplan.runtime.tables.fanout import second_hops


NETWORK_STORE_PORT = 29400
NETWORK_SECRET = "weightplan-emulated-cluster-test-secret"
_SERVE_STORE = ("import sys, time\n"
                "from weightplan.runtime import Rendezvous\n"
                "store = Rendezvous.connect(sys.argv[1], sys.argv[2], serve=True)\n"
                "print('serving', flush=True)\n"
                "time.sleep(86400)\n")


class Job:
    """One sync job: a store and the worker processes of `weightplan.testing.runtime_worker`.

    By default the store is on a free loopback port of the test process and the workers are its
    children. With `cluster` (testing/emulated_cluster.py), the store runs in a process of
    node `store_node` on that node's address, with a job secret, and each worker starts on the node
    `start` names: the test reaches neither, so it reads the workers' events and gates them with files.
    """

    def __init__(self, tmp_path: Path, plan: Path | str, name: str, *, cluster=None, store_node: str | None = None,
                 address: str | None = None):
        """`plan` and `name` may list several comma-separated cases (see testing/runtime_worker.py). `address`: a store
        the test runs elsewhere (an etcd:// cluster) instead of one it serves; with `cluster`, the workers get `address`
        and no store is started on `store_node`."""
        self.tmp, self.plan, self.name, self.cluster = tmp_path, plan, name, cluster
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = None
        if cluster is None:
            self.rendezvous = Rendezvous.connect(name.split(",")[0], address or "127.0.0.1:0", serve=address is None)
            self.address = self.rendezvous.address
            return
        self.rendezvous = None
        self.gates = tmp_path / "gates"
        self.gates.mkdir()
        self.env = {**os.environ, "WEIGHTPLAN_SECRET": NETWORK_SECRET}
        if address is not None:
            self.address = address
            return
        self.address = f"{cluster.address(store_node)}:{NETWORK_STORE_PORT}"
        self._spawn("store", [sys.executable, "-c", _SERVE_STORE, name.split(",")[0], self.address], store_node)
        deadline = time.monotonic() + 120
        while "serving" not in (self.tmp / "store.out").read_text():
            if self.procs["store"].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the store on {store_node} did not start:\n{self.stderr('store')}")
            time.sleep(0.1)

    def start_sync(self, model: str, readers: int, trainers: int, versions: tuple[int, ...]) -> None:
        """Start inference ranks `inf0..` (into vLLM models of `model`, verifying) and trainer ranks `tr0..` (with digests,
        waiting for the readers) syncing `versions`."""
        listed = ",".join(map(str, versions))
        for k in range(readers):
            self.start(f"inf{k}", "inference", k, "--versions", listed, "--model", model, "--verify", "--timeout", "60")
        for r in range(trainers):
            self.start(f"tr{r}", "trainer", r, "--versions", listed, "--digests", "--wait-joined", "--timeout", "60")

    def synced(self, readers: int, trainers: int, version: int) -> tuple[list[dict], list[dict]]:
        """The `synced` events of inference ranks `inf0..` and `released` events of trainers `tr0..` for `version`, each
        checked: the version reported, digests equal to vLLM's load, nothing failed or timed out."""
        synced = [self.event(f"inf{k}", "synced", version) for k in range(readers)]
        for e in synced:
            assert e["reported"] == version
            assert e["digests"] > 0 and e["n_differ"] == 0, e["differ"]
        released = [self.event(f"tr{r}", "released", version) for r in range(trainers)]
        for e in released:
            assert e["timed_out"] == [] and e["failed"] == [], e
        return synced, released

    def start(self, key: str, role: str, rank: int, *args: str, node: str | None = None) -> None:
        """Start worker `key`; with a cluster, on `node` (gated by files in `self.gates`)."""
        gates = () if self.cluster is None else ("--gate-dir", str(self.gates))
        if self.cluster is not None and role == "inference" and "--device-ipc" not in args:
            # Emulated nodes share one kernel: a reader would open its trainers' memory directly (process_vm_readv) and
            # no byte would cross the emulated links.
            gates += ("--device-ipc", "off")
        self._spawn(key, [sys.executable, "-m", "weightplan.testing.runtime_worker", role, "--plan", str(self.plan), "--rank", str(rank),
                          "--address", self.address, "--job", self.name, *gates, *args], node)

    def start_module(self, key: str, module: str, *args: str) -> None:
        """Start worker `key` running `python -m module args` (another worker than runtime_worker), on this host, in the
        current directory (so a module of the repository's tests resolves when pytest runs from the root)."""
        self._spawn(key, [sys.executable, "-m", module, *args], None)

    def _spawn(self, key: str, cmd: list[str], node: str | None) -> None:
        out = open(self.tmp / f"{key}.out", "w")
        err = open(self.tmp / f"{key}.err", "w")
        if self.cluster is None:
            self.procs[key] = subprocess.Popen(cmd, stdout=out, stderr=err)
        else:
            self.procs[key] = self.cluster.popen(node, cmd, stdout=out, stderr=err, env=self.env)

    def go(self, version: int) -> None:
        self._open_gate("go", version)

    def resume(self, version: int) -> None:
        self._open_gate("resume", version)

    def start_readers(self) -> None:
        """Let inference workers started with --start-gate start their Receiver."""
        self._open_gate("start", 0)

    def release(self, version: int) -> None:
        """Let trainers started with --hold-last release `version`, their last."""
        self._open_gate("release", version)

    def _open_gate(self, kind: str, version: int) -> None:
        """A store key the gated workers wait for; on an emulated cluster (whose store the test does not reach), a file."""
        if self.rendezvous is not None:
            self.rendezvous.put(f"test/{kind}/{version}", b"1")
        else:
            (self.gates / f"{kind}-{version}").touch()

    def kill(self, key: str) -> None:
        """SIGKILL a worker: no cleanup, no goodbye to its peers."""
        self.procs[key].kill()
        self.procs[key].wait()

    def events(self, key: str) -> list[dict]:
        lines = (self.tmp / f"{key}.out").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def event(self, key: str, kind: str | tuple[str, ...], version: int | None = None, timeout: float = 240.0,
              job: str | None = None) -> dict:
        """Wait for the worker's first event of `kind` (or of any kind in a tuple; for `version`, of case `job`); fail
        with its stderr if it exits first."""
        kinds = (kind,) if isinstance(kind, str) else kind
        deadline = time.monotonic() + timeout

        def wanted(e: dict) -> bool:
            return e["event"] in kinds and version in (None, e.get("version")) and job in (None, e.get("job"))

        while time.monotonic() < deadline:
            for e in self.events(key):
                if wanted(e):
                    return e
            if self.procs[key].poll() is not None:
                for e in self.events(key):  # it may have printed the event just before exiting
                    if wanted(e):
                        return e
                raise AssertionError(f"{key} exited ({self.procs[key].returncode}) before {kind} v{version}:\n{self.stderr(key)}")
            time.sleep(0.1)
        raise AssertionError(f"{key}: no {kind} v{version} within {timeout} s:\n{self.stderr(key)}")

    def assert_fanout_syncs(self, cases: dict[str, Path | str], versions: tuple[int, ...], readers: int, trainers: int,
                            timeout: float = 240.0) -> None:
        """Every reader synced every version of every case (job name -> plan) with vLLM's digests, reading its
        second hops whole from its node's pullers, and every trainer's release saw every reader acknowledge."""
        for case, path in cases.items():
            plan = load_plan(path)
            for version in versions:
                for k in range(readers):
                    e = self.event(f"inf{k}", "synced", version, job=case, timeout=timeout)
                    assert e["reported"] == version and e["n_differ"] == 0, e
                    hop = sum(plan.dests[d].nbytes for ds in second_hops(plan, k).values() for d in ds)
                    assert e["second_hop_bytes"] == hop > 0
                for r in range(trainers):
                    released = self.event(f"tr{r}", "released", version, job=case, timeout=timeout)
                    assert released["timed_out"] == [] and released["failed"] == []

    def stderr(self, key: str) -> str:
        return "\n".join((self.tmp / f"{key}.err").read_text().splitlines()[-30:])

    def wait(self, key: str, timeout: float = 240.0) -> int:
        try:
            return self.procs[key].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{key} still running after {timeout} s:\n{self.stderr(key)}") from None

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def assert_clean_exit(self, *keys: str) -> None:
        """The given workers (default: all) exit with status 0."""
        for key in keys or tuple(self.procs):
            assert self.wait(key) == 0, self.stderr(key)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
