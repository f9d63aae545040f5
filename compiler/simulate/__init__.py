"""simulate-plan: predict a plan's sync time on a cluster (cluster files, transfers, max-min fair simulation, report)."""
