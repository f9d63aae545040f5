"""The inference end of a sync: posts the plan's reads, quantizes staged fp8 blocks, refreshes derived state."""
