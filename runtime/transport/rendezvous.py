"""Metadata exchange between senders and receivers through a torch.distributed TCPStore or an etcd cluster, namespaced by job id.

Values are JSON or raw NIXL agent metadata; nothing read from the store is unpickled or evaluated.
With a job secret every record is authenticated (HMAC-SHA256 over the record's key and value), so
a process that can reach the store but lacks the secret cannot publish as a trainer or a reader.
Without one, the store may only be reached on loopback (or with `insecure=True`). See
docs/runtime.md, "Threat model".
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

from ..errors import SyncError, WeightplanError
from .etcd_store import EtcdStore, is_etcd, parse_endpoints
from .protocol import PROTOCOL_VERSION, store_key

log = logging.getLogger("weightplan.rendezvous")

DEFAULT_ADDRESS = "127.0.0.1:29577"
_JOB = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SECRET_ENV = "WEIGHTPLAN_SECRET"
SECRET_FILE_ENV = "WEIGHTPLAN_SECRET_FILE"
MIN_SECRET_BYTES = 16
# record tags: HMAC-signed, or plain (a job without a secret)
_SIGNED, _PLAIN = f"wp{PROTOCOL_VERSION}s".encode(), f"wp{PROTOCOL_VERSION}p".encode()
_MAC_BYTES = 32
STORE_MARGIN = 2.0  # seconds a store call may take beyond its own timeout before the caller gives up on it
SIGNED_JOB = "signed-job"  # a plain key a secured process sets, for the hint in Rendezvous.wait
_STORE_ID = re.compile(r"[0-9a-f]{32}")


def check_job(job: str) -> str:
    if not isinstance(job, str) or not _JOB.fullmatch(job):
        raise WeightplanError(f"job id {job!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
    return job


def parse_address(address: str) -> tuple[str, int]:
    if not isinstance(address, str):
        raise WeightplanError(f"rendezvous address must be a HOST:PORT string, got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise WeightplanError(f"rendezvous address {address!r} must be HOST:PORT, e.g. {DEFAULT_ADDRESS} (port 0: any free port, when serving)")
    return host.strip("[]"), int(port)


def check_address(address: str) -> str:
    """A rendezvous address, HOST:PORT of a TCPStore or `etcd://h1:2379,h2:2379`; WeightplanError naming what is wrong."""
    if is_etcd(address):
        parse_endpoints(address)
    else:
        parse_address(address)
    return address


def job_secret(secret: bytes | str | None = None) -> bytes | None:
    """The job's secret: `secret`, else the file named by WEIGHTPLAN_SECRET_FILE (mode 0600), else WEIGHTPLAN_SECRET."""
    if secret is None and os.environ.get(SECRET_FILE_ENV):
        secret = _read_secret_file(Path(os.environ[SECRET_FILE_ENV]))
    elif secret is None and os.environ.get(SECRET_ENV):
        secret = os.environ[SECRET_ENV]
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or len(secret.strip()) < MIN_SECRET_BYTES:
        raise WeightplanError(f"the job secret must be at least {MIN_SECRET_BYTES} bytes (e.g. `openssl rand -hex 32`)")
    return secret.strip()


def _read_secret_file(path: Path) -> bytes:
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise WeightplanError(f"{SECRET_FILE_ENV}={path} is not a regular file")
        if info.st_mode & 0o077:
            raise WeightplanError(f"{SECRET_FILE_ENV}={path} is readable by others (mode {stat.S_IMODE(info.st_mode):04o}); "
                                  f"run `chmod 600 {path}`")
        return path.read_bytes()
    except OSError as exc:
        raise WeightplanError(f"cannot read the job secret {SECRET_FILE_ENV}={path}: {exc.strerror}") from None


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


class Rendezvous:
    """The job's keys in a shared store: every key is prefixed `weightplan/<job>/`; records signed with the job secret."""

    def __init__(self, store, job: str, secret: bytes | None = None, timeout: float = 60.0, reconnect=None):
        self.store = store
        self.job = check_job(job)
        self._secret = secret
        self._timeout = timeout
        self._reconnect = reconnect  # () -> a new client of the same store; None for the process serving it
        self.store_id: str | None = None  # the store's identity (protocol.store_key) when this client connected
        self._lost: str | None = None  # set once the store turned out restarted: every later call raises it

    def _call(self, what: str, op, timeout: float | None = None, retried: bool = False, reach: float | None = None):
        """`op(store)` on the store, answered within `timeout` (default: the store's) plus a margin, else SyncError.
        `reach`: how long a new client may wait for the store to accept it (default: the store's timeout).

        TCPStore's client can block without bound once its server is unreachable (a `wait` that timed
        out waits, with no timeout, for the answer to its cancellation), so each call runs in a thread
        this one stops waiting for. A client left blocked there, or whose connection broke, is dropped: a
        new one connects, if the store is reachable again, and first checks that it is the same store
        (a restarted store lost every record of the job: one SyncError saying what to restart).
        """
        if self._lost is not None:
            raise SyncError(self._lost)
        fresh = self.store is None
        if fresh:
            self.store = self._new_client(what, reach)
        store, result, done = self.store, [], threading.Event()

        def run() -> None:
            try:
                if fresh:
                    self._check_same_store(store)
                result.append((True, op(store)))
            except BaseException as exc:  # handed to the caller below
                result.append((False, exc))
            done.set()

        threading.Thread(target=run, name=f"weightplan-store-{what}", daemon=True).start()
        limit = (self._timeout if timeout is None else timeout) + STORE_MARGIN
        if not done.wait(limit):
            if self._reconnect is not None:
                self.store = None  # that client is blocked mid-request; the next call connects a new one
            raise SyncError(f"{what}: the rendezvous store did not answer within {limit:.1f} s; is its host reachable?")
        ok, value = result[0]
        if not ok and self._reconnect is not None and "Network" in type(value).__name__:
            self.store = None  # its connection broke (a link cut, the server gone or restarted): the next call reconnects
            if not retried and _accepts(store.host, store.port):  # a server is there again: once more, on a new client
                return self._call(what, op, timeout, retried=True, reach=reach)
        if not ok:
            raise value
        return value

    def _check_same_store(self, store) -> None:
        """SyncError (kept for every later call) when a new client's store is not the one this process connected to."""
        if self.store_id is None:
            return
        key = store_key()
        found = store.get(self._key(key)) if store.check([self._key(key)]) else None
        try:
            same = found is not None and self._open(key, found) == self.store_id.encode()
        except SyncError:
            same = False
        if not same:
            host, port = store.host, store.port
            self._lost = (f"the rendezvous store at {host}:{port} was restarted and lost the records of job {self.job!r} "
                          "(trainer infos, agent metadata, joins): restart every trainer and inference process of the job")
            raise SyncError(self._lost)

    def _new_client(self, what: str, reach: float | None = None):
        try:
            return self._reconnect() if reach is None else self._reconnect(reach)
        except Exception as exc:  # WeightplanError from _wait_reachable, DistNetworkError from TCPStore
            raise SyncError(f"{what}: cannot reach the rendezvous store again ({exc})") from None

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    @classmethod
    def connect(cls, job: str, address: str = DEFAULT_ADDRESS, *, serve: bool = False, timeout: float = 60.0,
                secret: bytes | str | None = None, insecure: bool = False) -> "Rendezvous":
        """Connect to (or with `serve`, host) the TCPStore at `address`, or to the etcd cluster of an
        `etcd://h1:2379,h2:2379` address (run by the user: `serve` is ignored, with a log line).

        A served store listens only on `address`'s host (loopback by default). A store off
        loopback needs a job secret (`secret`, WEIGHTPLAN_SECRET_FILE or WEIGHTPLAN_SECRET),
        unless `insecure=True`, which is logged.
        """
        check_job(job)
        etcd = is_etcd(address)
        endpoints = parse_endpoints(address) if etcd else (parse_address(address),)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise WeightplanError(f"rendezvous timeout must be a number of seconds in (0, 86400], got {timeout!r}")
        key = job_secret(secret)
        if key is None and not all(is_loopback(host) for host, _ in endpoints):
            if not insecure:
                raise WeightplanError(f"rendezvous store {address} is not on loopback and this job has no secret: set "
                                      f"{SECRET_FILE_ENV} (a 0600 file) or {SECRET_ENV} on every process of the job, or "
                                      "pass insecure=True if every host that can reach it is trusted")
            log.warning("weightplan job %s: rendezvous store %s off loopback without a job secret (insecure=True): any "
                        "process that reaches it can publish as a trainer", job, address)
        if etcd:
            return cls._connect_etcd(job, address, serve, timeout, key)
        from torch.distributed import TCPStore

        host, port = endpoints[0]
        listener = _listen(host, port) if serve else None
        if not serve:
            _wait_reachable(host, port, timeout, address)
        try:
            store = TCPStore(host, listener.getsockname()[1] if listener else port, is_master=serve, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout), master_listen_fd=listener.fileno() if listener else None)
        except Exception as exc:  # DistNetworkError / RuntimeError, with C++ frames after the first line
            if listener is not None:
                listener.close()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise WeightplanError(f"cannot {'serve' if serve else 'reach'} the rendezvous store at {address} "
                                  f"within {timeout:g} s: {first}") from None
        def reconnect(reach: float = timeout):
            _wait_reachable(host, port, reach, address)
            return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout))

        rendezvous = cls(store, job, key, timeout, None if serve else reconnect)
        if listener is not None:
            listener.detach()  # the store's event loop owns the descriptor now; a second close could hit a reused fd
        if key is not None:  # tells a process started without the secret why it finds nothing (`wait`)
            rendezvous._call("marking the job as signed", lambda client: client.set(rendezvous._plain(SIGNED_JOB), b"1"))
        if serve:
            rendezvous.store_id = uuid.uuid4().hex
            rendezvous.put(store_key(), rendezvous.store_id.encode())
        elif rendezvous.exists(store_key()):  # absent: a store served by something else, never checked
            rendezvous.store_id = rendezvous.get_text(store_key(), _STORE_ID)
        return rendezvous

    @classmethod
    def _connect_etcd(cls, job: str, address: str, serve: bool, timeout: float, key: bytes | None) -> "Rendezvous":
        """A client of the etcd cluster at `address`, once a member answered within `timeout` (WeightplanError naming
        every member tried otherwise). Its identity is etcd's cluster id, checked on every answer (etcd_store.py)."""
        if serve:
            log.info("weightplan job %s: the rendezvous is the etcd cluster %s, which its users run: nothing to serve",
                     job, address)
        store = EtcdStore(address, timeout)
        rendezvous = cls(store, job, key, timeout)
        try:
            store.check([rendezvous._plain(SIGNED_JOB)])
        except SyncError as exc:
            raise WeightplanError(f"cannot reach the rendezvous store {address} within {timeout:g} s: "
                                  f"{str(exc).split(' within the timeout ', 1)[-1]}") from None
        if key is not None:
            rendezvous._call("marking the job as signed", lambda client: client.set(rendezvous._plain(SIGNED_JOB), b"1"))
        return rendezvous

    @property
    def address(self) -> str:
        """The store's address: HOST:PORT, with the port it actually listens on, or an etcd:// address."""
        store = self.store or self._new_client("the store's address")
        return store.address if isinstance(store, EtcdStore) else f"{store.host}:{store.port}"

    def local_host(self) -> str | None:
        """This process's address toward the store: the interface its traffic to the store leaves by (what a peer on
        the store's network reaches it at); None where the route cannot be found. Sends nothing."""
        store = self.store or self._new_client("the store's address")
        host, port = store.host, store.port  # with etcd, the member this process talks to now
        try:
            family, kind, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, kind) as probe:
                probe.connect(target)  # a UDP connect only picks the route
                return probe.getsockname()[0]
        except OSError:
            return None

    def _key(self, key: str) -> str:
        """The store key of protocol key `key`: with a job secret, a name derived from it.

        TCPStore lets any client overwrite or delete any key it can name. Under names only holders of the
        secret can derive, a process without it cannot replace a record the job reads (a forged trainer
        info, a junk joined record): it can only write names nobody reads (`wait` reports them).
        """
        if self._secret is None:
            return self._plain(key)
        name = hmac.new(self._secret, f"weightplan-key-v{PROTOCOL_VERSION}\0{self.job}\0{key}".encode(), hashlib.sha256)
        return f"weightplan/{self.job}/signed/{name.hexdigest()[:40]}"

    def _plain(self, key: str) -> str:
        return f"weightplan/{self.job}/{key}"

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, f"weightplan-rendezvous-v{PROTOCOL_VERSION}\0{self._key(key)}\0".encode() + value,
                        hashlib.sha256).digest()

    def put(self, key: str, value: bytes | dict, timeout: float | None = None) -> None:
        """Write `key`; `timeout` bounds the write, reconnecting included (default: the store's timeout)."""
        raw = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
        record = _SIGNED + self._mac(key, raw) + raw if self._secret is not None else _PLAIN + raw
        try:
            self._call(f"rendezvous key {key!r}", lambda store: store.set(self._key(key), record), timeout, reach=timeout)
        except SyncError:
            raise
        except Exception as exc:  # DistNetworkError / DistStoreError when the store's host is gone or unreachable
            raise SyncError(f"rendezvous key {key!r}: cannot write it ({type(exc).__name__}); is the store's host "
                            "reachable?") from None

    def exists(self, key: str) -> bool:
        """Whether `key` holds a record this job wrote (a forged or malformed one counts as absent, and is logged)."""
        try:
            if not self._call(f"rendezvous key {key!r}", lambda store: store.check([self._key(key)])):
                return False
        except SyncError:
            raise
        except Exception as exc:  # as in put()
            raise SyncError(f"rendezvous key {key!r}: cannot check it ({type(exc).__name__})") from None
        try:
            self.get_bytes(key)
        except SyncError as exc:
            log.warning("weightplan job %s: ignoring %s", self.job, exc)
            return False
        return True

    def wait(self, keys: list[str], timeout: float, what: str) -> None:
        try:
            self._call(what, lambda store: store.wait([self._key(k) for k in keys], timedelta(seconds=max(timeout, 0.001))),
                       timeout=max(timeout, 0.001))
        except SyncError:
            raise
        except Exception as exc:  # TCPStore raises DistStoreError on timeout, DistNetworkError when the store is gone
            if "Network" in type(exc).__name__:
                raise SyncError(f"{what}: lost the rendezvous store ({type(exc).__name__}); is its host process alive?") from None
            raise SyncError(f"{what}: not published within {timeout:.1f} s{self._why_missing(keys)}") from None

    def _why_missing(self, keys: list[str]) -> str:
        """What the store holds instead of `keys` that a process of another secret setting wrote, as a hint."""
        def present(key: str) -> bool:
            return self._call("a hint", lambda store: store.check([key]), timeout=min(self._timeout, 1.0))

        try:
            if self._secret is None:
                if present(self._plain(SIGNED_JOB)):
                    return (f"; job {self.job!r} signs its records with a job secret this process does not have: set "
                            f"{SECRET_FILE_ENV} or {SECRET_ENV} as on its other processes")
                return ""
            unsigned = [k for k in keys if present(self._plain(k))]
        except Exception:  # the hint is best effort; the timeout is the error
            return ""
        if unsigned:
            log.warning("weightplan job %s: ignored %s, written without this job's secret", self.job, ", ".join(unsigned))
            return f"; ignored {unsigned[0]!r} written by a process without this job's secret"
        return ""

    def get_bytes(self, key: str) -> bytes:
        """The value at `key`, once its record authenticates; SyncError naming the key otherwise."""
        try:
            record = self._call(f"rendezvous key {key!r}", lambda store: store.get(self._key(key)))
        except SyncError:
            raise
        except Exception as exc:
            raise SyncError(f"rendezvous key {key!r}: cannot read it ({type(exc).__name__})") from None
        return self._open(key, record)

    def _open(self, key: str, record: bytes) -> bytes:
        """The value of a stored `record` of `key` once it authenticates; SyncError naming the key otherwise."""
        tag = record[:4]
        if self._secret is None:
            if tag == _SIGNED:
                raise SyncError(f"rendezvous key {key!r} is signed with a job secret this process does not have; "
                                f"set {SECRET_FILE_ENV} or {SECRET_ENV} as on the other processes of job {self.job!r}")
            if tag != _PLAIN:
                raise SyncError(f"rendezvous key {key!r} is not a weightplan record; another program may share job id {self.job!r}")
            return record[4:]
        value = record[4 + _MAC_BYTES:]
        if tag != _SIGNED or not hmac.compare_digest(record[4:4 + _MAC_BYTES], self._mac(key, value)):
            raise SyncError(f"rendezvous key {key!r} does not authenticate with this job's secret: written by a "
                            "process without it (an impostor, or a process started without the secret); refused")
        return value

    def get_text(self, key: str, pattern: re.Pattern | None = None) -> str:
        """The value at `key` as ASCII text (matching `pattern` in full, if given); SyncError naming the key otherwise."""
        raw = self.get_bytes(key)
        text = raw.decode("ascii", errors="replace")
        if not raw.isascii() or (pattern is not None and not pattern.fullmatch(text)):
            raise SyncError(f"rendezvous key {key!r} holds {raw[:40]!r}, not the value this key should hold")
        return text

    def get_json(self, key: str) -> dict:
        raw = self.get_bytes(key)
        try:
            value = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise SyncError(f"rendezvous key {key!r} holds malformed JSON; another program may share job id {self.job!r}") from None
        if not isinstance(value, dict):
            raise SyncError(f"rendezvous key {key!r} holds {type(value).__name__}, expected an object")
        return value


def _accepts(host: str, port: int) -> bool:
    """Whether something accepts a connection at host:port within a second."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _wait_reachable(host: str, port: int, timeout: float, address: str) -> None:
    """Wait until something accepts connections at host:port, within `timeout` (TCPStore's own retries overshoot it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.05, min(1.0, deadline - time.monotonic()))).close()
            return
        except OSError as exc:
            if time.monotonic() + 0.1 >= deadline:
                raise WeightplanError(f"cannot reach the rendezvous store at {address} within {timeout:g} s: "
                                      f"{exc.strerror or exc}") from None
            time.sleep(0.1)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket bound to `host` only (TCPStore alone would listen on every interface)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, where = infos[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(1024)
    except OSError as exc:
        raise WeightplanError(f"cannot listen on {host}:{port} for the rendezvous store: {exc.strerror or exc}") from None
    listener.set_inheritable(False)
    return listener
