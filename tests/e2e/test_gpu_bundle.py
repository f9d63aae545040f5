"""`make gpu-bundle`: .gpu/ under 40 MiB, the pruned nixl-cu13 complete by its NEEDED closure, vLLM's fp8 source exact."""

from __future__ import annotations

import glob
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_bundle  # noqa: E402 - benchmarks/ is no package

GLIBC = re.compile(r"^(ld-linux.*|lib(c|m|dl|rt|pthread|util|resolv|gcc_s|stdc\+\+)\.so\b.*)$")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tuple[Path, dict, Path]:
    """(bundle folder, manifest, the NIXL archive unpacked), built once: pip download (its cache makes repeats cheap)."""
    out = tmp_path_factory.mktemp("gpu-bundle")
    try:
        manifest = gpu_bundle.build(out)
    except gpu_bundle.BundleError as exc:
        pytest.fail(f"make gpu-bundle failed: {exc}", pytrace=False)
    unpacked = tmp_path_factory.mktemp("nixl")
    with tarfile.open(out / gpu_bundle.NIXL_ARCHIVE) as tar:
        tar.extractall(unpacked, filter="data")
    return out, manifest, unpacked


def test_the_bundle_fits_and_names_its_contents(bundle):
    out, manifest, unpacked = bundle
    files = {p.name: p.stat().st_size for p in out.iterdir()}
    assert set(files) == {gpu_bundle.NIXL_ARCHIVE, gpu_bundle.VLLM_FILE, gpu_bundle.MANIFEST}, files
    assert sum(files.values()) <= 40 << 20, files
    assert json.loads((out / gpu_bundle.MANIFEST).read_text()) == manifest
    import vllm

    assert manifest["vllm"]["version"] == vllm.__version__
    nixl = manifest["nixl"]
    assert nixl["wheel"].startswith("nixl_cu13-1.5.1-cp312-cp312-manylinux") and nixl["wheel"].endswith("x86_64.whl")
    assert not (unpacked / "nixl_ep_cu13").exists()
    plugins = [p.name for p in unpacked.rglob("libplugin_*.so")]
    assert plugins and set(plugins) == {"libplugin_UCX.so"}, plugins
    modules = sorted(p.name for p in unpacked.glob("nixl_cu13.libs/ucx/*"))
    assert modules == nixl["ucx_modules_kept"]
    assert any(m.startswith("libuct_cuda") for m in modules) and any(m.startswith("libucm_cuda") for m in modules)
    assert any(m.startswith("libuct_cuda") for m in nixl["ucx_folder"]) and not any("perftest" in m for m in modules)
    assert (unpacked / "nixl_cu13" / "_api.py").exists()


def test_every_library_the_pruned_nixl_needs_is_in_it_or_on_a_gpu_machine(bundle):
    """Each ELF file's NEEDED sonames are in the archive, in glibc, or in the manifest's list for the machine (the CUDA
    driver, NVML, the CUDA runtime PyTorch loads); UCX's modules count as roots since UCX dlopens them."""
    _, manifest, unpacked = bundle
    present = {p.name for p in unpacked.rglob("*") if p.is_file()}
    machine = manifest["nixl"]["needed_from_the_machine"]
    elves = [p for p in unpacked.rglob("*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF"]
    assert len(elves) > 20
    for path in elves:
        for soname in gpu_bundle.needed(path):
            assert soname in present or GLIBC.match(soname) or path.name in machine.get(soname, []), (path.name, soname)
    # cuda_ipc and cuda_copy (libuct_cuda) need the driver and NVML; UCX's CUDA memory hooks the runtime PyTorch loads
    assert "libuct_cuda.so.0.0.0" in machine["libcuda.so.1"] and "libuct_cuda.so.0.0.0" in machine["libnvidia-ml.so.1"]
    assert machine["libcudart.so.13"] == ["libucm_cuda.so.0.0.0"], machine


def _python312() -> str | None:
    for candidate in [shutil.which("python3.12"), *sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.12*/bin/python3.12")))]:
        if candidate and subprocess.run([candidate, "--version"], capture_output=True).returncode == 0:
            return candidate
    return None


def test_the_pruned_nixl_bindings_load_where_a_python_3_12_is(bundle):
    """The cu13 wheel is for CPython 3.12 (the GPU machines'); where one is here, its NIXL bindings load from the
    unpacked archive with every NEEDED library resolved (numpy, which nixl_cu13._api also needs, may be absent)."""
    _, _, unpacked = bundle
    python = _python312()
    if python is None:
        pytest.skip("no python3.12 here: the NEEDED closure test above stands in for loading the bindings")
    [so] = (unpacked / "nixl_cu13").glob("_bindings.cpython-312-*.so")
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('nixl_cu13._bindings', sys.argv[1]);"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); print(m.DRAM_SEG, m.VRAM_SEG)")
    proc = subprocess.run([python, "-c", code, str(so)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_bundled_vllm_function_gives_vllms_bytes_on_a_cpu_tensor(bundle):
    out, _, _ = bundle
    import torch
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    spec = importlib.util.spec_from_file_location("bundled_vllm_fp8", out / gpu_bundle.VLLM_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = (torch.randn(300, 520, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    x[:128, :128] *= 1e-6
    ours, theirs = module.per_block_cast_to_fp8(x), per_block_cast_to_fp8(x, block_size=[128, 128], use_ue8m0=False)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
