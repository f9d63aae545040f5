"""Parameters vLLM's load_weights never writes: listed in the plan when vLLM's own loader serves them unwritten, else refused.

A parameter no checkpoint tensor reaches keeps the value vLLM's model initialises it to, after
vLLM's own load as after any weight update; a plan cannot change it either. vLLM's
`DefaultModelLoader.track_weights_loading` decides whether a checkpoint may leave a parameter
unwritten: parameters of modules with a quantization method (every linear and MoE layer) may,
any other parameter makes vLLM refuse the checkpoint ("Following weights were not initialized
from checkpoint"). The compiler applies the same rule with vLLM's own code: such a parameter is
taken out of the plan's destinations and listed in the header's `inference.unloaded` (verify-plan
checks that vLLM's load leaves it untouched); any other wholly unwritten parameter is refused.
"""

from __future__ import annotations

import dataclasses

from ..layer_names import layer_of, rename
from .errors import UnloadedParameterError


def split_unloaded(model, vllm_config, load, rank: int):
    """`load` without the parameters vLLM's load never writes and vLLM's loader accepts unwritten (in `load.unloaded`).

    Raises UnloadedParameterError for wholly unwritten parameters vLLM's own loader refuses. A
    parameter load_weights reports as loaded although no write was traced stays a destination
    (the coverage check then names the untraced write).
    """
    written = {a.dest for a in load.assignments}
    template_of = {r.member: r.template for r in load.layer_reuse}
    written |= {rename(n, r.template, r.member) for r in load.layer_reuse for n in list(written)}
    unwritten = [d for d in load.dests if d.name not in written and not _claimed(d.name, load.claimed, template_of)]
    if not unwritten:
        return load
    refused = [d.name for d in unwritten if not vllm_loader_accepts_unwritten(model, vllm_config, d.name)]
    if refused:
        more = f" and {len(refused) - 3} more" if len(refused) > 3 else ""
        raise UnloadedParameterError(
            f"vLLM's {type(model).__name__}.load_weights writes no checkpoint tensor into {', '.join(refused[:3])}{more} "
            f"(inference rank {rank}), and vLLM's own loader refuses such a checkpoint too (\"Following weights were not "
            "initialized from checkpoint\"): the trainer's checkpoint tensors lack one vLLM needs or name it differently")
    names = {d.name for d in unwritten}
    return dataclasses.replace(load, dests=[d for d in load.dests if d.name not in names],
                               unloaded=tuple(dataclasses.replace(d, ranks=(rank,)) for d in unwritten))


def _claimed(name: str, claimed: frozenset, template_of: dict) -> bool:
    """load_weights reported `name` (or, in a layer traced through its template, the template's name) as loaded."""
    layer = layer_of(name)
    return name in claimed or (layer in template_of and rename(name, layer, template_of[layer]) in claimed)


def vllm_loader_accepts_unwritten(model, vllm_config, name: str) -> bool:
    """Whether vLLM's DefaultModelLoader serves a checkpoint that leaves parameter `name` unwritten (its own check)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    others = {n for n, _ in model.named_parameters()} - {name}
    try:
        DefaultModelLoader(vllm_config.load_config).track_weights_loading(
            model, others, quantized=vllm_config.model_config.quantization is not None)
    except ValueError:
        return False
    return True
