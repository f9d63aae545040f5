"""The rendezvous store on an etcd cluster: TCPStore's set/get/check/wait over etcd's v3 HTTP/JSON gateway, with failover."""

from __future__ import annotations

import base64
import http.client
import json
import logging
import re
import socket
import time
from datetime import timedelta

from ..errors import SyncError, WeightplanError

log = logging.getLogger("weightplan.rendezvous")

SCHEME = "etcd://"
# The most one request to one member may take before the next member is tried, in the first round over the members; it
# doubles every round. A member whose leader just died holds a write until etcd's own request timeout (~5 s): the
# next member answers sooner. A slow but healthy cluster still gets longer rounds.
ATTEMPT_S = (1.0, 8.0)
_BACKOFF_S = (0.005, 0.25)  # first and longest pause between polls of `wait`, and between rounds of failed members
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\]")
# gRPC codes etcd answers while a member cannot serve (no leader, an election, a deadline): another member may
_RETRYABLE = {4: "deadline exceeded", 10: "aborted", 14: "unavailable"}
# The most of an answer read: a record is at most etcd's request limit (1.5 MiB by default, as base64 in JSON); a
# member, or whatever listens at its address, that sends more is refused rather than read into memory.
MAX_ANSWER_BYTES = 16 << 20


def is_etcd(address) -> bool:
    return isinstance(address, str) and address.startswith(SCHEME)


def parse_endpoints(address: str) -> tuple[tuple[str, int], ...]:
    """The (host, port) members of an `etcd://h1:2379,h2:2379` address, in order; WeightplanError naming what is wrong."""
    example = "e.g. etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    if not is_etcd(address):
        raise WeightplanError(f"etcd rendezvous address {address!r} must start with {SCHEME} ({example})")
    listed = address[len(SCHEME):].rstrip("/")
    if not listed:
        raise WeightplanError(f"etcd rendezvous address {address!r} names no member ({example})")
    endpoints = []
    for part in listed.split(","):
        host, sep, port = part.strip().rpartition(":")
        if (not sep or not _HOST.fullmatch(host) or not (port.isascii() and port.isdigit())
                or not 0 < int(port) < 65536):
            raise WeightplanError(f"etcd rendezvous address {address!r}: member {part.strip()[:60]!r} is not HOST:PORT "
                                  f"with a port in 1-65535 ({example})")
        if (host.strip("[]"), int(port)) in endpoints:
            raise WeightplanError(f"etcd rendezvous address {address!r} lists member {part.strip()!r} twice")
        endpoints.append((host.strip("[]"), int(port)))
    return tuple(endpoints)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _seconds(timeout) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class EtcdStore:
    """A client of the etcd cluster at `address` with the four calls Rendezvous makes of a TCPStore.

    Each call goes to the member that answered last; a member that refuses, does not answer within ATTEMPT_S (1 s, then
    doubling every round) or says it cannot serve (no leader) makes the call go on to the next, round after round until
    the call's timeout: then one SyncError names every member tried and why. `wait` polls with a backoff (up to 0.25 s). The cluster's id is
    checked on every answer, so a cluster recreated under the job (its records gone) is one SyncError, not a hang.
    Nothing is kept but the member index and the cluster id: it is safe to call from several threads.
    """

    def __init__(self, address: str, timeout: float):
        self.endpoints = parse_endpoints(address)
        self.address = SCHEME + ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        self.timeout = timeout
        self._current = 0
        self.cluster_id: str | None = None
        self._lost: str | None = None  # set once a member answered for another cluster: every later call raises it

    @property
    def host(self) -> str:
        """The member calls go to now (the last that answered)."""
        return self.endpoints[self._current][0]

    @property
    def port(self) -> int:
        return self.endpoints[self._current][1]

    def set(self, key: str, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        self._request("/v3/kv/put", {"key": _b64(key.encode()), "value": _b64(raw)}, key, len(raw))

    def get(self, key: str) -> bytes:
        """The value at `key`, waiting up to the store's timeout for it to be set (as TCPStore's get does)."""
        found = self._range(key, time.monotonic() + self.timeout)
        if found is None:
            self.wait([key])
            found = self._range(key, time.monotonic() + self.timeout)
        if found is None:
            raise KeyError(f"etcd key {key!r} was deleted")
        return found

    def check(self, keys: list[str]) -> bool:
        deadline = time.monotonic() + self.timeout
        return all(self._range(key, deadline, count_only=True) is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Return once every key is set; TimeoutError after `timeout` (default: the store's), SyncError when no member
        answered a poll within it."""
        limit = self.timeout if timeout is None else _seconds(timeout)
        deadline, pause = time.monotonic() + limit, _BACKOFF_S[0]
        missing = list(keys)
        while True:
            # a poll begun just before the deadline still gets a moment to be answered
            polled = max(deadline, time.monotonic() + 0.5)
            missing = [k for k in missing if self._range(k, polled, count_only=True) is None]
            if not missing:
                return
            if time.monotonic() + pause >= deadline:
                raise TimeoutError(f"etcd keys {missing[:3]} not set within {limit:g} s")
            time.sleep(pause)
            pause = min(pause * 2, _BACKOFF_S[1])

    def _range(self, key: str, deadline: float, count_only: bool = False) -> bytes | None:
        """The value at `key` (b"" with count_only), None when it is not set."""
        body = {"key": _b64(key.encode()), **({"count_only": True} if count_only else {})}
        answer = self._request("/v3/kv/range", body, key, 0, deadline)
        if count_only:
            return b"" if int(answer.get("count", 0)) else None
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        try:
            return base64.b64decode(kvs[0].get("value", ""), validate=True)
        except (ValueError, TypeError):
            raise SyncError(f"etcd rendezvous {self.address}: key {key!r} came back with a malformed value") from None

    def _request(self, path: str, body: dict, key: str, nbytes: int, deadline: float | None = None) -> dict:
        """POST `body` to `path` of a member that serves it; the JSON answer. Members are tried in turn from the current
        one, round after round with a backoff, until `deadline` (default: now + the store's timeout)."""
        if self._lost is not None:
            raise SyncError(self._lost)
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        payload = json.dumps(body).encode()
        tried: dict[str, str] = {}
        pause, attempt = _BACKOFF_S[0], ATTEMPT_S[0]
        while True:
            for step in range(len(self.endpoints)):
                index = (self._current + step) % len(self.endpoints)
                host, port = self.endpoints[index]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                why = self._post(host, port, path, payload, min(remaining, attempt))
                if isinstance(why, dict):
                    if index != self._current:
                        log.info("etcd rendezvous %s: member %s:%d answers, after %s", self.address, host, port,
                                 "; ".join(f"{m}: {w}" for m, w in tried.items()))
                    self._current = index
                    self._check_cluster(why, host, port)
                    return why
                if why.startswith("refused: "):  # the request itself is wrong: no member will take it
                    self._refused(why[len("refused: "):], key, nbytes, host, port)
                tried[f"{host}:{port}"] = why
            if time.monotonic() + pause >= deadline:
                listed = "; ".join(f"{m}: {w}" for m, w in tried.items()) or "no time left to try one"
                raise SyncError(f"etcd rendezvous {self.address}: no member answered {path} for key {key!r} within "
                                f"the timeout ({listed})")
            time.sleep(pause)
            pause, attempt = min(pause * 2, _BACKOFF_S[1]), min(attempt * 2, ATTEMPT_S[1])

    def _post(self, host: str, port: int, path: str, payload: bytes, timeout: float) -> dict | str:
        """The member's JSON answer, or why it gave none ("refused: ..." when it refused the request as such)."""
        connection = http.client.HTTPConnection(host, port, timeout=max(timeout, 0.001))
        try:
            connection.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            status, text = response.status, response.read(MAX_ANSWER_BYTES + 1)
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, (socket.timeout, TimeoutError)):
                return f"no answer within {timeout:.1f} s"
            return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        finally:
            connection.close()
        if len(text) > MAX_ANSWER_BYTES:
            return f"refused: an answer of more than {MAX_ANSWER_BYTES >> 20} MiB (HTTP {status}), not etcd's"
        try:
            answer = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            answer = None
        if not isinstance(answer, dict):
            return f"HTTP {status}, not etcd's JSON gateway (is this an etcd v3.4+ client port?)"
        if status == 200 and "error" not in answer:
            return answer
        code, message = answer.get("code"), str(answer.get("message") or answer.get("error") or "")[:200]
        if status >= 500 or code in _RETRYABLE:
            return f"{message or _RETRYABLE.get(code, 'error')} (HTTP {status})"
        return f"refused: {message or 'HTTP ' + str(status)}"

    def _refused(self, message: str, key: str, nbytes: int, host: str, port: int) -> None:
        if "too large" in message:
            raise WeightplanError(f"etcd rendezvous {self.address}: member {host}:{port} refused key {key!r} of {nbytes} "
                                  f"bytes ({message}); start etcd with a larger --max-request-bytes (default 1.5 MiB)")
        raise WeightplanError(f"etcd rendezvous {self.address}: member {host}:{port} refused a request for key {key!r}: "
                              f"{message}")

    def _check_cluster(self, answer: dict, host: str, port: int) -> None:
        cluster = (answer.get("header") or {}).get("cluster_id")
        if cluster is None:
            return
        if self.cluster_id is None:
            self.cluster_id = str(cluster)
        elif str(cluster) != self.cluster_id:
            self._lost = (f"etcd rendezvous {self.address}: member {host}:{port} is of cluster {cluster}, not cluster "
                            f"{self.cluster_id} this process first reached (a cluster recreated, or another one, holds "
                            "none of the job's records): restart every trainer and inference process of the job")
            raise SyncError(self._lost)
