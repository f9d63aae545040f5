"""prime-rl's weight broadcast through weightplan: `install()` makes its filesystem protocol carry weightplan syncs."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, Callable

from weightplan.runtime.errors import WeightplanError

from .live_plan import broadcast_json, compile_live_plan, group_device
from .settings import PublishSettings
from .shim import Shim

TESTED_PRIME_RL = "559b44772e471d1538537b8805cc77f3824a5e64"  # PrimeIntellect-ai/prime-rl main, 2026-08-21
BACKEND = "weightplan"  # the vLLM weight-transfer backend the inference server must run
RECORD = "weightplan.json"  # what trainer rank 0 writes into a step's broadcast directory before prime-rl's STABLE
WORKER_EXTENSION = "weightplan.adapters.prime_rl.WeightplanWeightUpdateWorker"
PROTOCOL = "filesystem"  # prime-rl's `[weight_broadcast] type` whose orchestrator protocol the syncs ride on

_WEIGHTS = "prime_rl.transports.weights"
_SERVER = "prime_rl.inference.vllm.server"
# The prime-rl code this module wraps (setup_weight_broadcast), subclasses (WeightBroadcast), changes one entry of the
# table of (WORKER_EXTENSION_CLS, read by `server`) or calls as the fallback of a directory without our record
# (FileSystemWeightUpdateWorker), by SHA-256 of its source text. `install()` refuses, in one line naming the function,
# a prime-rl whose code differs.
SHIMMED = {
    f"{_WEIGHTS}:setup_weight_broadcast":
        "981720a6a3d8df304550aac4a79a8bc0e79bfd782ee66cdf122dd0068800a209",
    f"{_WEIGHTS}.base:WeightBroadcast":
        "744578e3f923e8680cddc9d62056f561dcdf80872e9539e39ad734bbe4aefab6",
    f"{_SERVER}:server":
        "79e101ac6c8895e0e0a229b13c57e919c14021fcce93ede5d7b4efd35c04ad59",
    "prime_rl.inference.vllm.worker.filesystem:FileSystemWeightUpdateWorker":
        "cdf6499e0a77fe977837be95a9d20fdd83503b825403eca049865d5143d65e92",
}
SIDES = {"trainer": (f"{_WEIGHTS}:setup_weight_broadcast", f"{_WEIGHTS}.base:WeightBroadcast"),
         "inference": (f"{_SERVER}:server", "prime_rl.inference.vllm.worker.filesystem:FileSystemWeightUpdateWorker")}


class PrimeRlSettingError(WeightplanError, ValueError):
    """A prime-rl setting weightplan's broadcast cannot serve (one line naming it)."""


def _changed(target: str) -> PrimeRlSettingError:
    return PrimeRlSettingError(f"weightplan's prime-rl adapter was read against prime-rl {TESTED_PRIME_RL[:12]}'s "
                               f"{target}, which this prime-rl changed; re-read it against weightplan/adapters/prime_rl.py")


_SHIM = Shim("prime_rl", SHIMMED, _changed)
_ORIGINALS = _SHIM.originals  # target -> prime-rl's own object, while installed


@dataclass
class PrimeRlSettings(PublishSettings):
    """Where and how the trainers publish. Every field has a default; `plan=None` compiles one (then `model` is needed).

    `plan`: a compiled plan for this trainer layout against the inference server's; None: trainer rank 0 writes the
    live FSDP2 model's layout at the first broadcast and runs `compile-plan --trainer-format stacked --model MODEL
    --inference INFERENCE` (`model`: the HF model directory, prime-rl's `model.name` as a local path; `inference`: the
    server's layout, e.g. `tp=2` or `tp=1,dp=2,ep`). `address`: the rendezvous store trainer rank 0 hosts (port 0: a
    free one); the vLLM workers read it, with the plan's path, from the step's record, so off one host set a reachable
    address and a shared `workdir`.
    """

    job: str = "prime-rl"
    model: str | None = None
    inference: str = "tp=1"


_settings = PrimeRlSettings()


def install(settings: PrimeRlSettings | None = None, *, side: str = "both") -> None:
    """Make prime-rl's `[weight_broadcast] type = "filesystem"` carry weightplan syncs in this process.

    `side="trainer"` (the trainer processes): `setup_weight_broadcast` builds weightplan's broadcast for a filesystem
    config (every other type as before). `side="inference"` (the process that runs prime-rl's `server()`): the vLLM
    workers get weightplan's worker extension for the filesystem type, which pulls a step whose broadcast directory
    holds our record and loads any other directory as prime-rl's own filesystem worker does. `"both"`: both.
    Refuses, in one line naming it, a prime-rl function that is not the code this module was read against; idempotent
    (a second call only replaces the settings).
    """
    global _settings
    if side not in ("trainer", "inference", "both"):
        raise PrimeRlSettingError(f"weightplan's prime-rl adapter: install(side=...) takes 'trainer', 'inference' or "
                                  f"'both', got {side!r}")
    with _SHIM.lock:
        if settings is not None:
            _settings = settings
        targets = [t for s, ts in SIDES.items() if side in (s, "both") for t in ts if t not in _ORIGINALS]
        originals = _SHIM.checked(targets)
        _ORIGINALS.update(originals)
        if f"{_WEIGHTS}:setup_weight_broadcast" in originals:
            _SHIM.rebind(originals[f"{_WEIGHTS}:setup_weight_broadcast"], setup_weight_broadcast)
        if f"{_SERVER}:server" in originals:
            _SHIM.replace(import_module(_SERVER).WORKER_EXTENSION_CLS, PROTOCOL, WORKER_EXTENSION)


def uninstall() -> None:
    """Put back everything `install()` changed."""
    _SHIM.uninstall()


def installed() -> bool:
    return _SHIM.installed


# -- trainer side ----------------------------------------------------------------------------------------------------

def setup_weight_broadcast(output_dir, config, parallel_dims, lora_config=None):
    """prime-rl's `setup_weight_broadcast` with the filesystem type built as weightplan's broadcast."""
    if getattr(config, "type", None) != PROTOCOL:
        return _ORIGINALS[f"{_WEIGHTS}:setup_weight_broadcast"](output_dir, config, parallel_dims, lora_config)
    return _prime_broadcast_class()(output_dir, _settings, parallel_dims, lora_config)


class WeightplanBroadcast:
    """The trainer side of a prime-rl run on weightplan, without prime-rl's classes (which subclass it).

    `broadcast_weights(model, step)` (every trainer rank, after each optimizer step, as prime-rl calls it): at the
    first call compile the live model's plan (rank 0) and register this rank's FSDP2/EP shards (`LiveSender`, never
    `full_tensor()`); then publish version `step + 1` (versions start at 1, prime-rl's startup broadcast is step 0);
    rank 0 writes the record (`RECORD`: the version and the vLLM workers' init info) and prime-rl's `STABLE` marker
    into the step's broadcast directory, which prime-rl's orchestrator waits for before it pauses the servers and
    posts `/update_weights` with that directory; every rank returns once the inference workers have read the version
    (or `settings.timeout` passed: prime-rl's filesystem orchestrator does not read the last versions of a run, and a
    version nobody read is retired with a warning).
    """

    def __init__(self, output_dir, settings: PrimeRlSettings, *, pp: int = 1, lora=None,
                 step_dir: Callable[[int], Path] | None = None) -> None:
        if lora is not None:
            raise PrimeRlSettingError("weightplan's prime-rl broadcast syncs full weights; LoRA (trainer.model.lora) "
                                      "is not supported: unset it or leave weightplan's adapter uninstalled")
        if pp != 1:
            raise PrimeRlSettingError(f"weightplan's prime-rl broadcast: a pipeline-parallel trainer (pp={pp}) is not "
                                      "a layout the live plan covers; set trainer pp = 1")
        if settings.plan is None and not settings.model:
            raise PrimeRlSettingError("weightplan's prime-rl broadcast compiles its plan from PrimeRlSettings.model "
                                      "(the HF model directory), which is unset; or pass PrimeRlSettings(plan=...)")
        self.output_dir, self.settings = Path(output_dir), settings
        self.step_dir = step_dir or (lambda step: self.output_dir / "broadcasts" / f"step_{step}")
        self.engine = None
        self.worker_init: dict[str, Any] | None = None

    def broadcast_weights(self, model, step: int) -> None:
        import torch.distributed as dist

        first = self.engine is None
        if first:
            self.engine = self._start(model)
        version = step + 1
        sender = self.engine.sender
        sender.publish(version)
        if dist.is_initialized():
            dist.barrier()  # every rank announced `version` before the orchestrator is told
        if self.worker_init is not None:  # rank 0
            write_record(self.step_dir(step), version, self.worker_init)
        if first:  # a release waits only for the readers joined when it starts: the workers join at their first pull
            await_readers(sender, self.settings.timeout)
        sender.release(version)
        self.engine.version = version

    def _start(self, model):
        from weightplan.runtime import load_plan

        from .startup import start_engine, trainer_init_info

        import torch.distributed as dist

        s, device = self.settings, group_device()
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            plan = s.plan or compile_live_plan(model, s.model, s.inference,
                                               Path(s.workdir or tempfile.mkdtemp(prefix="weightplan-prime-rl-")),
                                               "prime-rl.plan")
            info = trainer_init_info(s, rank=0, plan=str(Path(plan).resolve()), address=s.address, serve_store=True,
                                     drives=False)
            engine = start_engine(info, model)  # serves the store: info.address is the bound one now
            self.worker_init = info.worker_init_info(load_plan(info.plan).fingerprint)
            broadcast_json({"plan": info.plan, "address": info.address}, device)
            return engine
        shared = broadcast_json({}, device)
        info = trainer_init_info(s, rank=rank, plan=shared["plan"], address=shared["address"], serve_store=False,
                                 drives=False)
        return start_engine(info, model)

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()


_CLASSES: list = []


def _prime_broadcast_class():
    """prime-rl's `WeightBroadcast` over `WeightplanBroadcast`, built once (it subclasses a prime-rl class)."""
    if _CLASSES:
        return _CLASSES[0]
    from prime_rl.transports.weights.base import WeightBroadcast
    from prime_rl.utils.pathing import get_broadcast_dir, get_step_path

    class WeightplanWeightBroadcast(WeightplanBroadcast, WeightBroadcast):
        """prime-rl's weight broadcast for weightplan (built by `setup_weight_broadcast` once `install()` ran)."""

        def __init__(self, output_dir, settings, parallel_dims, lora_config=None):
            WeightBroadcast.__init__(self, output_dir, lora_config)
            WeightplanBroadcast.__init__(self, output_dir, settings, pp=parallel_dims.pp, lora=lora_config,
                                         step_dir=lambda step: get_step_path(get_broadcast_dir(self.output_dir), step))

        def maybe_clean(self, step: int, interval_to_keep: int | None) -> None:
            """As prime-rl's filesystem broadcast: the step directory of two steps ago (only records and markers)."""
            from prime_rl.trainer.utils import maybe_clean

            maybe_clean(get_broadcast_dir(self.output_dir), step, interval_to_keep)

    _CLASSES.append(WeightplanWeightBroadcast)
    return WeightplanWeightBroadcast


def write_record(step_dir: Path, version: int, worker_init: dict[str, Any]) -> None:
    """The step's record, then prime-rl's STABLE marker (what its orchestrator waits for), each written whole."""
    step_dir.mkdir(parents=True, exist_ok=True)
    partial = step_dir / (RECORD + ".partial")
    partial.write_text(json.dumps({"version": version, "init": worker_init}, sort_keys=True))
    os.replace(partial, step_dir / RECORD)
    (step_dir / "STABLE").touch()


def await_readers(sender, timeout: float) -> None:
    """Until every inference rank reading this trainer rank's plan joined the job (their first pull)."""
    from weightplan.runtime import SyncError
    from weightplan.runtime.transport import protocol

    keys = [protocol.joined_key(rank) for rank in sender.readers]
    deadline = time.monotonic() + timeout
    while not all(sender.rendezvous.exists(key) for key in keys):
        if time.monotonic() > deadline:
            raise SyncError(f"weightplan's prime-rl broadcast: no vLLM worker joined within {timeout} s; is the "
                            "orchestrator running with [weight_broadcast] type = \"filesystem\", and the inference "
                            "server started after weightplan.adapters.prime_rl.install(side=\"inference\")?")
        time.sleep(0.01)


# -- inference side: the vLLM worker extension ----------------------------------------------------------------------

class WeightplanWeightUpdateWorker:
    """vLLM worker extension for prime-rl's server: `/update_weights` with a step's directory pulls that version.

    A directory holding weightplan's record is pulled through vLLM's weight-transfer API on this worker (the
    `weightplan` backend, docs/vllm.md): the first record initialises the backend, then start / update
    ({"version": v}) / finish. Any other directory (a checkpoint's weights on resume) is loaded as prime-rl's own
    filesystem worker loads it. vLLM mixes this class into its worker, so it adds no name the worker already has.
    """

    def init_broadcaster(self, *args, **kwargs) -> None:
        """prime-rl's orchestrator does not call it for the filesystem protocol; nothing to set up."""

    def liveness_probe(self) -> None:
        return None

    def update_weights_from_path(self, weight_path: str) -> None:
        record = read_record(weight_path)
        if record is None:
            from prime_rl.inference.vllm.worker.filesystem import FileSystemWeightUpdateWorker

            return FileSystemWeightUpdateWorker.update_weights_from_path(self, weight_path)
        pull(self, record)


def read_record(weight_path) -> dict[str, Any] | None:
    """The step's record (None: no record, a plain checkpoint directory); a malformed one is refused in one line."""
    path = Path(weight_path or "") / RECORD
    if not weight_path or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PrimeRlSettingError(f"weightplan's prime-rl worker: {path} is not a weightplan record ({exc})") from None
    version = record.get("version") if isinstance(record, dict) else None
    if (not isinstance(record, dict) or set(record) != {"version", "init"} or not isinstance(record["init"], dict)
            or isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise PrimeRlSettingError(f"weightplan's prime-rl worker: {path} holds {str(record)[:80]}, not "
                                  "{'version': <int >= 1>, 'init': {...}} as trainer rank 0 writes it")
    return record


def engine_backend(worker) -> str | None:
    """The weight-transfer backend this vLLM worker's engine was started with (None: none)."""
    transfer = getattr(getattr(worker, "vllm_config", None), "weight_transfer_config", None)
    return getattr(transfer, "backend", None) if transfer is not None else None


def pull(worker, record: dict[str, Any]) -> None:
    """Version `record["version"]` into this worker through vLLM's weight-transfer API (backend `weightplan`)."""
    backend = engine_backend(worker)
    if backend != BACKEND or getattr(worker, "weight_transfer_engine", None) is None:
        raise PrimeRlSettingError(f"prime-rl's inference server runs weight-transfer backend {backend!r}, not "
                                  f"'{BACKEND}': set [inference.vllm] weight_transfer_config = {{backend = "
                                  f"\"{BACKEND}\"}} (vLLM's --weight-transfer-config)")
    if worker.__dict__.get("_weightplan_init") != record["init"]:
        worker.init_weight_transfer_engine(record["init"])
        worker.__dict__["_weightplan_init"] = record["init"]
    worker.start_weight_update()
    worker.update_weights({"version": record["version"]})
    worker.finish_weight_update()
