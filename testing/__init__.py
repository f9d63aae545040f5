"""Harnesses the tests, benchmarks and examples share: live vLLM CPU engines, a small FSDP2 MoE trainer,
sync jobs of runtime worker processes and emulated nodes."""
