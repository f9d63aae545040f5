"""RL framework adapters: one module per framework, each switching its weight sync to weightplan (docs/frameworks.md)."""
