"""A policy as the RL frameworks' FSDP2 trainers hold it, on gloo ranks (transformers' model, fp32, fully_shard), and
one optimizer step of it, and a count of full-tensor gathers: the trainer side of the framework adapter tests and
benchmarks."""

from __future__ import annotations

import torch


def fsdp2_llama(config: str) -> torch.nn.Module:
    """transformers' causal LM of `config` (a config directory), fp32, every decoder layer and the model fully_shard'ed
    over the default group's ranks (a one-rank gloo world, made here, if there is none)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightplan.testing.engines import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config), dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model, optimizer) -> None:
    """One optimizer step on a fixed batch, so every run's weights change the same way."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 17, 42, 99, 7, 250]])
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()


def counting_full_tensor(gathered: list):
    """`DTensor.full_tensor` as it is now, wrapped to append each gathered DTensor's shape to `gathered`: set it in its
    place to prove an adapter never gathers (keep the original for a reference gather that is not counted)."""
    from torch.distributed.tensor import DTensor

    full_tensor = DTensor.full_tensor

    def counted(self, *args, **kwargs):
        gathered.append(tuple(self.shape))
        return full_tensor(self, *args, **kwargs)

    return counted
