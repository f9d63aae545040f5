"""The sync protocol's keys and messages: built and parsed by runtime/transport/protocol.py, all listed in docs/runtime.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightplan.runtime.transport import protocol
from weightplan.runtime.transport.protocol import Kind, Message, parse_message

_DOC = (Path(__file__).resolve().parents[2] / "docs" / "runtime.md").read_text()
_VERSIONS = st.integers(1, 2**62 - 1)


def test_every_key_and_message_is_in_the_protocol_table():
    r, k, v, c, i = "<r>", "<k>", "<v>", "<c>", "<incarnation>"
    built = [protocol.trainer_info_key(r), protocol.trainer(r).metadata_key(i), protocol.version_key(r, v),
             protocol.digests_key(r, v), protocol.delta_key(r, v), protocol.staged_key(r, v), protocol.gathered_key(r, v), protocol.joined_key(k),
             protocol.returning_key(k, v), protocol.left_key(k), protocol.published_key(r),
             protocol.inference_info_key(k, i), protocol.inference(k).metadata_key(i), protocol.store_key(),
             protocol.begin(v), protocol.ack(v), protocol.fail(v), protocol.ring(v, c), protocol.hop(v)]
    builders = [name for name in vars(protocol) if name.endswith("_key")]
    assert len(builders) == 12 and len(Kind) == 5, f"list a new key or message above and in docs/runtime.md: {builders}"
    missing = [b for b in built if f"| `{b}` |" not in _DOC]
    assert not missing, missing
    assert f"({protocol.PROTOCOL_VERSION})" in _DOC


@given(kind=st.sampled_from([k for k in Kind if k is not Kind.RING]), version=_VERSIONS)
def test_messages_parse_back(kind, version):
    text = getattr(protocol, kind.value)(version)
    assert parse_message(text) == Message(kind, version)


@given(version=_VERSIONS, chunk=st.integers(0, 10**6))
def test_ring_messages_parse_back(version, chunk):
    assert parse_message(protocol.ring(version, chunk)) == Message(Kind.RING, version, chunk)


@pytest.mark.parametrize("text", ["ack:1 and __import__('os')", "ack:", "ack:-1", "ring:1", "hop:1:2", "nack:1", "ACK:1",
                                  "ack:" + "9" * 20, "ring:1:" + "9" * 4400, ""])
def test_anything_else_is_not_a_message(text):
    assert parse_message(text) is None


def test_agent_names_and_endpoints():
    assert protocol.trainer(3).agent("job") == "job.trainer.3" and str(protocol.inference(2)) == "inference rank 2"
    assert protocol.inference(2).info_key("ab") == "inference/2/info/ab" and protocol.trainer(3).info_key("ab") == "trainer/3/info"


def test_delta_records_parse_back_and_bad_ones_are_refused_in_one_line():
    record = protocol.DeltaRecord(3, 1200, "ab" * 32)
    assert protocol.parse_delta_record(protocol.delta_record(record), 0, 4) == record
    assert protocol.parse_delta_record({"base": None, "bytes": 0, "index": "0" * 64}, 0, 4).base is None
    for value, field in (({"base": 4, "bytes": 1, "index": "0" * 64}, "names base 4"),
                         ({"base": True, "bytes": 1, "index": "0" * 64}, "names base True"),
                         ({"base": 1, "bytes": -1, "index": "0" * 64}, "has bytes -1"),
                         ({"base": 1, "bytes": 1, "index": "zz"}, "has no SHA-256 index digest")):
        with pytest.raises(protocol.SyncError, match=f"trainer rank 2: its delta record of version 4 {field}"):
            protocol.parse_delta_record(value, 2, 4)
