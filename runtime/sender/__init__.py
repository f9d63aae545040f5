"""The trainer end of a sync: exposes trainer shards (and fp8 blocks it quantizes) for inference ranks to read."""
