"""Metadata exchange between senders and receivers through a torch.distributed TCPStore, namespaced by job id.

Values are JSON or raw NIXL agent metadata; nothing read from the store is unpickled or evaluated.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta

from .errors import SyncError, WeightplanError

DEFAULT_ADDRESS = "127.0.0.1:29577"
_JOB = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def trainer_agent(job: str, rank: int) -> str:
    """The NIXL agent name of trainer `rank` in `job`."""
    return f"{job}.trainer.{rank}"


def inference_agent(job: str, rank: int) -> str:
    """The NIXL agent name of inference `rank` in `job`."""
    return f"{job}.inference.{rank}"


def check_job(job: str) -> str:
    if not isinstance(job, str) or not _JOB.match(job):
        raise WeightplanError(f"job id {job!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
    return job


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise WeightplanError(f"rendezvous address {address!r} must be HOST:PORT, e.g. {DEFAULT_ADDRESS} (port 0: any free port, when serving)")
    return host, int(port)


class Rendezvous:
    """The job's keys in a shared store: every key is prefixed `weightplan/<job>/`."""

    def __init__(self, store, job: str):
        self.store = store
        self.job = check_job(job)

    @classmethod
    def connect(cls, job: str, address: str = DEFAULT_ADDRESS, *, serve: bool = False, timeout: float = 60.0) -> "Rendezvous":
        """Connect to (or with `serve`, host) the TCPStore at `address`; loopback by default."""
        from torch.distributed import TCPStore

        host, port = parse_address(address)
        store = TCPStore(host, port, is_master=serve, wait_for_workers=False, timeout=timedelta(seconds=timeout))
        return cls(store, job)

    @property
    def address(self) -> str:
        """HOST:PORT of the store, with the port it actually listens on."""
        return f"{self.store.host}:{self.store.port}"

    def _key(self, key: str) -> str:
        return f"weightplan/{self.job}/{key}"

    def put(self, key: str, value: bytes | dict) -> None:
        self.store.set(self._key(key), value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode())

    def exists(self, key: str) -> bool:
        return self.store.check([self._key(key)])

    def wait(self, keys: list[str], timeout: float, what: str) -> None:
        try:
            self.store.wait([self._key(k) for k in keys], timedelta(seconds=max(timeout, 0.001)))
        except Exception as exc:  # TCPStore raises DistStoreError on timeout, DistNetworkError when the store is gone
            if "Network" in type(exc).__name__:
                raise SyncError(f"{what}: lost the rendezvous store ({type(exc).__name__}); is its host process alive?") from None
            raise SyncError(f"{what}: not published within {timeout:.1f} s") from None

    def get_bytes(self, key: str) -> bytes:
        return self.store.get(self._key(key))

    def get_json(self, key: str) -> dict:
        raw = self.get_bytes(key)
        try:
            value = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise SyncError(f"rendezvous key {key!r} holds malformed JSON; another program may share job id {self.job!r}") from None
        if not isinstance(value, dict):
            raise SyncError(f"rendezvous key {key!r} holds {type(value).__name__}, expected an object")
        return value
