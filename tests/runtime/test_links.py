"""runtime/transport/links.py: the snapshot of usable links changes when a node's link goes down and comes back."""

from __future__ import annotations

import json
import sys

from weightplan.runtime.transport.links import links_up
from weightplan.testing.emulated_cluster import EmulatedCluster

SNAPSHOT = ("import json\n"
            "from weightplan.runtime.transport.links import links_up\n"
            "print(json.dumps(sorted(links_up())))\n")


def _links(cluster: EmulatedCluster, node: str) -> list[list[str]]:
    done = cluster.run(node, [sys.executable, "-c", SNAPSHOT])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_this_host_lists_no_loopback_link_and_the_same_snapshot_twice():
    up = links_up()
    assert all(name != "lo" and not address.startswith("127.") for name, address in up)
    assert links_up() == up


def test_a_cut_link_leaves_the_snapshot_and_comes_back_with_its_address():
    with EmulatedCluster({"a": None, "b": None}, tag="wpt-links") as cluster:
        link = cluster.nodes["b"].link
        assert _links(cluster, "b") == [[link, cluster.address("b")]]
        cluster.link_down("b")  # the bridge's end: b's end loses its carrier, stays administratively up
        assert _links(cluster, "b") == []
        assert _links(cluster, "a") == [[cluster.nodes["a"].link, cluster.address("a")]]
        cluster.link_up("b")
        assert _links(cluster, "b") == [[link, cluster.address("b")]]
