"""Stand-ins for tests without a GPU or a real NIXL agent: a host tensor that says it is on a GPU, and a nixl_agent
that records what NixlAgent asks of it."""

from __future__ import annotations

import numpy as np
import torch


def on_cuda(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """A host tensor that says it lives on cuda:`index` (its device is all the memory module reads of it)."""

    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", index)

    return tensor.as_subclass(OnCuda)


class FakeNixl:
    """Records what NixlAgent asks of nixl_agent: registrations, prepared lists and transfers, with memory types. Its
    methods take nixl_agent's own parameters (tests/runtime/test_transport_interface.py checks them)."""

    def __init__(self, agent_name, nixl_conf):
        self.registered, self.lists, self.reads, self.released = [], [], [], []

    def register_memory(self, reg_list, mem_type):
        self.registered.append((mem_type, np.array(reg_list).tolist()))
        return len(self.registered)

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type):
        self.lists.append((agent_name, mem_type, np.array(xfer_list).tolist()))
        return len(self.lists) - 1

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices, notif_msg):
        self.reads.append((local_xfer_side, local_indices.tolist(), remote_xfer_side, remote_indices.tolist()))
        return len(self.reads) - 1

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        return "DONE"

    def release_dlist_handle(self, handle):
        self.released.append(handle)
