"""Start trainer and inference processes for runtime tests around a rendezvous store hosted by the test."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from weightplan.runtime import Rendezvous

ROOT = Path(__file__).resolve().parent.parent


class Job:
    """One sync job: a store on a free loopback port and the worker processes of `tests.runtime_worker`."""

    def __init__(self, tmp_path: Path, plan: Path | str, name: str):
        """`plan` and `name` may list several comma-separated cases (see tests/runtime_worker.py)."""
        self.tmp, self.plan, self.name = tmp_path, plan, name
        self.rendezvous = Rendezvous.connect(name.split(",")[0], "127.0.0.1:0", serve=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, key: str, role: str, rank: int, *args: str) -> None:
        out = open(self.tmp / f"{key}.out", "w")
        err = open(self.tmp / f"{key}.err", "w")
        cmd = [sys.executable, "-m", "tests.runtime_worker", role, "--plan", str(self.plan), "--rank", str(rank),
               "--address", self.rendezvous.address, "--job", self.name, *args]
        self.procs[key] = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err)

    def go(self, version: int) -> None:
        self.rendezvous.put(f"test/go/{version}", b"1")

    def resume(self, version: int) -> None:
        self.rendezvous.put(f"test/resume/{version}", b"1")

    def kill(self, key: str) -> None:
        """SIGKILL a worker: no cleanup, no goodbye to its peers."""
        self.procs[key].kill()
        self.procs[key].wait()

    def events(self, key: str) -> list[dict]:
        lines = (self.tmp / f"{key}.out").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def event(self, key: str, kind: str, version: int | None = None, timeout: float = 240.0, job: str | None = None) -> dict:
        """Wait for the worker's event of `kind` (for `version`, of case `job`); fail with its stderr if it exits first."""
        deadline = time.monotonic() + timeout

        def wanted(e: dict) -> bool:
            return e["event"] == kind and version in (None, e.get("version")) and job in (None, e.get("job"))

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
