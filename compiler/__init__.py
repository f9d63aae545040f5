"""The weightplan compiler: trace vLLM loading, run passes, write plan files."""
