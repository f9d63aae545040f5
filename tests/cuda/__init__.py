"""Tests that trace vLLM's CUDA build on a host without a GPU; they run in the CUDA venv (make test-cuda)."""
