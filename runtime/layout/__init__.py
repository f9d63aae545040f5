"""Trainer-side layouts: DTensor placements and boxes, shard layouts, and the trainer layout file (the compiler imports these)."""
