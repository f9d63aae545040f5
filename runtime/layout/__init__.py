"""Trainer-side layouts: DTensor placements and boxes, shard layouts, the trainer layout file (shared with the compiler)."""
