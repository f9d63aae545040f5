"""MTP draft plans (compile-plan --draft): the plan gives the bytes vLLM's own draft load gives, and the backend retargets at the draft."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from weightplan.compiler.cli import compile_main
from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.digests import tensor_digests
from weightplan.compiler.verify_plan import shard_sources, verify_plan
from weightplan.runtime import PlanMismatchError, execute_local, load_plan

from ..conftest import config_dir

MTP_MODELS = ("tiny-glm", "tiny-deepseek-v3")


@pytest.fixture(scope="module")
def draft_plans(tmp_path_factory):
    """(model, inference) -> a draft plan compiled once for this module."""
    root = tmp_path_factory.mktemp("draft")
    cache = {}

    def compile(model: str, inference: str = "tp=1", trainer: str = "fsdp=1"):
        key = (model, inference, trainer)
        if key not in cache:
            out = root / f"{model}-{inference}-{trainer}.plan".replace("=", "").replace(",", "_")
            compile_plan(CompileOptions(str(config_dir(model)), output=out, trainer=trainer, inference=inference, draft=True))
            cache[key] = out
        return cache[key]

    return compile


def vllm_engine_models(model: str, device: str = "cpu"):
    """(vllm_config, target, draft) as a vLLM engine with MTP speculative decoding builds them, on `device`.

    One VllmConfig with the speculative config, the target and then the draft built from it
    (the proposer's `get_model(vllm_config, model_config=draft_model_config)`); the draft's
    embedding and LM head are then shared with the target by vLLM's own proposer code.
    """
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from weightplan.compiler.frontend.vllm_model import ensure_single_process_distributed, make_vllm_config
    from weightplan.compiler.frontend.vllm_patches import clear_layer_registry, model_build, parallel_rank

    vllm_config = make_vllm_config(config_dir(model), draft=True)
    draft_config = vllm_config.speculative_config.draft_model_config
    assert draft_config.architectures[0] in ("DeepseekV32MTPModel", "DeepSeekMTPModel")
    ensure_single_process_distributed(vllm_config)
    clear_layer_registry(vllm_config)
    with parallel_rank(vllm_config), model_build(), set_default_torch_dtype(draft_config.dtype), torch.device(device):
        target = initialize_model(vllm_config=vllm_config)
        draft = initialize_model(vllm_config=vllm_config, model_config=draft_config)
    return vllm_config, target, draft


def share_like_vllm(vllm_config, target, draft) -> None:
    """vLLM's proposer's sharing step after loading (llm_base_proposer.py, MTP branch), run on these models."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = SimpleNamespace(model=draft, vllm_config=vllm_config, use_local_argmax_reduction=False)
    SpecDecodeBaseProposer._maybe_share_embeddings(proposer, target)
    SpecDecodeBaseProposer._maybe_share_lm_head(proposer, target)


def random_checkpoint(model: str, plan, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors for every checkpoint name the trainer holds: the target's (transformers') and the plan's MTP ones."""
    from weightplan.compiler.frontend.trainer_formats import load_trainer_model

    generator = torch.Generator().manual_seed(seed)
    specs = list(load_trainer_model(config_dir(model), torch.bfloat16).checkpoint.values()) + list(plan.sources)
    return {s.name: torch.randn(s.shape, generator=generator).to(getattr(torch, s.dtype)) for s in specs}


@pytest.mark.parametrize("model", MTP_MODELS)
def test_draft_plan_matches_vllms_own_draft_load(draft_plans, model):
    """vLLM loads the whole checkpoint into its draft and shares the target's embedding and LM head;
    the draft plan, executed by the host executor on the trainer's MTP tensors, gives every other
    draft parameter byte for byte (compute_tensor_digests), and leaves exactly the shared ones out."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    from weightplan.compiler.frontend.vllm_patches import host_independent, parallel_rank

    plan = load_plan(draft_plans(model))
    checkpoint = random_checkpoint(model, plan, seed=7)
    vllm_config, target, draft = vllm_engine_models(model)
    with torch.no_grad(), host_independent(), parallel_rank(vllm_config):
        target.load_weights(iter(checkpoint.items()))
        draft.load_weights(iter(checkpoint.items()))
    share_like_vllm(vllm_config, target, draft)

    planned = {e.name: torch.full(e.shape, float("nan"), dtype=getattr(torch, e.dtype)) for e in plan.dests}
    execute_local(plan, shard_sources(plan, checkpoint, {0}), {0: planned})
    expected, actual = compute_tensor_digests(draft), tensor_digests(planned)
    assert actual == {name: expected[name] for name in planned}
    shared = set(expected) - set(planned)
    assert shared == set(plan.header.inference.draft.shared_with_target) == {
        "model.embed_tokens.weight", f"model.layers.{target.config.num_hidden_layers}.shared_head.head.weight"}
    targets = {id(p) for p in target.parameters()}
    assert all(id(draft.get_parameter(name)) in targets for name in shared)  # the target's plan writes them
    assert plan.header.architecture == vllm_config.speculative_config.draft_model_config.architectures[0]


@pytest.mark.parametrize("model,inference,trainer", [("tiny-glm", "tp=1", "fsdp=1"), ("tiny-glm", "tp=2", "fsdp=2"),
                                                     ("tiny-deepseek-v3", "tp=1,dp=2,ep", "fsdp=2")])
def test_verify_plan_checks_draft_plans_against_vllms_draft(draft_plans, model, inference, trainer):
    path = draft_plans(model, inference, trainer)
    plan = load_plan(path)
    result = verify_plan(path, model=str(config_dir(model)), seed=3)
    assert result.mismatches == () and result.tensors == sum(len(e.ranks) for e in plan.dests)
    assert all(".mtp_block." in e.name or "shared_head.norm" in e.name or e.name.split(".")[3] in ("enorm", "hnorm", "eh_proj")
               for e in plan.dests)


def test_draft_plan_path_and_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert compile_main(["--model", str(config_dir("engine-deepseek-v3")), "--draft"]) == 2
    assert "error: --draft needs MTP layers" in capsys.readouterr().err
    for extra in (["--trainer-format", "stacked"], ["--quant", "fp8_per_block"]):
        assert compile_main(["--model", str(config_dir("tiny-glm")), "--draft", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --draft") and "Traceback" not in err
    from weightplan.compiler.compile import default_plan_path
    from weightplan.runtime.plan.header import DraftHeader, InferenceHeader, TrainerHeader

    assert default_plan_path("glm-5.2", TrainerHeader("hf", "bf16", "fsdp64", ()),
                             InferenceHeader("tp1-dp32-ep", 1, 32, True, "cpu", draft=DraftHeader("mtp", ())), "none").name == \
        "mtp-hf-bf16-fsdp64__tp1-dp32-ep__none.plan"


# --- the backend: start_draft_weight_update retargets updates at the draft -----------------------------------------

class HostReceiver:
    """Stands for the runtime's Receiver: `sync(v)` writes what the plan gives for this rank (host executor) from `shards[v]`."""

    made: list["HostReceiver"] = []
    shards: dict[str, dict[int, dict]] = {}  # job -> version -> trainer shards

    def __init__(self, plan, rank, destination, *, rendezvous, timeout, verify, derived, delta=0.0, pool_ranks=None,
                 expert_map=None):
        self.plan, self.rank, self.destination, self.job = plan, rank, destination, rendezvous.job
        self.expert_map = expert_map
        self.version, self.started, self.closed = None, False, False
        HostReceiver.made.append(self)

    def start(self):
        self.started = True
        return self

    def sync(self, version):
        execute_local(self.plan, HostReceiver.shards[self.job][version], {self.rank: self.destination})
        self.version = version
        return SimpleNamespace(bytes=sum(e.nbytes for e in self.plan.dests), descriptors=len(self.plan.table["dest"]),
                               took="full", delta_trainers=(), delta_bytes=0)

    def close(self):
        self.closed = True


@pytest.fixture
def host_engine(monkeypatch, plan_cache, draft_plans):
    """A WeightplanWeightTransferEngine on the CPU target of tiny-glm (no engine process), Receivers replaced by HostReceiver."""
    from weightplan.vllm_backend import engine as engine_module

    HostReceiver.made = []
    monkeypatch.setattr(engine_module, "Receiver", HostReceiver)
    monkeypatch.setattr(engine_module.Rendezvous, "connect", classmethod(lambda cls, job, address, timeout: SimpleNamespace(job=job)))
    vllm_config, target, draft = vllm_engine_models("tiny-glm")
    share_like_vllm(vllm_config, target, draft)
    engine = engine_module.WeightplanWeightTransferEngine(SimpleNamespace(backend="weightplan"), vllm_config, torch.device("cpu"),
                                                          target)
    plans = SimpleNamespace(target=plan_cache("tiny-glm"), draft=draft_plans("tiny-glm"))
    yield engine, vllm_config, target, draft, plans
    engine.shutdown()


def _start_draft(engine, vllm_config, draft):
    """What vLLM's worker does for start_draft_weight_update (gpu_worker.py: _start_weight_update(is_draft=True))."""
    assert engine.supports_draft_weight_update
    engine.set_weight_update_target(draft, vllm_config.speculative_config.draft_model_config)
    try:
        engine.start_weight_update()
    except BaseException:
        engine.reset_weight_update_target()
        raise


def test_backend_draft_updates_land_in_the_draft_only(host_engine):
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    from weightplan.compiler.frontend.vllm_patches import host_independent, parallel_rank

    engine, vllm_config, target, draft, plans = host_engine
    info = {"plan": str(plans.target), "address": "127.0.0.1:1", "job": "j"}
    engine.init_transfer_engine(engine.parse_init_info(info))
    assert not engine.supports_draft_weight_update  # no draft_plan given: vLLM refuses start_draft_weight_update
    engine.shutdown()
    engine.init_transfer_engine(engine.parse_init_info({**info, "draft_plan": [str(plans.target), str(plans.draft)]}))
    assert engine.supports_draft_weight_update and engine.draft is None  # joined at the first draft update
    target_plan, draft_plan = load_plan(plans.target), load_plan(plans.draft)
    checkpoint = random_checkpoint("tiny-glm", draft_plan, seed=11)
    HostReceiver.shards = {"j": {1: shard_sources(target_plan, checkpoint, {0})},
                           "j.draft": {1: shard_sources(draft_plan, checkpoint, {0})}}

    engine.start_weight_update()
    engine.update_weights({"version": 1})
    engine.finish_weight_update()
    target_buffers = {k: v.clone() for k, v in engine.target.destination.tensors.items()}

    _start_draft(engine, vllm_config, draft)
    side = engine.draft
    assert side is engine.side and side.model is draft and side.plan.fingerprint == draft_plan.fingerprint
    assert HostReceiver.made[-1].job == "j.draft" and HostReceiver.made[-1].rank == 0 and HostReceiver.made[-1].started
    with host_independent():  # the staged apply re-runs the layers' post-load steps, kernel choices pinned
        engine.update_weights({"version": 1})
    engine.finish_weight_update()
    engine.reset_weight_update_target()  # what the worker does after finish
    assert engine.side is engine.target
    assert all(torch.equal(target_buffers[k], v) for k, v in engine.target.destination.tensors.items())

    # The draft's landed bytes (loader layout, before any packing) equal vLLM's own draft load of the same checkpoint.
    reference_config, reference_target, reference = vllm_engine_models("tiny-glm")
    with torch.no_grad(), host_independent(), parallel_rank(reference_config):
        reference.load_weights(iter(checkpoint.items()))
    expected = compute_tensor_digests(reference)
    landed = tensor_digests(side.destination.tensors)
    assert landed == {name: expected[name] for name in landed} and len(landed) == len(draft_plan.dests)
    # Parameters the draft's post-load step keeps (norms, the plain eh_proj) are live now.
    for name in ("model.layers.5.enorm.weight", "model.layers.5.hnorm.weight", "model.layers.5.shared_head.norm.weight"):
        assert torch.equal(draft.get_parameter(name), reference.get_parameter(name))
    info = engine.info()
    assert info["draft"]["version"] == 1 and info["draft"]["plan"] == draft_plan.fingerprint and info["version"] == 1


def test_backend_refuses_a_draft_plan_for_the_target_and_a_target_plan_for_the_draft(host_engine):
    engine, vllm_config, target, draft, plans = host_engine
    info = {"plan": str(plans.draft), "address": "127.0.0.1:1", "job": "j"}
    with pytest.raises(PlanMismatchError, match="draft plan .*give it as init_info field 'draft_plan'"):
        engine.init_transfer_engine(engine.parse_init_info(info))
    engine.init_transfer_engine(engine.parse_init_info({**info, "plan": str(plans.target), "draft_plan": str(plans.target)}))
    with pytest.raises(PlanMismatchError, match="no draft plan .*this is not a draft plan"):
        _start_draft(engine, vllm_config, draft)
    assert engine.side is engine.target and engine.draft is None and len(HostReceiver.made) == 1


def test_backend_refuses_a_draft_whose_shared_tensors_are_its_own(host_engine):
    """With the draft's own embedding (vLLM does that with several pipeline stages) the draft plan would leave it stale."""
    engine, vllm_config, target, draft, plans = host_engine
    draft.model.embed_tokens = torch.nn.Embedding(*target.model.embed_tokens.weight.shape, dtype=torch.bfloat16)
    engine.init_transfer_engine(engine.parse_init_info({"plan": str(plans.target), "address": "127.0.0.1:1", "job": "j",
                                                        "draft_plan": str(plans.draft)}))
    with pytest.raises(PlanMismatchError, match="model.embed_tokens.weight are its own, not the target's"):
        _start_draft(engine, vllm_config, draft)
    assert engine.side is engine.target and engine.draft is None
