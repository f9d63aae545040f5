"""Compiler passes: each a pure function over the IR, declared by stage in pipeline.py."""
