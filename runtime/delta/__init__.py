"""Delta syncs: the byte encoding of what changed since the previous version, and the pages both sides derive from a plan."""
