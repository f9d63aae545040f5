"""Shared fixtures: small model configs and a cache of plans compiled in this test session."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

# Property tests draw the same examples on every run (a green run stays green; a case that once failed is kept as
# an explicit @example). HYPOTHESIS_PROFILE=explore draws new ones, for looking for bugs rather than gating CI.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))



def pytest_terminal_summary(terminalreporter) -> None:
    """Print the host's CPU and the features vLLM and torch choose kernels by: results that differ between hosts
    show with the host they ran on (also under -q)."""
    import platform

    import torch

    probes = ("avx2", "avx512", "avx512_bf16", "vnni", "amx_tile", "amx_fp16")
    have = [name for name in probes if getattr(torch.cpu, f"_is_{name}_supported", lambda: False)()]
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    terminalreporter.write_line(f"host cpu: {model or 'unknown'}; {os.cpu_count()} cores; "
                                f"features: {' '.join(have) or 'none'}")


CONFIGS = Path(__file__).parent / "configs"
TINY_MODELS = ("tiny-glm", "tiny-deepseek-v3", "tiny-qwen3-moe", "tiny-llama")


def config_dir(name: str) -> Path:
    return CONFIGS / name


def with_header_edit(data: bytes, change) -> bytes:
    """The plan file `data` with its header JSON object edited in place by `change(header)`, then re-fingerprinted and
    re-signed: the reader sees only what the edit did to the header."""
    from weightplan.runtime.plan.format import MAGIC
    from weightplan.runtime.plan.header import canonical_json, fingerprint

    start = len(MAGIC) + 8
    (length,) = struct.unpack_from("<Q", data, len(MAGIC))
    header = json.loads(data[start : start + length])
    change(header)
    head = canonical_json(dict(header, fingerprint=fingerprint(header)))
    body = MAGIC + struct.pack("<Q", len(head)) + head + data[start + length : -32]
    return body + hashlib.sha256(body).digest()


@pytest.fixture(scope="session")
def plan_cache(tmp_path_factory):
    """compile(model, fmt, dtype, trainer, inference, quant) -> path of a plan compiled once per session."""
    from weightplan.compiler.compile import CompileOptions, compile_plan

    root = tmp_path_factory.mktemp("plans")
    cache: dict[tuple, Path] = {}

    def compile(model: str, fmt: str = "hf", dtype: str = "bf16", trainer: str = "fsdp=1", inference: str = "tp=1",
                quant: str = "none", scale_rounding: str | None = None, moe_backend: str | None = None) -> Path:
        key = (model, fmt, dtype, trainer, inference, quant, scale_rounding, moe_backend)
        if key not in cache:
            out = root / (f"{model}-{fmt}-{dtype}-{trainer}-{inference}-{quant}-{scale_rounding}-{moe_backend}.plan"
                          .replace(",", "_").replace("=", ""))
            compile_plan(CompileOptions(str(config_dir(model)), fmt, dtype, quant, out, trainer=trainer, inference=inference,
                                        scale_rounding=scale_rounding, moe_backend=moe_backend))
            cache[key] = out
        return cache[key]

    return compile


@pytest.fixture
def no_job_secret_in_the_environment(monkeypatch):
    """Neither job-secret variable set: a test's job has a secret only where the test gives it one."""
    from weightplan.runtime.transport.rendezvous import SECRET_ENV, SECRET_FILE_ENV

    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


@pytest.fixture
def rendezvous(request):
    """A store on a free loopback port, namespaced by the test's name."""
    from weightplan.runtime import Rendezvous

    return Rendezvous.connect(f"inproc-{request.node.name[:40].replace('[', '-').replace(']', '')}", "127.0.0.1:0", serve=True)


@pytest.fixture
def no_agents(monkeypatch):
    """Fail the test if a NIXL agent (and so any registration) is created."""
    from weightplan.runtime.receiver import connections as receiver_module
    from weightplan.runtime.sender import sender as sender_module

    def refuse(*args, **kwargs):
        raise AssertionError("a NIXL agent was created before the inputs were checked")

    monkeypatch.setattr(sender_module, "NixlAgent", refuse)
    monkeypatch.setattr(receiver_module, "NixlAgent", refuse)


@pytest.fixture(scope="session")
def framework_runs(tmp_path_factory):
    """`bench_frameworks.py --smoke` run once for the session and checked by several tests (tests/support/framework_runs.py)."""
    from .support.framework_runs import run_frameworks

    return run_frameworks(tmp_path_factory.mktemp("frameworks"))
