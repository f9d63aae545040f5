"""Frontend: build vLLM models on meta and trace their weight loading with LazyWeights."""
