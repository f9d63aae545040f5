"""Syncs across emulated nodes (network namespaces on a bridge, UCX over TCP, the store off loopback with the job
secret): 2 trainer nodes x 2 ranks to 2 inference nodes x 2 ranks, with node-local fan-out, bf16 and fp8_per_block,
every version's digests equal to vLLM's own load."""

from __future__ import annotations

import contextlib
import time

import pytest

from ..conftest import config_dir
from weightplan.testing.runtime_harness import Job
from weightplan.testing.emulated_cluster import EmulatedCluster

BF16 = ("tiny-qwen3-moe", "transformers", "bf16", "fsdp=4", "dp=4,ep,gpus-per-node=2")
FP8 = ("fp8-deepseek-v3", "transformers", "bf16", "fsdp=4", "dp=4,ep,gpus-per-node=2", "fp8_per_block")
NODES = {"t0": None, "t1": None, "i0": None, "i1": None}  # trainer ranks 0-1, 2-3; inference ranks 0-1, 2-3


@pytest.mark.extended
def test_two_trainer_nodes_sync_two_inference_nodes_over_tcp_with_fanout(plan_cache, tmp_path):
    plans = [plan_cache(*BF16), plan_cache(*FP8)]
    models = ",".join(str(config_dir(case[0])) for case in (BF16, FP8))
    with EmulatedCluster(NODES, tag="wpt-sync") as cluster, \
            Job(tmp_path, ",".join(map(str, plans)), "net-bf16,net-fp8", cluster=cluster, store_node="t0") as job:
        for k in range(4):
            job.start(f"inf{k}", "inference", k, "--versions", "1,2", "--model", models, "--verify", "--timeout", "300",
                      node=f"i{k // 2}")
        for r in range(4):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2", "--digests", "--wait-joined", "--timeout", "300",
                      node=f"t{r // 2}")
        job.assert_fanout_syncs(dict(zip(("net-bf16", "net-fp8"), plans)), (1, 2), readers=4, trainers=4, timeout=600)
        job.assert_clean_exit(*(f"inf{k}" for k in range(4)), *(f"tr{r}" for r in range(4)))


LINK_TIMEOUT = 10.0  # the workers' sync and release timeout in the fault tests
# A known defect, not yet understood (docs/operations.md, "Known: a trainer aborted inside UCX"): once in a full suite run
# under load (2026-12-05), a trainer process aborted in UCX after a reader's node had been cut for longer than the
# timeout. Only that abort, named by its message in a trainer's stderr, turns the test's failure into an xfail.
UCX_ABORT = "Fatal: unexpected error: Endpoint timeout"


@contextlib.contextmanager
def known_ucx_abort(job: Job, trainers: int):
    try:
        yield
    except AssertionError:
        aborted = [f"tr{r}" for r in range(trainers) if UCX_ABORT in job.stderr(f"tr{r}")]
        if aborted:
            pytest.xfail(f"known defect: trainer {aborted} aborted inside UCX ({UCX_ABORT!r}) after a long cut")
        raise


def assert_failed_clean(job: Job, readers: int, version: int, *named: str) -> None:
    """Every reader failed `version` within a bounded multiple of its timeout, reported no version (its weights are
    incomplete), and its error names one of `named`."""
    for k in range(readers):
        e = job.event(f"inf{k}", ("synced", "failed"), version, timeout=4 * LINK_TIMEOUT)
        assert e["event"] == "failed" and e["reported"] is None, e
        assert any(name in e["error"] for name in named), e


def start_gated(job: Job, versions: str, trainer_node, readers: int, inference_node, *extra) -> None:
    """4 gated trainers (on `trainer_node(rank)`) and `readers` gated plain readers (on `inference_node(rank)`, each
    with `extra(rank)` arguments), every timeout LINK_TIMEOUT; the trainers publish once every reader joined."""
    for r in range(4):
        job.start(f"tr{r}", "trainer", r, "--versions", versions, "--gate", "--wait-joined",
                  "--timeout", str(LINK_TIMEOUT), node=trainer_node(r))
    for k in range(readers):
        job.start(f"inf{k}", "inference", k, "--plain", "--gate", "--versions", versions, "--timeout", str(LINK_TIMEOUT),
                  *(extra[0](k) if extra else ()), node=inference_node(k))


@pytest.mark.extended
def test_an_inference_node_cut_mid_sync_fails_clean_then_syncs_again_after_the_link_returns(plan_cache, tmp_path):
    """Node i1 (inference ranks 2, 3) loses its link in the middle of version 2: its ranks fail version 2 with a
    SyncError and report no version (their weights are incomplete); node i0 completes version 2. Version 3 starts the
    moment the link is back: i1's ranks either sync it or fail it cleanly within their timeout (TCP connections that
    backed off during the cut may not carry traffic yet). Once the link carries traffic, version 4 syncs everywhere,
    with no process restarted."""
    path = plan_cache(*BF16[:4], "dp=4,ep")
    with EmulatedCluster({"t0": None, "i0": None, "i1": None}, tag="wpt-cut") as cluster, \
            Job(tmp_path, path, "net-cut", cluster=cluster, store_node="t0") as job:
        start_gated(job, "1,2,3,4", lambda r: "t0", 4, lambda k: f"i{k // 2}",
                    lambda k: ("--hold-at", "2") if k >= 2 else ())
        job.go(1)
        for k in range(4):
            assert job.event(f"inf{k}", "synced", 1)["n_differ"] == 0
        job.go(2)
        for k in (2, 3):
            job.event(f"inf{k}", "mid-sync", 2)
        cluster.link_down("i1")
        job.resume(2)
        for k in (0, 1):
            assert job.event(f"inf{k}", "synced", 2)["n_differ"] == 0
        for k in (2, 3):
            failed = job.event(f"inf{k}", "failed", 2, timeout=6 * LINK_TIMEOUT)
            assert failed["reported"] is None, failed  # incomplete weights: no version until a sync succeeds
        for r in range(4):  # the cut readers cost the others one release timeout before the next publish, no more
            e = job.event(f"tr{r}", "released", 2, timeout=6 * LINK_TIMEOUT)
            assert e["acked"] == [0, 1] and e["timed_out"] == [2, 3] and e["seconds"] < LINK_TIMEOUT + 5, e
        cluster.link_up("i1")
        with known_ucx_abort(job, 4):
            job.go(3)
            for k in range(4):
                e = job.event(f"inf{k}", ("synced", "failed"), 3, timeout=6 * LINK_TIMEOUT)
                assert (e["event"], e["reported"], e.get("n_differ", 0)) in {("synced", 3, 0), ("failed", None, 0)}, e
                assert k >= 2 or e["event"] == "synced", e  # node i0 never lost its link
            for r in range(4):
                job.event(f"tr{r}", "released", 3, timeout=6 * LINK_TIMEOUT)
            host, port = job.address.rsplit(":", 1)
            cluster.wait_reachable("i1", host, int(port))  # the link carries traffic again
            job.go(4)
            for k in range(4):
                e = job.event(f"inf{k}", "synced", 4, timeout=6 * LINK_TIMEOUT)
                assert e["reported"] == 4 and e["n_differ"] == 0, e
            job.assert_clean_exit(*(f"inf{k}" for k in range(4)), *(f"tr{r}" for r in range(4)))


STORE_CUT = 30.0  # seconds the store's node stays unreachable


@pytest.mark.extended
def test_the_store_node_unreachable_for_30_s_fails_every_process_clean_then_syncs_resume(plan_cache, tmp_path):
    """The store's node loses its link before version 2 and stays cut for 30 s: every inference rank fails version 2
    with a SyncError that names the store and reports no version, and every trainer reports version 2 (failed, or
    released with no reader acknowledging), each within a bounded multiple of its timeout: nothing hangs on the
    unreachable store. Once the store's link is back, version 3 syncs on every reader and every trainer's release sees
    every reader acknowledge, no process restarted (each reconnects to the same store and finds it holds the job)."""
    path = plan_cache(*BF16[:4], "dp=2,ep")
    with EmulatedCluster({"s0": None, "t0": None, "i0": None}, tag="wpt-store") as cluster, \
            Job(tmp_path, path, "net-store", cluster=cluster, store_node="s0") as job:
        start_gated(job, "1,2,3", lambda r: "t0", 2, lambda k: "i0")
        job.go(1)
        for k in range(2):
            assert job.event(f"inf{k}", "synced", 1)["n_differ"] == 0
        cluster.link_down("s0")
        cut_at = time.monotonic()
        job.go(2)
        assert_failed_clean(job, 2, 2, "rendezvous", "store")
        for r in range(4):
            e = job.event(f"tr{r}", ("released", "failed"), 2, timeout=4 * LINK_TIMEOUT)
            assert e["event"] == "failed" or (e["acked"] == [] and e["failed"] + e["timed_out"]), e
        time.sleep(max(0.0, STORE_CUT - (time.monotonic() - cut_at)))
        cluster.link_up("s0")
        host, port = job.address.rsplit(":", 1)
        for node in ("t0", "i0"):
            cluster.wait_reachable(node, host, int(port))
        job.go(3)
        for k in range(2):
            e = job.event(f"inf{k}", "synced", 3, timeout=4 * LINK_TIMEOUT)
            assert e["reported"] == 3 and e["n_differ"] == 0, e
        for r in range(4):
            e = job.event(f"tr{r}", "released", 3, timeout=4 * LINK_TIMEOUT)
            assert e["acked"] == [0, 1] and e["timed_out"] == [], e
        job.assert_clean_exit("inf0", "inf1", *(f"tr{r}" for r in range(4)))


def test_a_slow_trainer_node_is_named_in_the_sync_report(plan_cache, tmp_path):
    """Trainer node t1 (ranks 2, 3) has a tenth of t0's link rate: syncs complete with vLLM's bytes, and every
    inference rank's report names a rank of t1 as its slowest trainer, outstanding for most of the sync."""
    path = plan_cache(*BF16[:4], "dp=2,ep")
    rates = {"t0": 80.0, "t1": 8.0, "i0": 800.0}  # Mbit/s each way
    with EmulatedCluster(rates, tag="wpt-slow") as cluster, \
            Job(tmp_path, path, "net-slow", cluster=cluster, store_node="t0") as job:
        for r in range(4):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2", "--wait-joined", "--timeout", "60", node=f"t{r // 2}")
        for k in range(2):
            job.start(f"inf{k}", "inference", k, "--plain", "--versions", "1,2", "--timeout", "60", node="i0")
        for version in (1, 2):
            for k in range(2):
                e = job.event(f"inf{k}", "synced", version, timeout=120)
                assert e["n_differ"] == 0, e
                assert e["slowest_trainer"] in (2, 3) and e["slowest_share"] > 0.5, e
        job.assert_clean_exit(*(f"inf{k}" for k in range(2)), *(f"tr{r}" for r in range(4)))


def test_a_lost_trainer_node_fails_readers_clean_and_replacement_trainers_resume_the_syncs(plan_cache, tmp_path):
    """Trainer node t1 (ranks 2, 3) loses its link and its processes in the middle of version 2: every reader fails
    version 2 naming a trainer rank of t1 and reports no version. Replacement trainers for ranks 2 and 3 (new
    processes, new incarnations) start on t1 once its link is back, and version 3 syncs on every reader."""
    path = plan_cache(*BF16[:4], "dp=2,ep")
    with EmulatedCluster({"t0": None, "t1": None, "i0": None}, tag="wpt-lost") as cluster, \
            Job(tmp_path, path, "net-lost", cluster=cluster, store_node="t0") as job:
        start_gated(job, "1,2,3", lambda r: f"t{r // 2}", 2, lambda k: "i0", lambda k: ("--hold-at", "2"))
        job.go(1)
        for k in range(2):
            assert job.event(f"inf{k}", "synced", 1)["n_differ"] == 0
        job.go(2)
        for k in range(2):
            job.event(f"inf{k}", "mid-sync", 2)
        cluster.link_down("t1")
        job.kill("tr2")
        job.kill("tr3")
        job.resume(2)
        assert_failed_clean(job, 2, 2, "trainer rank 2", "trainer rank 3")
        for r in (0, 1):
            e = job.event(f"tr{r}", "released", 2, timeout=4 * LINK_TIMEOUT)
            assert e["acked"] == [], e
        cluster.link_up("t1")
        host, port = job.address.rsplit(":", 1)
        cluster.wait_reachable("t1", host, int(port))
        for r in (2, 3):
            job.start(f"tr{r}b", "trainer", r, "--versions", "3", "--gate", "--wait-joined", "--timeout", str(LINK_TIMEOUT),
                      node="t1")
            job.event(f"tr{r}b", "ready", timeout=120)
        job.go(3)
        for k in range(2):
            e = job.event(f"inf{k}", "synced", 3, timeout=6 * LINK_TIMEOUT)
            assert e["reported"] == 3 and e["n_differ"] == 0, e
        job.assert_clean_exit("inf0", "inf1", "tr0", "tr1", "tr2b", "tr3b")


CUT_TIMEOUT = 4.0  # every timeout of the long-cut test: sync, release and store (the store's own margin adds 2 s)


@pytest.mark.extended
def test_a_reader_cut_longer_than_every_timeout_syncs_again_by_itself_and_costs_the_other_one_timeout(plan_cache, tmp_path):
    """Inference node i1 loses its link in the middle of version 3 and stays cut through versions 4 and 5 (longer than
    every timeout involved: its sync and the store's fail, the trainers give up on it). Once its link is back, version
    6 syncs on it with the host executor's bytes, no process restarted, and the trainers wait for it again at version
    7. Reader 0, on i0, syncs every version; the versions around the cut cost it at most one release timeout more than
    before the cut, once."""
    path = plan_cache(*BF16[:3], "fsdp=2", "dp=2,ep")
    versions = "1,2,3,4,5,6,7"
    with EmulatedCluster({"s0": None, "t0": None, "i0": None, "i1": None}, tag="wpt-long") as cluster, \
            Job(tmp_path, path, "net-long", cluster=cluster, store_node="s0") as job:
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--versions", versions, "--gate", "--wait-joined",
                      "--timeout", str(CUT_TIMEOUT), node="t0")
        for k in range(2):
            job.start(f"inf{k}", "inference", k, "--plain", "--gate", "--versions", versions, "--timeout", str(CUT_TIMEOUT),
                      *(("--hold-at", "3") if k else ()), node=f"i{k}")
        for version in (1, 2):
            job.go(version)
            for k in range(2):
                e = job.event(f"inf{k}", "synced", version)
                assert e["n_differ"] == 0, e
        before = job.event("inf0", "synced", 2)["seconds"]
        job.go(3)
        job.event("inf1", "mid-sync", 3)
        cluster.link_down("i1")
        cut_at = time.monotonic()
        job.resume(3)
        around = []
        for version in (3, 4, 5):
            e = job.event("inf0", "synced", version, timeout=6 * CUT_TIMEOUT)
            assert e["n_differ"] == 0, e
            around.append(e["seconds"])
            if version < 5:  # at once: what the trainers still wait for shows in reader 0's next sync
                job.go(version + 1)
            failed = job.event("inf1", ("synced", "failed"), version, timeout=6 * CUT_TIMEOUT)
            assert failed["event"] == "failed" and failed["reported"] is None, failed
            for r in range(2):
                released = job.event(f"tr{r}", "released", version, timeout=6 * CUT_TIMEOUT)
                # given up on once, at version 3; not waited for again while it is cut
                assert released["timed_out"] == ([1] if version == 3 else []), released
        cut = time.monotonic() - cut_at
        assert cut > 3 * CUT_TIMEOUT, f"the cut lasted {cut:.1f} s, not longer than every timeout"
        cluster.link_up("i1")
        with known_ucx_abort(job, 2):
            host, port = job.address.rsplit(":", 1)
            cluster.wait_reachable("i1", host, int(port))
            for version in (6, 7):
                job.go(version)
                for k in range(2):
                    e = job.event(f"inf{k}", "synced", version, timeout=6 * CUT_TIMEOUT)
                    assert e["reported"] == version and e["n_differ"] == 0, e  # the host executor's bytes
                    if k == 0:
                        around.append(e["seconds"])
                for r in range(2):
                    released = job.event(f"tr{r}", "released", version, timeout=6 * CUT_TIMEOUT)
                    # at 6 it acknowledges once more (maybe after the trainer stopped waiting); from 7 on it is waited for
                    assert 0 in released["acked"] and released["timed_out"] == [], released
                    assert version == 6 or released["acked"] == [0, 1], released
                    if released["returned"]:  # it said it was back before the release ended: held open, it was read
                        assert released["returned"] == [1] and released["acked"] == [0, 1], released
            extra = sum(max(0.0, s - before) for s in around)
            assert extra <= CUT_TIMEOUT + 2.0, (before, around)
            job.assert_clean_exit("inf0", "inf1", "tr0", "tr1")


IDLE_TIMEOUT = 15.0  # the trainers' and reader A's timeout in the idle-trainers test
IDLE_CUT = 25.0  # longer than UCX rides out over TCP
IDLE_READER_TIMEOUT = 60.0  # reader B's: its version 2 outlasts the cut


@pytest.mark.extended
def test_a_reader_cut_until_the_trainers_went_idle_syncs_their_last_version_once_its_link_returns(plan_cache, tmp_path):
    """Issue 47's case. Reader B (inference rank 1, node i1) loses its link right before version 2 and stays cut while
    the trainers (both on t0, beside the store) publish versions 2-6 and reader A (i0) syncs each; then the trainers stay
    alive and idle, serving version 6 unreleased. B fails version 2 once its link is back ("the trainer holds version
    6"), and 3-5 at once; then it syncs version 6 from the idle trainers at its first try, with the host executor's
    bytes, no process restarted; the trainers, released after that, saw both readers acknowledge version 6."""
    path = plan_cache(*BF16[:3], "fsdp=2", "dp=2,ep")
    versions = "1,2,3,4,5,6"
    with EmulatedCluster({"t0": None, "i0": None, "i1": None}, tag="wpt-idle") as cluster, \
            Job(tmp_path, path, "net-idle", cluster=cluster, store_node="t0") as job:
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--versions", versions, "--gate", "--wait-joined", "--hold-last",
                      "--timeout", str(IDLE_TIMEOUT), node="t0")
        for k, timeout in enumerate((IDLE_TIMEOUT, IDLE_READER_TIMEOUT)):
            job.start(f"inf{k}", "inference", k, "--plain", "--gate", "--versions", versions, "--timeout", str(timeout),
                      node=f"i{k}")
        job.go(1)
        for k in range(2):
            assert job.event(f"inf{k}", "synced", 1)["n_differ"] == 0
        for r in range(2):
            job.event(f"tr{r}", "released", 1)
        cluster.link_down("i1")
        cut_at = time.monotonic()
        for version in range(2, 7):
            job.go(version)
            e = job.event("inf0", "synced", version, timeout=4 * IDLE_TIMEOUT)
            assert e["n_differ"] == 0, e
        for r in range(2):
            job.event(f"tr{r}", "published", 6)
        time.sleep(max(0.0, IDLE_CUT - (time.monotonic() - cut_at)))
        cluster.link_up("i1")
        with known_ucx_abort(job, 2):
            for version in range(2, 6):
                failed = job.event("inf1", ("synced", "failed"), version, timeout=2 * IDLE_READER_TIMEOUT)
                assert failed["event"] == "failed" and failed["reported"] is None, failed
            e = job.event("inf1", ("synced", "failed"), 6, timeout=2 * IDLE_READER_TIMEOUT)
            assert e["event"] == "synced" and e["reported"] == 6 and e["n_differ"] == 0, e
            job.release(6)
            for r in range(2):
                released = job.event(f"tr{r}", "released", 6, timeout=2 * IDLE_TIMEOUT)
                assert released["acked"] == [0, 1], released
            job.assert_clean_exit("inf0", "inf1", "tr0", "tr1")


def test_a_reader_whose_agent_was_made_while_its_link_was_down_syncs_at_its_first_try_once_the_link_returns(
        plan_cache, tmp_path):
    """Issue 47's mechanism. UCX lists a node's network links once, when a worker is made: reader B (i1) makes its NIXL
    agent while its link is down, so that worker holds loopback only and could never reach the trainers, even after the
    link returns. At its first sync B sees its host's links changed since and makes a new agent before connecting: it
    syncs version 1 with the host executor's bytes at the first try, no trainer ever unreachable to it."""
    path = plan_cache(*BF16[:3], "fsdp=2", "dp=2,ep")
    with EmulatedCluster({"t0": None, "i0": None, "i1": None}, tag="wpt-made") as cluster, \
            Job(tmp_path, path, "net-made", cluster=cluster, store_node="t0") as job:
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--wait-joined", "--timeout", "60", node="t0")
        job.start("inf0", "inference", 0, "--plain", "--timeout", "60", node="i0")
        job.start("inf1", "inference", 1, "--plain", "--start-gate", "--timeout", "60", node="i1")
        job.event("inf1", "ready")  # connected to the store
        cluster.link_down("i1")
        job.start_readers()
        deadline = time.monotonic() + 60
        while "Initialized NIXL agent" not in (tmp_path / "inf1.out").read_text():  # NIXL's line, once the agent is made
            assert time.monotonic() < deadline and job.procs["inf1"].poll() is None, job.stderr("inf1")
            time.sleep(0.1)
        cluster.link_up("i1")
        for k in range(2):
            e = job.event(f"inf{k}", ("synced", "failed"), 1)
            assert e["event"] == "synced" and e["reported"] == 1 and e["n_differ"] == 0, e
        for r in range(2):
            released = job.event(f"tr{r}", "released", 1)
            assert released["acked"] == [0, 1] and released["failed"] == [], released
        assert "cannot load agent metadata" not in (tmp_path / "inf1.err").read_text(), job.stderr("inf1")
        job.assert_clean_exit("inf0", "inf1", "tr0", "tr1")
