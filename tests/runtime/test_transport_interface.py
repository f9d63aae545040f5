"""The declared seams of the runtime: NixlAgent and the tests' fake NIXL hold to their interfaces, the trainer's info is
one typed record, and runtime/ imports without circles."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import networkx as nx
import pytest

from weightplan.runtime.errors import SyncError
from weightplan.runtime.transport import protocol
from weightplan.runtime.transport.local_peer import LocalReader
from weightplan.runtime.transport.memory import MemoryMap, Span, placement_of
from weightplan.runtime.transport.nixl_agent import NixlAgent
from weightplan.runtime.transport.reader import PeerReader, Transport

from ..support.fake_nixl import FakeNixl

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def _members(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def _declared(proto) -> set[str]:
    names = set()
    for klass in proto.__mro__:
        if klass in (object,) or klass.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n in vars(klass) if not n.startswith("_")} | set(getattr(klass, "__annotations__", {}))
    return names


def test_nixl_agent_is_exactly_the_declared_transport():
    """Every public member of NixlAgent is declared by Transport and every declared one exists, with the declared
    parameters: a second transport written against the declaration fits where NixlAgent does."""
    declared = _declared(Transport)
    assert _members(NixlAgent) - {"progress"} <= declared | {"name", "memory"}, _members(NixlAgent) - declared
    for name in declared - {"name", "memory", "path"}:
        assert hasattr(NixlAgent, name), name
        want = getattr(Transport, name)
        if callable(want):
            assert list(inspect.signature(getattr(NixlAgent, name)).parameters) == list(inspect.signature(want).parameters), name


def test_the_local_reader_is_a_peer_reader():
    for name in _declared(PeerReader):
        assert list(inspect.signature(getattr(LocalReader, name)).parameters) == \
            list(inspect.signature(getattr(PeerReader, name)).parameters), name


def test_the_fake_nixl_of_the_tests_has_nixls_signatures():
    """tests/support/fake_nixl.py's FakeNixl stands in for nixl_agent: each method it fakes exists there with the
    same parameters, so a change of NIXL's API fails here before it fails on a GPU."""
    from nixl_cu12._api import nixl_agent

    for name in _members(FakeNixl) - {"registered", "lists", "reads", "released"} | {"__init__"}:
        real = list(inspect.signature(getattr(nixl_agent, name)).parameters)
        fake = list(inspect.signature(getattr(FakeNixl, name)).parameters)
        assert fake == real[: len(fake)] and all(inspect.signature(getattr(nixl_agent, name)).parameters[p].default
                                                 is not inspect.Parameter.empty for p in real[len(fake):]), (name, fake, real)


def _info() -> protocol.TrainerInfo:
    import torch

    t = torch.zeros(64, dtype=torch.uint8)
    return protocol.TrainerInfo(
        fingerprint="ab" * 32, incarnation="c" * 32, agent="job.trainer.0", seq=t.data_ptr(), packed=(t.data_ptr(), 16),
        ring=(t.data_ptr() + 16, 8), regions=(protocol.ServedRegion(0, 0, t.data_ptr() + 32, 32),),
        memory=MemoryMap.of([Span(t.data_ptr(), 64, placement_of(t))]), options=protocol.SharedOptions(1 << 20, False),
        quant=None, delta={"index": (1, 8), "region": (2, 64)}, host="198.18.0.2")


def test_the_trainer_info_round_trips():
    info = _info()
    assert protocol.TrainerInfo.parse(info.to_json(), 0) == info


@pytest.mark.parametrize("field,value,message", [
    ("seq", -1, "'seq' is -1"),
    ("packed", [1], "'packed' is \\[1\\]"),
    ("incarnation", "x", "'incarnation' is x"),
    ("fingerprint", 7, "'fingerprint' is 7"),
    ("regions", [[0, 0, 1]], "'regions' is not a list"),
    ("memory", "host", "'memory' is not a list"),
    ("quant", {"fp8": [1, 2]}, "'quant' is not an object of fp8, scales, stage_packed"),
    ("delta", {"index": [1, 2], "region": [True, 2]}, "'region' is \\[True, 2\\]"),
    ("local", {"pid": 1}, "'local' is not an object"),
    ("extra", 1, "unknown field 'extra'"),
    ("host", "t0\nforged line", "'host' is 't0\\\\nforged line', not an IP address"),
    ("host", 198, "'host' is '198', not an IP address"),
    ("options", {"ring_bytes": 0, "verify": False}, "'options.ring_bytes' is 0"),
    ("options", {"ring_bytes": 8}, "'options' is not an object of ring_bytes, verify"),
])
def test_a_malformed_trainer_info_is_one_line_naming_the_field(field, value, message):
    record = _info().to_json() | {field: value}
    with pytest.raises(SyncError, match=f"trainer rank 3: its info.*{message}") as caught:
        protocol.TrainerInfo.parse(record, 3)
    assert "\n" not in str(caught.value)


def test_options_both_sides_must_share_are_checked_in_one_place():
    options = protocol.SharedOptions(1 << 20, verify=False)
    assert options.mismatch(1 << 20, verify=False) is None
    assert options.mismatch(1 << 19, verify=False) == ("ring_bytes is 1048576 there and 524288 here: give its Sender and "
                                                      "this Receiver the same ring_bytes")
    assert "verify is False there and True here" in options.mismatch(1 << 20, verify=True)
    assert protocol.SharedOptions(1 << 20, verify=True).mismatch(1 << 20, verify=True) is None


def _imports(path: Path, package: str) -> set[str]:
    """The runtime modules `path` imports, anywhere in it (TYPE_CHECKING blocks and functions included)."""
    module = package + "." + ".".join(path.relative_to(RUNTIME).with_suffix("").parts)
    module = module.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {target} | {f"{target}.{a.name}" for a in node.names}
    return found


def test_the_runtime_imports_without_circles():
    """runtime/'s modules import one another one way only: a TYPE_CHECKING import that closes a circle counts too."""
    graph = nx.DiGraph()
    files = {("weightplan.runtime." + ".".join(p.relative_to(RUNTIME).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in RUNTIME.rglob("*.py")}
    for module, path in files.items():
        graph.add_node(module)
        for target in _imports(path, "weightplan.runtime"):
            if target in files and target != module and not module.startswith(target + ".") :
                graph.add_edge(module, target)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, cycles[:3]
