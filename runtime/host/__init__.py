"""The in-process reference executor (no NIXL): runs a plan between tensors in one process."""
