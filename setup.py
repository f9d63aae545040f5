"""Package discovery: every package under compiler/, runtime/, vllm_backend/, adapters/ and testing/ installs as
weightplan.<its path>."""

from setuptools import find_packages, setup

MAPPED = ("compiler", "runtime", "vllm_backend", "adapters", "testing")  # installed as weightplan.<folder> (pyproject's package-dir)

setup(packages=["weightplan", *(f"weightplan.{name}" for name in find_packages(include=[f"{m}" for m in MAPPED] + [f"{m}.*" for m in MAPPED]))])
