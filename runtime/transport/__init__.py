"""NIXL transport: the agent wrapper, rendezvous metadata exchange, peer checks and region digests."""
