"""Harnesses the tests, benchmarks and examples share: live vLLM CPU engines and a small FSDP2 MoE trainer."""
