"""Bytes per element of every dtype a plan or a trainer layout may name (imported by the plan schema and the layout file)."""

from __future__ import annotations

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int8": 1,
               "uint8": 1, "float8_e4m3fn": 1, "bool": 1}
