"""weightplan: compile vLLM weight loading into transfer plans (compiler) and execute them (runtime)."""
