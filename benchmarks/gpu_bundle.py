"""`make gpu-bundle`: write .gpu/, what a lent GPU machine lacks for `make gpu-check` (pruned NIXL, vLLM's fp8 source)."""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NIXL_WHEEL = "nixl-cu13==1.5.1"
NIXL_ARCHIVE = "nixl-cu13.tar.xz"
VLLM_FILE = "vllm_fp8.py"
MANIFEST = "manifest.json"
LIMIT_BYTES = 40 << 20
KEEP_PLUGINS = {"libplugin_UCX.so"}
# The GPU machines' python (3.12, x86-64, glibc >= 2.28); pip matches manylinux tags exactly, so name each.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


class BundleError(RuntimeError):
    """A step of the bundle failed; the message is one line."""


def download_wheel(dest: Path) -> Path:
    """The nixl-cu13 wheel for CPython 3.12 on manylinux x86-64, through pip (its cache makes repeats cheap)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "--disable-pip-version-check",
               "--quiet", "-d", str(dest), NIXL_WHEEL]
    proc = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest.glob("nixl_cu13-*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        raise BundleError(f"pip download {NIXL_WHEEL} failed (is PyPI reachable?): {lines[-1] if lines else 'no output'}")
    return wheels[0]


def needed(path: Path) -> list[str]:
    """The DT_NEEDED sonames of one ELF file (readelf -d)."""
    proc = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BundleError(f"readelf -d {path.name} failed: {proc.stderr.strip()[:200]}")
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", proc.stdout)


def _is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def ucx_modules(root: Path) -> list[Path]:
    """UCX's transport and memory-hook modules (libuct_*, libucm_*), which UCX dlopens from `*.libs/ucx/` at start
    instead of linking them, so no NEEDED entry reaches them: cuda_ipc and cuda_copy live in libuct_cuda. The
    libucx_perftest_* modules are plugins of UCX's benchmark tool, not of UCX."""
    return sorted(p for p in root.glob("*.libs/ucx/*") if p.name.startswith(("libuct_", "libucm_")) and _is_elf(p))


def closure(roots: list[Path], library_dirs: list[Path]) -> tuple[set[Path], dict[str, list[str]]]:
    """Every wheel library the roots need, transitively; and the sonames found nowhere in the wheel (the system's or
    CUDA's, e.g. libcuda.so.1), each with the files that need it."""
    by_name: dict[str, Path] = {}
    for folder in library_dirs:
        for p in folder.iterdir():
            if p.is_file():
                by_name.setdefault(p.name, p)
    kept, external, todo = set(), {}, list(roots)
    while todo:
        path = todo.pop()
        if path in kept:
            continue
        kept.add(path)
        for soname in needed(path):
            if soname in by_name:
                todo.append(by_name[soname])
            else:
                external.setdefault(soname, []).append(path.name)
    return kept, {k: sorted(set(v)) for k, v in sorted(external.items())}


def from_the_machine(external: dict[str, list[str]]) -> dict[str, list[str]]:
    """Of the sonames the wheel lacks, those a GPU machine must supply beyond glibc (the CUDA driver, NVML, the CUDA
    runtime PyTorch loads), each with the files that need it."""
    glibc = re.compile(r"^(ld-linux.*|lib(c|m|dl|rt|pthread|util|resolv|gcc_s|stdc\+\+)\.so\b.*)$")
    return {k: v for k, v in external.items() if not glibc.match(k)}


def prune(root: Path) -> dict:
    """Prune an unpacked nixl-cu13 wheel in place (DESIGN.md section 5); what was kept and what the closure found."""
    package = root / "nixl_cu13"
    if not package.is_dir():
        raise BundleError(f"{root} holds no nixl_cu13 package: not an unpacked nixl-cu13 wheel")
    ucx_listing = sorted(p.name for p in root.glob("*.libs/ucx/*"))
    shutil.rmtree(root / "nixl_ep_cu13", ignore_errors=True)  # three 31 MB builds of the expert-parallel kernels
    for extra in (*root.glob("*.data"), *root.glob("*.scripts")):  # headers, pkgconfig, example programs
        shutil.rmtree(extra)
    plugin_dirs = [p for p in (root / ".nixl_cu13.mesonpy.libs" / "plugins", root / "nixl_cu13.libs" / "nixl") if p.is_dir()]
    for folder in plugin_dirs:
        for p in folder.iterdir():
            if p.name not in KEEP_PLUGINS:
                p.unlink()
    modules = ucx_modules(root)
    for p in root.glob("*.libs/ucx/*"):
        if p not in modules:
            p.unlink()
    library_dirs = [p for p in root.glob("*.libs") if p.is_dir()]
    roots = sorted(package.glob("*.so")) + [p for d in plugin_dirs for p in d.iterdir()] + modules
    roots += [d / "libnixl.so" for d in library_dirs if (d / "libnixl.so").exists()]
    # UCX's modules need each other (libuct_ib_mlx5 needs libuct_ib): they resolve in ucx/, but only the flat
    # *.libs folders are pruned.
    kept, external = closure(roots, library_dirs + [p for p in root.glob("*.libs/ucx") if p.is_dir()])
    removed = []
    for folder in library_dirs:
        for p in sorted(folder.iterdir()):
            if p.is_file() and p not in kept:
                removed.append(p.name)
                p.unlink()
    if not any(p.name.startswith("libuct_cuda") for p in modules):
        raise BundleError("the wheel's ucx folder has no libuct_cuda module: cuda_ipc and cuda_copy would be missing")
    return {"ucx_folder": ucx_listing, "ucx_modules_kept": [p.name for p in modules],
            "plugins_kept": sorted({p.name for d in plugin_dirs for p in d.iterdir()}),
            "libraries_removed": len(removed), "needed_from_the_machine": from_the_machine(external),
            "unpacked_bytes": sum(p.stat().st_size for p in root.rglob("*") if p.is_file())}


def pack(root: Path, archive: Path) -> None:
    with tarfile.open(archive, "w:xz", preset=6) as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)


# ---- vLLM's per_block_cast_to_fp8, as source -----------------------------------------------------------------------

def vllm_fp8_source() -> tuple[str, str]:
    """(module text, vLLM version): vLLM's per_block_cast_to_fp8 and what it calls, from the installed vLLM's own source
    (inspect.getsource), runnable without vLLM. `current_platform` stands for vLLM's CUDA platform: its
    fp8_dtype, is_fp8_fnuz and simple_compile_backend are vLLM's Platform defaults, which CUDA keeps."""
    import vllm
    from vllm.model_executor.layers.quantization.utils import quant_utils
    from vllm.platforms import interface
    from vllm.utils import deep_gemm, math_utils

    def source(obj) -> str:
        return textwrap.dedent(inspect.getsource(obj))

    platform = interface.Platform
    cuda = Path(interface.__file__).with_name("cuda.py").read_text()  # read, not imported: it needs vLLM's CUDA build
    overridden = [n for n in ("simple_compile_backend", "fp8_dtype", "is_fp8_fnuz") if re.search(rf"\b{n}\b", cuda)]
    if overridden:
        raise BundleError(f"vLLM {vllm.__version__}'s CUDA platform overrides {overridden}: the bundle's current_platform "
                          "would not be CUDA's; take them from vllm/platforms/cuda.py")
    methods = "".join(textwrap.indent(source(getattr(platform, name)), "    ") + "\n" for name in ("fp8_dtype", "is_fp8_fnuz"))
    parts = [
        f'"""vLLM {vllm.__version__}\'s per_block_cast_to_fp8 and the helpers it calls, copied from the installed vLLM by '
        'benchmarks/gpu_bundle.py (inspect.getsource) for machines without vLLM; generated, not project code."""\n',
        "import torch\n",
        f"DEFAULT_BLOCK_SIZE = {deep_gemm.DEFAULT_BLOCK_SIZE!r}\n",
        f"# vllm/platforms/interface.py (Platform), which vLLM's CUDA platform does not override for these\n"
        f"class current_platform:\n    simple_compile_backend = {platform.simple_compile_backend!r}\n\n{methods}",
        "# vllm/utils/math_utils.py\n" + source(math_utils.cdiv),
        "# vllm/model_executor/layers/quantization/utils/quant_utils.py\n" + source(quant_utils.get_fp8_min_max),
        "# vllm/utils/deep_gemm.py\n" + source(deep_gemm._align),
        source(deep_gemm._ceil_to_ue8m0),
        source(deep_gemm.per_block_cast_to_fp8),
    ]
    return "\n\n".join(parts), vllm.__version__


def build(out: Path) -> dict:
    """Write the bundle into `out` (replacing what the bundle wrote there before); its manifest."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (NIXL_ARCHIVE, VLLM_FILE, MANIFEST):
        (out / name).unlink(missing_ok=True)
    text, vllm_version = vllm_fp8_source()
    (out / VLLM_FILE).write_text(text)
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        wheel = download_wheel(Path(tmp) / "wheel")
        unpacked = Path(tmp) / "nixl"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(unpacked)
        report = prune(unpacked)
        pack(unpacked, out / NIXL_ARCHIVE)
    files = {name: {"bytes": (out / name).stat().st_size,
                    "sha256": hashlib.sha256((out / name).read_bytes()).hexdigest()} for name in (NIXL_ARCHIVE, VLLM_FILE)}
    manifest = {"nixl": {"wheel": wheel.name, "requirement": NIXL_WHEEL, "archive": NIXL_ARCHIVE, **report},
                "vllm": {"version": vllm_version, "file": VLLM_FILE,
                         "functions": ["per_block_cast_to_fp8", "_ceil_to_ue8m0", "_align", "cdiv", "get_fp8_min_max",
                                       "Platform.fp8_dtype", "Platform.is_fp8_fnuz"]},
                "files": files, "bytes": sum(f["bytes"] for f in files.values())}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in out.glob("*") if p.is_file())
    if total > LIMIT_BYTES:
        raise BundleError(f"{out} holds {total / 2**20:.1f} MiB, over the {LIMIT_BYTES >> 20} MiB the bundle may take")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / ".gpu"), help="the bundle's folder (default: .gpu in the checkout)")
    args = parser.parse_args()
    try:
        manifest = build(Path(args.out))
    except BundleError as exc:
        sys.exit(f"gpu-bundle: {exc}")
    nixl = manifest["nixl"]
    print(f"wrote {args.out}: {manifest['bytes'] / 2**20:.1f} MiB ({nixl['wheel']} pruned to "
          f"{nixl['unpacked_bytes'] / 2**20:.0f} MiB unpacked, UCX modules {', '.join(nixl['ucx_modules_kept'])}; "
          f"vLLM {manifest['vllm']['version']}'s per_block_cast_to_fp8)")
    print(json.dumps(manifest))


if __name__ == "__main__":
    main()
