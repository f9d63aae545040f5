"""A rendezvous store restarted under a running job: every later call of a client is one SyncError saying what to restart."""

from __future__ import annotations

import gc
import socket

import pytest

from weightplan.runtime import Rendezvous, SyncError
from weightplan.runtime.transport import protocol
from weightplan.runtime.transport.rendezvous import SECRET_ENV, SECRET_FILE_ENV


@pytest.fixture(autouse=True)
def no_secret_from_the_environment(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("secret", [None, "0123456789abcdef-test-secret"])
def test_a_store_restarted_under_the_job_is_one_sync_error_naming_what_to_restart(secret):
    address = f"127.0.0.1:{_free_port()}"
    server = Rendezvous.connect("restart", address, serve=True, timeout=3, secret=secret)
    client = Rendezvous.connect("restart", address, timeout=3, secret=secret)
    assert client.store_id == server.store_id and client.exists(protocol.store_key())
    client.put("probe", b"1")
    del server  # the store's process lost: its records with it
    gc.collect()
    server = Rendezvous.connect("restart", address, serve=True, timeout=3, secret=secret)  # a new store, same address
    message = r"store at 127\.0\.0\.1:\d+ was restarted and lost the records of job 'restart'.*restart every trainer and inference process"
    with pytest.raises(SyncError, match=message):
        for _ in range(3):  # the first write after the old server's exit may still land in the socket's buffer
            client.put("probe", b"2")
    with pytest.raises(SyncError, match=message):  # and so on, every later call: nothing waits on a store without the job
        client.exists("probe")
    assert server.store_id != client.store_id
