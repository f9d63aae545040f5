"""The inference side of examples/rl_loop.py: a vLLM engine with the weightplan backend, or a Receiver into a vLLM model.

Both have the same surface: `__init__(config, workdir)` (while the trainers start, as an engine
starts), `connect(plan, plan_path, rendezvous, timeout=, verify=)`, then every step
`update(version) -> dict`, `generate(prompts, n)` and, with `--check`, `check(full, tokens, n, last)`
against ground truth computed from the trainer's gathered full state dict; finally `close()`.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from weightplan.testing import moe_trainer as mt
from weightplan.runtime import Receiver

KV_CACHE_BYTES = 64 << 20  # explicit: vLLM's CPU worker otherwise sizes it from host memory minus its RSS (docs/vllm.md)


def start_engine(model: Path, *, backend: bool, dummy: bool):
    """A vllm.LLM CPU engine (eager, bf16, no tokenizer), with the weightplan weight-transfer backend if `backend`."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    return LLM(model=str(model), load_format="dummy" if dummy else "safetensors", skip_tokenizer_init=True,
               enforce_eager=True, dtype="bfloat16", kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=128,
               max_num_seqs=4, seed=0, weight_transfer_config=WeightTransferConfig(backend="weightplan") if backend else None)


def engine_greedy(llm, prompts, n: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs, one request at a time (vLLM's CPU MLA output depends on the batch: docs/vllm.md)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=0)
    tokens, logprobs = [], []
    for prompt in prompts:
        out = llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0].outputs[0]
        tokens.append(list(out.token_ids))
        logprobs.append([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
    return tokens, logprobs


def stop_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def hf_model(config: Path) -> torch.nn.Module:
    """transformers' bf16 model for the config, built on CPU so its non-persistent buffers (rotary inv_freq) are computed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(str(config))
    hf_config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()


class EngineInference:
    """A `vllm.LLM` CPU engine started with `load_format="dummy"` and the weightplan weight-transfer backend.

    Every weight, the first version included, arrives from the trainers through the backend
    (vLLM's own `init_weight_transfer_engine` / `start_weight_update` / `update_weights` /
    `finish_weight_update`), and the engine generates. The config's MLA head dim must be 576
    (vLLM's CPU MLA kernel).
    """

    name = "engine"

    def __init__(self, config: Path, workdir: Path):
        from weightplan.vllm_backend.cpu_host import pin_no_amx

        self.config, self.workdir = config, workdir
        pin_no_amx(workdir)  # the engine's choices must not depend on the host's AMX
        self.llm = start_engine(config, backend=True, dummy=True)
        self.logprobs = None

    def connect(self, plan, plan_path: Path, rendezvous, *, timeout: float, verify: bool) -> None:
        from weightplan.vllm_backend.clients import LLMClient

        self.client = LLMClient(self.llm)
        # verify: the backend compares each update's landed bytes with the trainers' digests and fails it otherwise.
        self.client.init_weight_transfer_engine({"plan": str(plan_path), "address": rendezvous.address,
                                                 "job": rendezvous.job, "timeout": timeout, "verify": verify,
                                                 "fingerprint": plan.fingerprint})
        runs = plan.runs
        on_rank0 = np.array([0 in d.ranks for d in plan.dests], dtype=bool)[runs["dest"]]
        self.bytes = int((runs["length"] * plan.wire_itemsize())[on_rank0].sum())

    def update(self, version: int) -> dict:
        began = time.perf_counter()
        self.client.start_weight_update()
        self.client.update_weights({"version": version})
        self.client.finish_weight_update(weight_version=str(version))
        return {"update_s": round(time.perf_counter() - began, 4), "bytes": self.bytes}

    def generate(self, prompts, n: int) -> list[list[int]]:
        tokens, self.logprobs = engine_greedy(self.llm, prompts, n)
        return tokens

    def check(self, full: dict[str, torch.Tensor], tokens, n: int, last: bool) -> dict:
        """At the last step: a fresh engine loaded from a safetensors checkpoint of the trainer's full state dict
        (written by transformers' save_pretrained, i.e. with checkpoint names) generates the same tokens and logprobs."""
        if not last:
            return {}
        checkpoint = self.workdir / "checkpoint-last"
        model = hf_model(self.config)
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in full.items()})
        model.save_pretrained(str(checkpoint))
        ours = self.logprobs
        stop_engine(self.llm)  # one engine at a time on this host
        self.llm = None
        fresh = start_engine(checkpoint, backend=False, dummy=False)
        try:
            fresh_tokens, fresh_logprobs = engine_greedy(fresh, mt.PROMPTS, n)
        finally:
            stop_engine(fresh)
        return {"fresh_engine_tokens_equal": fresh_tokens == tokens, "fresh_engine_logprobs_equal": fresh_logprobs == ours}

    def close(self) -> None:
        if self.llm is not None:
            stop_engine(self.llm)  # its workers' receivers close with them
            self.llm = None


class ReceiverInference:
    """A Receiver on a vLLM model (loader-built, bf16); generation by transformers on the received bytes.

    For configs vLLM's CPU engine cannot run (MLA head dim below 576): after each sync the same plan,
    run backwards, copies the vLLM parameters into a bf16 transformers model, which generates.
    """

    name = "receiver"

    def __init__(self, config: Path, workdir: Path):
        from transformers import AutoConfig, AutoModelForCausalLM

        from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config

        self.config = config
        self.vllm_config = make_vllm_config(config)
        self.model = build_model(self.vllm_config, "cpu")
        hf_config = AutoConfig.from_pretrained(str(config))
        hf_config._attn_implementation = "eager"
        # Built on CPU (not meta + to_empty) so its non-persistent buffers (rotary inv_freq) are computed.
        self.generator = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()

    def connect(self, plan, plan_path: Path, rendezvous, *, timeout: float, verify: bool) -> None:
        self.plan = plan
        self.receiver = Receiver(plan, 0, self.model, rendezvous=rendezvous, timeout=timeout, verify=verify).start()
        self._copies = _inverse_copies(plan, self.generator)
        self.fresh = FreshLoad(self.config) if verify else None

    def update(self, version: int) -> dict:
        report = self.receiver.sync(version)
        params = dict(self.model.named_parameters())
        targets = self.generator.state_dict()
        with torch.no_grad():
            for src, index, dest, start, stop in self._copies:
                targets[src].view(-1)[index] = params[dest].detach().view(-1)[start:stop].to(targets[src].dtype)
        return {"update_s": round(report.seconds, 4), "bytes": report.bytes}

    def generate(self, prompts, n: int) -> list[list[int]]:
        return greedy(self.generator, prompts, n)

    def check(self, full: dict[str, torch.Tensor], tokens, n: int, last: bool) -> dict:
        """Every step: digests against vLLM's own load_weights, tokens against a fresh transformers load."""
        return self.fresh.compare(full, self, tokens, n)

    def close(self) -> None:
        self.receiver.close()


def greedy(model, prompts, n: int) -> list[list[int]]:
    with torch.no_grad():
        ids = torch.tensor(prompts)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def _inverse_copies(plan, model) -> list[tuple]:
    """The plan run backwards for inference rank 0: (trainer tensor, its flat element indices, dest, start, stop) per run.

    Every trainer element must land somewhere; the transformers model's own tensors are filled from the vLLM parameters.
    """
    import numpy as np

    targets = model.state_dict()
    runs, covered, copies = plan.runs, {}, []
    index_maps: dict[tuple[int, int], torch.Tensor] = {}
    for i in range(len(runs["src"])):
        dest = plan.dests[int(runs["dest"][i])]
        if 0 not in dest.ranks:
            continue
        src, rank = int(runs["src"][i]), int(runs["src_rank"][i])
        entry = plan.sources[src]
        if (src, rank) not in index_maps:
            grid = torch.arange(entry.numel).view(entry.shape)
            for d, (lo, hi) in enumerate(plan.shard_box(src, rank)):
                grid = grid.narrow(d, lo, hi - lo)
            index_maps[src, rank] = grid.reshape(-1)
        off, length, dst_off = int(runs["src_off"][i]), int(runs["length"][i]), int(runs["dst_off"][i])
        index = index_maps[src, rank][off:off + length]
        copies.append((entry.name, index, dest.name, dst_off, dst_off + length))
        covered.setdefault(entry.name, np.zeros(entry.numel, dtype=bool))[index.numpy()] = True
    for name in targets:
        if name not in covered or not covered[name].all():
            raise SystemExit(f"the plan does not carry every element of {name!r} to inference rank 0; "
                             "generation needs a model whose every trainer tensor reaches vLLM")
    return copies


class FreshLoad:
    """Ground truth for ReceiverInference: vLLM's own load_weights of the trainer's full state dict, and a fresh transformers load."""

    def __init__(self, config: Path):
        from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config

        self.config = config
        self.vllm_config = make_vllm_config(config)  # a second model needs its own VllmConfig (layer names)
        self.reference = build_model(self.vllm_config, "cpu")

    def digests(self, full: dict[str, torch.Tensor], plan) -> dict[str, str]:
        """vLLM's own load_weights of the trainer's full state dict (inference rank 0): SHA-256 per vLLM parameter."""
        from weightplan.compiler.frontend.vllm_compat import compute_tensor_digests, is_deferred_attention_layer
        from weightplan.compiler.frontend.vllm_patches import parallel_rank
        from weightplan.compiler.verify_plan import plan_conversion

        names = [e.name for e in plan.sources]
        with torch.no_grad(), parallel_rank(self.vllm_config, 0, 0):
            self.reference.load_weights(plan_conversion(self.vllm_config, plan)((n_, full[n_]) for n_ in names if n_ in full))
            for module in self.reference.modules():
                if is_deferred_attention_layer(module):
                    module.process_weights_after_loading(torch.bfloat16)
        return compute_tensor_digests(self.reference)

    def compare(self, full: dict[str, torch.Tensor], inference: ReceiverInference, tokens, n: int) -> dict:
        from weightplan.compiler.frontend.vllm_compat import compute_tensor_digests

        plan = inference.plan
        missing = sorted({e.name for e in plan.sources} - set(full))
        expected, actual = self.digests(full, plan), compute_tensor_digests(inference.model)
        differ = sorted(k for k in expected if expected[k] != actual.get(k))
        fresh = hf_model(self.config)
        fresh.load_state_dict({k: v.to(torch.bfloat16) for k, v in full.items()})
        fresh_tokens = greedy(fresh, mt.PROMPTS, n)
        return {"digests": len(expected), "digests_differ": differ[:5], "n_differ": len(differ),
                "missing_in_full": missing[:5], "fresh_tokens_equal": fresh_tokens == tokens}


