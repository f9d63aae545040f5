"""The rendezvous against hostile peers: loopback bind, job-secret authentication, impostors, and poisoned store values."""

from __future__ import annotations

import logging
import re

import psutil
import pytest

from weightplan.runtime import Receiver, Rendezvous, Sender, SyncError, load_plan
from weightplan.runtime.errors import WeightplanError
from weightplan.runtime.transport import protocol
from weightplan.runtime.transport.rendezvous import SECRET_ENV, SECRET_FILE_ENV, job_secret

from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, plain_destination, shard

SECRET = "0123456789abcdef-test-secret"


pytestmark = pytest.mark.usefixtures("no_job_secret_in_the_environment")


@pytest.fixture
def plan(plan_cache):
    return load_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=1", "tp=1"))


def _job(request) -> str:
    return "sec-" + request.node.name[:40].replace("[", "-").replace("]", "")


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_a_served_store_listens_on_loopback_only(request):
    store = Rendezvous.connect(_job(request), "127.0.0.1:0", serve=True)
    assert _listening(store.store.port) == {"127.0.0.1"}


def test_a_store_off_loopback_needs_a_secret_or_an_explicit_insecure(request, caplog):
    with pytest.raises(WeightplanError, match="not on loopback and this job has no secret"):
        Rendezvous.connect(_job(request), "0.0.0.0:0", serve=True)
    with caplog.at_level(logging.WARNING, logger="weightplan.rendezvous"):
        insecure = Rendezvous.connect(_job(request), "0.0.0.0:0", serve=True, insecure=True)
    assert "insecure=True" in caplog.text and not insecure.authenticated
    signed = Rendezvous.connect(_job(request), "0.0.0.0:0", serve=True, secret=SECRET)
    assert signed.authenticated and _listening(signed.store.port) == {"0.0.0.0"}


def test_secrets_come_from_a_private_file_or_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    with pytest.raises(WeightplanError, match="readable by others .*chmod 600"):
        job_secret()
    path.chmod(0o600)
    assert job_secret() == SECRET.encode()
    monkeypatch.setenv(SECRET_FILE_ENV, str(tmp_path))
    with pytest.raises(WeightplanError, match="not a regular file"):
        job_secret()
    monkeypatch.delenv(SECRET_FILE_ENV)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(WeightplanError, match="at least 16 bytes"):
        job_secret()


def _signed_pair(request, plan):
    """A store served with the job secret, a trainer on it, and a reader with its own signed connection."""
    served = Rendezvous.connect(_job(request), "127.0.0.1:0", serve=True, secret=SECRET)
    sender = Sender(plan, 0, shard(plan, full_weights(plan, 0, 1), 0), rendezvous=served, timeout=5, progress="thread").start()
    destination = plain_destination(plan, 0)
    receiver = Receiver(plan, 0, destination, rendezvous=Rendezvous.connect(served.job, served.address, secret=SECRET),
                        timeout=5, derived="caller").start()
    return served, sender, destination, receiver


@pytest.mark.parametrize("impostor_secret", [None, "another-secret-of-enough-bytes"], ids=["no-secret", "wrong-secret"])
def test_forged_records_of_an_impostor_trainer_are_never_read(request, plan, impostor_secret):
    """A second "trainer rank 0" without the job's secret announces version 1 and replaces rank 0's info, before and
    after the real trainer publishes: a secured job's store keys are names only the secret derives, so the
    impostor's records land where nobody reads, and the reader syncs the real trainer's bytes."""
    served, sender, destination, receiver = _signed_pair(request, plan)
    impostor = Rendezvous.connect(served.job, served.address, secret=impostor_secret)
    forged = {"incarnation": "f" * 32, "regions": [], "seq": 0, "packed": [0, 0]}
    impostor.put("trainer/0/version/1", b"f" * 32)
    impostor.put("trainer/0/info", forged)
    sender.publish(1)
    impostor.put("trainer/0/version/1", b"f" * 32)
    impostor.put("trainer/0/info", forged)
    receiver.sync(1)
    expected = host_reference(plan, full_weights(plan, 0, 1), 0)
    assert receiver.version == 1 and all(byte_equal(t, destination[n]) for n, t in expected.items())


def test_an_impostor_senders_start_and_junk_joined_records_do_not_disturb_a_secured_job(request, plan, caplog):
    """Issue 27 item 2: a process without the secret runs Sender.start() for trainer rank 0 (its info and metadata)
    and writes a junk joined record for inference rank 0. The real trainer still waits for the real reader's
    acknowledgement, and the reader syncs; a reader that waits on a key only an unsigned process wrote is told so."""
    served, sender, destination, receiver = _signed_pair(request, plan)
    unsigned = Rendezvous.connect(served.job, served.address)
    impostor = Sender(plan, 0, shard(plan, full_weights(plan, 7, 1), 0), rendezvous=unsigned, timeout=5).start()
    unsigned.put("inference/0/joined", b"\xff not json")
    sender.publish(1)
    receiver.sync(1)
    report = sender.release(1, timeout=5)
    assert report.acked == (0,) and report.timed_out == ()
    expected = host_reference(plan, full_weights(plan, 0, 1), 0)
    assert all(byte_equal(t, destination[n]) for n, t in expected.items())
    impostor.publish(2)  # only the impostor announces version 2
    with caplog.at_level(logging.WARNING), pytest.raises(
            SyncError, match=r"not published within .*ignored 'trainer/0/version/2' written by a process without this job's secret"):
        receiver.sync(2)
    impostor.close()


def test_signed_records_sync_and_an_unsigned_reader_is_told_why_it_cannot_read(request, plan):
    served, sender, destination, receiver = _signed_pair(request, plan)
    sender.publish(1)
    receiver.sync(1)
    expected = host_reference(plan, full_weights(plan, 0, 1), 0)
    assert expected and all(byte_equal(t, destination[n]) for n, t in expected.items())
    unsigned = Rendezvous.connect(served.job, served.address)
    with pytest.raises(SyncError, match="signs its records with a job secret this process does not have"):
        unsigned.wait(["trainer/0/info"], 0.5, "trainer rank 0's info")


# --- poisoned values under the keys the runtime reads ----------------------------------------------

POISON = {
    "version not ascii": ("trainer/0/version/1", b"\xff\xfe"),
    "version not an incarnation": ("trainer/0/version/1", b"../../x"),
    "info not json": ("trainer/0/info", b"{"),
    "info a list": ("trainer/0/info", b"[1, 2]"),
    "info deep json": ("trainer/0/info", b"[" * 100000),
    "info seq a string": ("trainer/0/info", "seq"),
    "info packed an int": ("trainer/0/info", "packed"),
    "info regions mistyped": ("trainer/0/info", "regions"),
    "info seq beyond 64 bits": ("trainer/0/info", "seq-wild"),
}
# A well-formed info whose addresses are not memory the trainer registered: (field, new value from the real info).
BAD_ADDRESSES = {
    "seq at 0": ("seq", lambda info: 0),
    "seq at 4096": ("seq", lambda info: 4096),
    "ring at 0": ("ring", lambda info: [0, info["ring"][1]]),
    # the 16-byte ring word read 8 bytes late: its last 8 bytes lie past the registration (`ring[1]` is the packed
    # region's size, not the word's: an address that far away may land in another registered tensor)
    "ring off by 8": ("ring", lambda info: [info["ring"][0] + 8, info["ring"][1]]),
    "packed at 4096": ("packed", lambda info: [4096, info["packed"][1]]),
    "region at 0": ("regions", lambda info: _moved_largest_region(info, lambda address: 0)),
    "region off by 8": ("regions", lambda info: _moved_largest_region(info, lambda address: address + 8)),
}


def _largest_region(info) -> int:
    """The index of the trainer's largest region: read directly, not packed (tables/ranks.py PACK_BELOW_BYTES)."""
    return max(range(len(info["regions"])), key=lambda i: info["regions"][i][3])


def _moved_largest_region(info, move) -> list:
    regions = [list(r) for r in info["regions"]]
    regions[_largest_region(info)][2] = move(regions[_largest_region(info)][2])
    return regions


@pytest.mark.parametrize("case", sorted(POISON))
def test_poisoned_trainer_records_fail_the_sync_cleanly_and_the_trainer_reports(request, plan, case):
    served = Rendezvous.connect(_job(request), "127.0.0.1:0", serve=True)
    tensors = shard(plan, full_weights(plan, 0, 1), 0)
    sender = Sender(plan, 0, tensors, rendezvous=served, timeout=5, progress="thread").start()
    receiver = Receiver(plan, 0, plain_destination(plan, 0), rendezvous=served, timeout=2, derived="caller").start()
    sender.publish(1)
    key, value = POISON[case]
    if isinstance(value, str):  # a real info record with one field broken
        info = served.get_json("trainer/0/info")
        info.update({"seq": {"seq": "x", "seq-wild": 1 << 70}.get(value, info["seq"]),
                     "packed": 5 if value == "packed" else info["packed"],
                     "regions": [["a"]] if value == "regions" else info["regions"]})
        served.put(key, info)
    else:
        served.put(key, value)
    with pytest.raises(SyncError, match="trainer/0/|trainer rank 0"):
        receiver.sync(1)
    assert receiver.version is None
    report = sender.release(1, timeout=2)  # the trainer is told (fail:1) or times out; it does not raise
    assert report.acked == ()


@pytest.mark.parametrize("case", sorted(BAD_ADDRESSES))
def test_trainer_info_with_unregistered_addresses_fails_the_sync_naming_the_field(request, plan, plan_cache, case):
    if case.startswith("region"):  # tiny-glm's regions are all packed; vocab-llama's embedding is read directly
        plan = load_plan(plan_cache("vocab-llama", "hf", "bf16", "fsdp=1", "tp=1"))
    served = Rendezvous.connect(_job(request), "127.0.0.1:0", serve=True)
    sender = Sender(plan, 0, shard(plan, full_weights(plan, 0, 1), 0), rendezvous=served, timeout=5, progress="thread").start()
    receiver = Receiver(plan, 0, plain_destination(plan, 0), rendezvous=served, timeout=2, derived="caller").start()
    sender.publish(1)
    field, change = BAD_ADDRESSES[case]
    info = served.get_json("trainer/0/info")
    served.put("trainer/0/info", dict(info, **{field: change(info)}))
    field = f"regions[{_largest_region(info)}]" if field == "regions" else field
    with pytest.raises(SyncError, match=rf"trainer rank 0: its info's '{re.escape(field)}' .*name memory it did not register") as err:
        receiver.sync(1)
    assert "\n" not in str(err.value) and receiver.version is None
    assert sender.release(1, timeout=2).acked == ()


def test_a_garbage_join_record_does_not_make_the_trainer_fail(request, plan, caplog):
    served = Rendezvous.connect(_job(request), "127.0.0.1:0", serve=True)
    sender = Sender(plan, 0, shard(plan, full_weights(plan, 0, 1), 0), rendezvous=served, timeout=5, progress="thread").start()
    served.put("inference/0/joined", b"\xff not json")
    sender.publish(1)
    with caplog.at_level(logging.WARNING):
        report = sender.release(1, timeout=0.5)
    assert report.acked == () and "inference rank 0's join" in caplog.text


def test_connection_failures_are_one_line_and_keep_the_timeout(request):
    import socket
    import time

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    with pytest.raises(WeightplanError, match=f"cannot listen on 127.0.0.1:{port} for the rendezvous store"):
        Rendezvous.connect(_job(request), f"127.0.0.1:{port}", serve=True)
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed = free.getsockname()[1]
    free.close()  # nothing listens there now
    start = time.monotonic()
    with pytest.raises(WeightplanError, match=f"cannot reach the rendezvous store at 127.0.0.1:{closed} within 2 s") as info:
        Rendezvous.connect(_job(request), f"127.0.0.1:{closed}", timeout=2)
    assert "\n" not in str(info.value) and time.monotonic() - start < 2 + 0.5


@pytest.mark.parametrize("job,address,timeout,message", [
    ("ok\n", "127.0.0.1:0", 5, "job id 'ok\\\\n'"),
    ("ok", "127.0.0.1:0", 0, "timeout must be a number of seconds"),
    ("ok", "127.0.0.1:0", -1, "timeout must be a number of seconds"),
    ("ok", "127.0.0.1:²", 5, "must be HOST:PORT"),
])
def test_connect_arguments_are_checked(job, address, timeout, message):
    with pytest.raises(WeightplanError, match=message):
        Rendezvous.connect(job, address, serve=True, timeout=timeout)


@pytest.mark.parametrize("key,value", [("metadata", b"\x00garbage"), ("digests", b"[1, 2]"), ("digests", b"{\"x\": ")])
def test_poisoned_metadata_and_digests_fail_the_sync_cleanly(request, plan, key, value):
    served = Rendezvous.connect(_job(request), "127.0.0.1:0", serve=True)
    sender = Sender(plan, 0, shard(plan, full_weights(plan, 0, 1), 0), rendezvous=served, timeout=5, verify=True,
                    progress="thread").start()
    receiver = Receiver(plan, 0, plain_destination(plan, 0), rendezvous=served, timeout=2, derived="caller", verify=True).start()
    sender.publish(1)
    served.put(protocol.trainer(0).metadata_key(sender.incarnation) if key == "metadata" else protocol.digests_key(0, 1), value)
    with pytest.raises(SyncError, match="inference rank 0: sync of version 1 failed"):
        receiver.sync(1)
    assert receiver.version is None
    assert sender.release(1, timeout=2).acked == ()


def test_a_write_to_a_store_whose_host_died_is_one_sync_error(request):
    """The store's process is gone: a put fails at once with one SyncError line, not a raw DistNetworkError."""
    import socket
    import subprocess
    import sys
    import time

    from weightplan.runtime.errors import SyncError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve = ("import sys, time\nfrom weightplan.runtime import Rendezvous\n"
             "store = Rendezvous.connect(sys.argv[1], sys.argv[2], serve=True)\nprint('serving', flush=True)\ntime.sleep(600)\n")
    host = subprocess.Popen([sys.executable, "-c", serve, _job(request), f"127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "serving"
        client = Rendezvous.connect(_job(request), f"127.0.0.1:{port}", timeout=5)
        client.put("probe", b"1")
    finally:
        host.kill()
        host.wait()
    began = time.monotonic()
    with pytest.raises(SyncError, match=r"rendezvous key 'probe': cannot write it \(\w+\); is the store's host reachable\?"):
        for _ in range(3):  # the first write after the peer's exit may still land in the socket's buffer
            client.put("probe", b"2")
    assert time.monotonic() - began < 10
