"""Compiler passes: each a pure function over the IR, run in order by pipeline.py."""
