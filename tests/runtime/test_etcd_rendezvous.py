"""The rendezvous on etcd (etcd started by the test from the system's binary): signed records, bad addresses, a member
lost mid-run, and a trainer killed and restarted under a live receiver, taken at its next version."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from weightplan.runtime import Rendezvous, SyncError, WeightplanError
from weightplan.runtime.transport import protocol, serve_store
from weightplan.runtime.transport.etcd_store import EtcdStore, parse_endpoints
from weightplan.runtime.transport.rendezvous import SECRET_ENV
from weightplan.testing.runtime_harness import Job

from ..support.etcd import EtcdCluster, free_port

SECRET = "weightplan-etcd-test-secret-0123"


pytestmark = pytest.mark.usefixtures("no_job_secret_in_the_environment")


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster(tmp_path, 1)
    yield cluster
    cluster.close()


@pytest.fixture
def etcd3(tmp_path):
    cluster = EtcdCluster(tmp_path, 3)
    yield cluster
    cluster.close()


def test_records_round_trip_signed_and_a_forged_or_unsigned_one_is_refused(etcd, caplog):
    rendezvous = Rendezvous.connect("etcd-signed", etcd.address, timeout=5, secret=SECRET)
    assert rendezvous.address == etcd.address and rendezvous.authenticated
    rendezvous.put(protocol.trainer_info_key(0), {"answer": 42})
    assert rendezvous.exists(protocol.trainer_info_key(0))
    assert rendezvous.get_json(protocol.trainer_info_key(0)) == {"answer": 42}
    raw = EtcdStore(etcd.address, 5)  # the store as anyone who reaches etcd sees it
    stored = raw.get(rendezvous._key(protocol.trainer_info_key(0)))
    assert stored.startswith(b"wp1s") and stored.endswith(b'{"answer": 42}')  # tagged, MAC, value
    assert "trainer" not in rendezvous._key(protocol.trainer_info_key(0))  # key names derived from the secret

    forged = stored[:4] + bytes(32) + b'{"answer": 43}'  # the key's name is known to this forger, not the secret
    raw.set(rendezvous._key(protocol.trainer_info_key(0)), forged)
    assert not rendezvous.exists(protocol.trainer_info_key(0))
    with pytest.raises(SyncError, match="does not authenticate with this job's secret"):
        rendezvous.get_json(protocol.trainer_info_key(0))

    unsigned = Rendezvous.connect("etcd-signed", etcd.address, timeout=5)  # a process started without the secret
    unsigned.put(protocol.version_key(0, 1), b"0" * 32)
    with pytest.raises(SyncError, match="not published within .*written by a process without this job's secret"):
        rendezvous.wait([protocol.version_key(0, 1)], 0.5, "version 1")
    with pytest.raises(SyncError, match="signs its records with a job secret this process does not have"):
        unsigned.wait([protocol.trainer_info_key(0)], 0.5, "trainer info")


@pytest.mark.parametrize("address, why", [
    ("etcd://", "names no member"),
    ("etcd://127.0.0.1", "not HOST:PORT"),
    ("etcd://127.0.0.1:0", "port in 1-65535"),
    ("etcd://127.0.0.1:2379,127.0.0.1:70000", "port in 1-65535"),
    ("etcd://127.0.0.1:2379,,127.0.0.1:2380", "member '' is not HOST:PORT"),
    ("etcd://bad host:2379", "not HOST:PORT"),
    ("etcd://127.0.0.1:2379,127.0.0.1:2379", "lists member '127.0.0.1:2379' twice"),
])
def test_a_malformed_etcd_address_is_one_error_naming_it(address, why):
    with pytest.raises(WeightplanError, match=why):
        Rendezvous.connect("etcd-bad", address, timeout=1)


def test_an_etcd_address_off_loopback_needs_a_secret_as_the_tcp_store_does():
    with pytest.raises(WeightplanError, match="not on loopback and this job has no secret"):
        Rendezvous.connect("etcd-open", "etcd://127.0.0.1:2379,192.0.2.1:2379", timeout=1)


def test_an_etcd_address_that_does_not_answer_is_one_error_within_the_timeout():
    closed = [free_port(), free_port()]
    address = f"etcd://127.0.0.1:{closed[0]},127.0.0.1:{closed[1]}"
    began = time.monotonic()
    with pytest.raises(WeightplanError, match=rf"cannot reach the rendezvous store {address} within 1.5 s: .*"
                                              rf"127\.0\.0\.1:{closed[0]}: .*127\.0\.0\.1:{closed[1]}: ") as failed:
        Rendezvous.connect("etcd-none", address, timeout=1.5)
    assert time.monotonic() - began < 1.5 + 1.0
    assert "\n" not in str(failed.value)


@pytest.mark.parametrize("body, why", [
    (b"x" * (17 << 20), "an answer of more than 16 MiB"),
    (b"<html>not etcd</html>", "not etcd's JSON gateway"),
], ids=["oversized", "not-json"])
def test_something_else_at_the_etcd_address_is_one_error_and_an_oversized_answer_is_not_read(body, why):
    """Whatever listens at the address is not trusted: its answer is bounded and must be etcd's JSON."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = EtcdStore(f"etcd://127.0.0.1:{server.server_address[1]}", timeout=1.0)
        with pytest.raises(WeightplanError) as failed:  # SyncError is a WeightplanError
            store.set("k", b"v")
        assert why in str(failed.value) and "\n" not in str(failed.value)
    finally:
        server.shutdown()
        server.server_close()


def test_the_vllm_engines_init_info_takes_an_etcd_address_and_names_a_malformed_one():
    from weightplan.vllm_backend.init_info import InitInfoError, WeightplanInitInfo

    good = {"plan": "p.plan", "address": "etcd://127.0.0.1:2379,127.0.0.1:22379", "job": "j"}
    assert WeightplanInitInfo.from_dict(good).address == good["address"]
    with pytest.raises(InitInfoError, match="'address'.*member '127.0.0.1' is not HOST:PORT"):
        WeightplanInitInfo.from_dict({**good, "address": "etcd://127.0.0.1"})


def test_weightplan_store_hosts_the_tcp_store_outside_every_process_of_the_job(capsys):
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "weightplan.runtime.transport.serve_store", "--job", "outside",
                              "--address", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True)
    try:
        assert store.stdout.readline().strip() == f"weightplan-store: serving job 'outside' at 127.0.0.1:{port}"
        trainer = Rendezvous.connect("outside", f"127.0.0.1:{port}", timeout=5)
        trainer.put("probe", b"1")
        del trainer  # a trainer gone: its records stay with the store's process
        assert Rendezvous.connect("outside", f"127.0.0.1:{port}", timeout=5).get_bytes("probe") == b"1"
    finally:
        store.terminate()
        assert store.wait(10) == 0
    assert serve_store.main(["--job", "outside", "--address", "etcd://127.0.0.1:2379"]) == 2
    refused = capsys.readouterr().err
    assert refused.count("\n") == 1 and "which etcd serves" in refused


def test_serve_is_ignored_for_etcd_which_its_users_run(etcd):
    served = Rendezvous.connect("etcd-serve", etcd.address, serve=True, timeout=5)
    assert served.address == etcd.address and served.store_id is None
    served.put("probe", b"1")
    assert Rendezvous.connect("etcd-serve", etcd.address, timeout=5).get_bytes("probe") == b"1"


def test_one_of_three_members_killed_mid_run_calls_go_on_through_the_others(etcd3):
    rendezvous = Rendezvous.connect("etcd-members", etcd3.address, timeout=10, secret=SECRET)
    rendezvous.put("before", b"1")
    talked_to = etcd3.clients.index(rendezvous.store.port)
    waited: list = []
    waiter = threading.Thread(target=lambda: waited.append(rendezvous.wait(["after"], 10, "the key after the loss")))
    waiter.start()  # a wait in flight while the member it polls dies
    time.sleep(0.2)
    etcd3.kill(talked_to)
    began = time.monotonic()
    rendezvous.put("after", b"2")
    assert rendezvous.get_bytes("before") == b"1" and rendezvous.get_bytes("after") == b"2"
    waiter.join(10)
    assert waited == [None]
    assert rendezvous.store.port != etcd3.clients[talked_to]
    assert time.monotonic() - began < 5.0  # an election (500 ms here) and a refused connection, not a timeout


def test_a_cluster_recreated_under_the_job_is_one_sync_error_naming_what_to_restart(tmp_path):
    first = EtcdCluster(tmp_path / "a", 1)
    rendezvous = Rendezvous.connect("etcd-lost", first.address, timeout=3)
    rendezvous.put("probe", b"1")
    first.close()
    second = EtcdCluster(tmp_path / "b", 1, client_ports=first.clients)  # a new cluster, empty, at the same address
    try:
        with pytest.raises(SyncError, match="not cluster .* restart every trainer and inference process"):
            rendezvous.put("probe", b"2")
        with pytest.raises(SyncError, match="restart every trainer"):  # and every later call
            rendezvous.exists("probe")
    finally:
        second.close()


@pytest.fixture
def plan(plan_cache):
    return plan_cache("tiny-llama", "hf", "fp32")


def test_a_trainer_killed_and_restarted_is_taken_by_the_live_receiver_at_its_next_version(etcd, plan, tmp_path,
                                                                                          monkeypatch):
    """The store outlives the trainer: its restarted process (new incarnation, version counter resumed) publishes the
    next version and the receiver, never restarted, syncs it with the host executor's bytes; a process resuming a
    version the receiver already holds is refused, nothing published."""
    monkeypatch.setenv(SECRET_ENV, SECRET)  # the test's client and every worker (they inherit the environment)
    timeout = "20"
    with Job(tmp_path, plan, "etcd-restart", address=etcd.address) as job:
        job.start("inf0", "inference", 0, "--plain", "--gate", "--versions", "1,2,3", "--timeout", timeout)
        job.start("tr0", "trainer", 0, "--versions", "1,2,3", "--gate", "--timeout", timeout)
        job.event("inf0", "joined")
        job.event("tr0", "ready")
        job.go(1)
        first = job.event("inf0", "synced", 1)
        assert first["n_differ"] == 0 and first["tensors"] > 0
        assert job.event("tr0", "released", 1)["acked"] == [0]
        job.kill("tr0")  # between versions: its store records stay in etcd

        job.start("tr0b", "trainer", 0, "--versions", "2,3", "--gate", "--timeout", timeout)
        job.event("tr0b", "ready")
        job.go(2)
        job.go(3)
        for version in (2, 3):
            synced = job.event("inf0", "synced", version)
            assert synced["reported"] == version and synced["n_differ"] == 0, synced
            assert job.event("tr0b", "released", version)["acked"] == [0]
        restarted = job.rendezvous.get_text(protocol.version_key(0, 2), protocol.INCARNATION)
        assert restarted != job.rendezvous.get_text(protocol.version_key(0, 1), protocol.INCARNATION)
        assert job.wait("inf0") == 0  # the one receiver process synced every version

        job.start("tr0c", "trainer", 0, "--versions", "2", "--timeout", timeout)  # a checkpoint behind what readers hold
        refused = job.event("tr0c", "failed", 2)
        assert "version 2 is not after version 3" in refused["error"] and "nothing published" in refused["error"]
        assert "\n" not in refused["error"]
        assert job.rendezvous.get_text(protocol.version_key(0, 2), protocol.INCARNATION) == restarted
        job.assert_clean_exit("tr0b", "tr0c")
