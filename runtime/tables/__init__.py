"""Pure per-rank tables of a plan (numpy, no NIXL) that the sender and receiver derive alike."""
