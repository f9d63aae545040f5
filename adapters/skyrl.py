"""SkyRL's weight sync through weightplan: `install()` makes `weight_sync_backend="weightplan"` a SkyRL backend."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any, ClassVar

from .live_plan import broadcast_json, compile_live_plan, group_device
from .settings import PublishSettings
from .shim import Shim
from .startup import trainer_init_info

TESTED_SKYRL = "0.4.0"
BACKEND = "weightplan"  # SkyRL's `generator.inference_engine.weight_sync_backend`, and the vLLM receive backend
TRAINER_BACKEND = "skyrl_weightplan"  # the trainer-factory key of the engine below (SkyRL's capabilities added)

_SYNC = "skyrl.backends.skyrl_train.weight_sync"
_SENDERS = f"{_SYNC}.weight_senders"
# The SkyRL code this module wraps (the first three) or relies on (build_trainer_engine calls the two names below by
# module global, after building the source; FsdpWeightSource's `model` and `weight_prefix` are read), by SHA-256 of
# its source text. `install()` refuses, in one line naming the function, a SkyRL whose code differs.
SHIMMED = {
    f"{_SYNC}:get_transfer_strategy":
        "509f06ad095f7e1ff320577f2d990e89fccb5ebd2ac51ffc0597dc288f0ce51c",
    f"{_SYNC}:get_vllm_receive_backend":
        "6e377158e5d5c4cd3470bd430ccb1e6e2219dec80a7c6353f3e7cb081772f359",
    f"{_SENDERS}:_build_sender_init_info":
        "7a9af5fe8962aee3e53435fd8aa1d8efb5dc129024703c9b3ca11b4c8ad3fec1",
    f"{_SENDERS}:build_trainer_engine":
        "c04ab7399f2c86145603d288444aa78d66421251026d49d36f2102ac8ca4c119",
    f"{_SYNC}.sources:FsdpWeightSource":
        "281a88395932a876d9bd1447954b6aca46489a8f1d88ac0ecc2a93493d356696",
}
_WRAPPED = (f"{_SYNC}:get_transfer_strategy", f"{_SYNC}:get_vllm_receive_backend", f"{_SENDERS}:_build_sender_init_info")



def _changed(target: str) -> RuntimeError:
    return RuntimeError(f"weightplan's SkyRL adapter was read against skyrl {TESTED_SKYRL}'s {target}, which this "
                        f"skyrl ({_skyrl_version()}) changed; re-read it against weightplan/adapters/skyrl.py")


_SHIM = Shim("skyrl", SHIMMED, _changed)
_ORIGINALS = _SHIM.originals  # target -> SkyRL's own function, while installed


@dataclass
class WeightplanSettings(PublishSettings):
    """Where and how the trainers publish. Every field has a default; `plan=None` compiles one.

    `plan`: a compiled plan for this trainer layout against the inference engine's; None: trainer rank 0 writes the
    live FSDP2 model's layout when SkyRL builds its trainer engine (`init_weight_sync_state`, before the first sync) and
    runs `compile-plan --trainer-format stacked --model <policy model path> --inference tp=T[,ep]` (T: the inference
    engine's `tensor_parallel_size`). `address`: the rendezvous store trainer rank 0 hosts (port 0: a free one; the
    inference workers connect to it). `workdir`: where the layout and the compiled plan go (default a temporary
    directory); the inference workers read the plan from that path, so off one host it must be a shared directory.
    """

    job: str = "skyrl"


_settings = WeightplanSettings()


def install(settings: WeightplanSettings | None = None) -> None:
    """Make `weight_sync_backend="weightplan"` resolve to weightplan on both sides of SkyRL, in this process.

    The inference servers SkyRL builds then get `WeightTransferConfig(backend="weightplan")`, and SkyRL's
    `build_trainer_engine` a weightplan trainer engine over the policy's own FSDP2 shards. Every other backend resolves
    as before. Refuses, in one line naming it, a SkyRL function that is not the code this module was read against.
    Idempotent (a second call only replaces the settings).
    """
    global _settings
    with _SHIM.lock:
        if settings is not None:
            _settings = settings
        if _SHIM.installed:
            return
        originals = _SHIM.checked(SHIMMED)
        from weightplan.vllm_backend.plugin import register

        register()  # the driver validates WeightTransferConfig.backend against vLLM's receive registry
        _register_trainer_engine()
        _ORIGINALS.update({t: originals[t] for t in _WRAPPED})
        wrappers = {f"{_SYNC}:get_transfer_strategy": get_transfer_strategy,
                    f"{_SYNC}:get_vllm_receive_backend": get_vllm_receive_backend,
                    f"{_SENDERS}:_build_sender_init_info": _build_sender_init_info}
        for target, wrapper in wrappers.items():
            _SHIM.rebind(_ORIGINALS[target], wrapper)


# -- reaching SkyRL's Ray workers: one environment variable in the driver --------------------------------------------

RAY_HOOK = "weightplan.adapters.skyrl.ray_runtime_env"  # the value of Ray's RAY_RUNTIME_ENV_HOOK in the driver
WORKER_HOOK = "weightplan.adapters.skyrl.install_in_worker"  # the runtime env's worker_process_setup_hook
SETTINGS_ENV = "WEIGHTPLAN_SKYRL_SETTINGS"  # the driver's WeightplanSettings, as JSON, in every worker's environment


def ray_runtime_env(runtime_env: dict | None) -> dict:
    """Ray calls this at `ray.init` (SkyRL's `initialize_ray`) when the driver runs with
    `RAY_RUNTIME_ENV_HOOK=weightplan.adapters.skyrl.ray_runtime_env`: `install()` here, in the driver, and the job's
    runtime env returned with `install_in_worker` as every Ray worker's setup hook and the driver's settings in its
    environment, so each policy worker and engine actor installs before SkyRL code runs in it. A runtime env that
    already names another setup hook is refused in one line."""
    install()
    env = dict(runtime_env or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, WORKER_HOOK):
        raise ValueError(f"weightplan's SkyRL adapter sets Ray's worker_process_setup_hook, which this job's runtime env "
                         f"already sets to {hook!r}: call weightplan.adapters.skyrl.install() from that hook instead")
    env["worker_process_setup_hook"] = WORKER_HOOK
    env["env_vars"] = {**(env.get("env_vars") or {}), SETTINGS_ENV: json.dumps(asdict(_settings))}
    return env


def install_in_worker() -> None:
    """A Ray worker's setup hook (set by `ray_runtime_env`): `install()` with the driver's settings."""
    install(WeightplanSettings.from_json(os.environ.get(SETTINGS_ENV, "{}"), SETTINGS_ENV))


def uninstall() -> None:
    """Put SkyRL's own functions back everywhere `install()` rebound them (the trainer engine stays registered)."""
    _SHIM.uninstall()


def installed() -> bool:
    return _SHIM.installed


# -- the wrappers: "weightplan" is ours, every other name goes to SkyRL's own function ---------------------------------

def get_transfer_strategy(weight_sync_backend: str, colocate_all: bool) -> str:
    if weight_sync_backend == BACKEND:
        return BACKEND
    return _ORIGINALS[f"{_SYNC}:get_transfer_strategy"](weight_sync_backend, colocate_all)


def get_vllm_receive_backend(weight_sync_backend: str, colocate_all: bool) -> str:
    if weight_sync_backend == BACKEND:
        return BACKEND  # the `weightplan` vLLM backend (weightplan.vllm_backend), registered by vLLM's plugin loader
    return _ORIGINALS[f"{_SYNC}:get_vllm_receive_backend"](weight_sync_backend, colocate_all)


def _build_sender_init_info(*, backend: str, **kwargs):
    if backend != BACKEND:
        return _ORIGINALS[f"{_SENDERS}:_build_sender_init_info"](backend=backend, **kwargs)
    return sender_init_info(**kwargs), None  # None: SkyRL's client sends the one init dict to its server


def sender_init_info(*, ie_cfg, rank: int, inference_world_size: int, dtype, server_urls: list,
                     data_parallel_size: int, base_model_path: str | None):
    """This trainer rank's `SkyrlWeightplanInitInfo`; a SkyRL setting the plan cannot serve is refused in one line."""
    if len(server_urls) != 1:
        raise ValueError(f"weightplan's SkyRL adapter syncs one inference server (one vLLM engine), this run has "
                         f"{len(server_urls)}: set generator.inference_engine.num_engines=1 and data_parallel_size=1")
    if getattr(ie_cfg, "pipeline_parallel_size", 1) != 1:
        raise ValueError("weightplan's SkyRL adapter: generator.inference_engine.pipeline_parallel_size must be 1 "
                         "(a plan's inference layout is tp[,ep])")
    if getattr(ie_cfg, "speculative_config", None) is not None:
        raise ValueError("weightplan's SkyRL adapter does not sync a spec-decode drafter: unset "
                         "generator.inference_engine.speculative_config")
    s = _settings
    inference = f"tp={ie_cfg.tensor_parallel_size}" + (",ep" if ie_cfg.expert_parallel_size > 1 else "")
    if s.plan is None and not base_model_path:
        raise ValueError("weightplan's SkyRL adapter compiles its plan from trainer.policy.model.path, which is unset "
                         "(or pass WeightplanSettings(plan=...) to install())")
    return trainer_init_info(s, rank=rank, plan=s.plan or "", address=s.address, info_cls=_trainer_classes()[0],
                             serve_store=True, model=base_model_path or "", inference=inference,
                             workdir=s.workdir or "", inference_world_size=inference_world_size)


# -- the trainer engine SkyRL's WeightTransferTrainerFactory builds for "weightplan" -------------------------------

_CLASSES: list = []


def _trainer_classes():
    """(SkyrlWeightplanInitInfo, SkyrlWeightplanTrainerEngine), built once: they subclass vLLM-importing classes."""
    if _CLASSES:
        return _CLASSES
    from skyrl.backends.skyrl_train.weight_sync.weight_senders import SkyrlTrainerCapabilities

    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    @dataclass
    class SkyrlWeightplanInitInfo(WeightplanTrainerInitInfo):
        """WeightplanTrainerInitInfo plus what compiling the plan at the engine's build needs."""

        backend: ClassVar[str] = TRAINER_BACKEND
        model: str = ""  # the policy's HF model directory
        inference: str = "tp=1"  # compile-plan --inference
        workdir: str = ""
        inference_world_size: int = 1  # the server's ranks (SkyRL asks the server); the plan's must match

    class SkyrlWeightplanTrainerEngine(SkyrlTrainerCapabilities, WeightplanTrainerEngine):
        """weightplan's trainer engine over the FSDP2 module of SkyRL's FsdpWeightSource (its shards, never
        `full_tensor()`), with the capability flags SkyRL's worker reads. Rank 0 compiles the plan unless one is
        given, serves the store and drives the server; the plan's path and the store's address reach the other ranks
        over the trainer's default group."""

        init_info_cls = SkyrlWeightplanInitInfo
        skyrl_empty_cache_after_send = False  # nothing is staged: the plan reads the parameters themselves

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None, draft_source=None):
            if draft_source is not None:
                raise ValueError("weightplan's SkyRL adapter does not sync a spec-decode drafter")
            module = fsdp_module(source)
            device = group_device()
            if init_info.rank == 0:
                shared = {"plan": init_info.plan or _compile(module, init_info), "address": init_info.address}
            else:
                shared = broadcast_json({}, device)
            info = WeightplanTrainerInitInfo(rank=init_info.rank, plan=shared["plan"], address=shared["address"],
                                             job=init_info.job, timeout=init_info.timeout, verify=init_info.verify,
                                             delta=init_info.delta, serve_store=init_info.rank == 0)
            _check_world(info.plan, init_info.inference_world_size)
            engine = super().trainer_init(info, client=client, source=ShardSource(module))  # vLLM 0.30's API
            if init_info.rank == 0:
                broadcast_json({**shared, "address": info.address}, device)  # rank 0 serves the store by now
            return engine

    _CLASSES.extend((SkyrlWeightplanInitInfo, SkyrlWeightplanTrainerEngine))
    return _CLASSES


def fsdp_module(source):
    """The FSDP2 policy module behind SkyRL's FsdpWeightSource; any other source is refused in one line."""
    from skyrl.backends.skyrl_train.weight_sync.sources import FsdpWeightSource

    if type(source) is not FsdpWeightSource:
        raise TypeError(f"weightplan's SkyRL adapter publishes an FSDP2 policy's shards (trainer.strategy fsdp2, "
                        f"SkyRL's FsdpWeightSource); this trainer's weight source is {type(source).__name__}")
    if source.weight_prefix:
        raise ValueError(f"weightplan's SkyRL adapter: weight prefix {source.weight_prefix!r} (a CausalLM backbone "
                         "synced into a multimodal vLLM model) is not covered by the plan")
    return source.model


def _compile(module, init_info) -> str:
    """Trainer rank 0: the live module's layout, compiled against the server's layout (adapters/live_plan.py)."""
    return compile_live_plan(module, init_info.model, init_info.inference, init_info.workdir, "skyrl.plan")


def _check_world(plan_path: str, inference_world_size: int) -> None:
    from weightplan.runtime import load_plan

    ranks = load_plan(plan_path).header.inference.ranks
    if ranks != inference_world_size:
        raise ValueError(f"weightplan's SkyRL adapter: plan {plan_path} serves {ranks} inference ranks, the server has "
                         f"{inference_world_size} (generator.inference_engine.tensor_parallel_size)")


def _register_trainer_engine() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if TRAINER_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(TRAINER_BACKEND, _trainer_classes()[1])


# -- install()'s plumbing ------------------------------------------------------------------------------------------

def _skyrl_version() -> str:
    try:
        return metadata.version("skyrl")
    except metadata.PackageNotFoundError:
        return "not installed"
