"""fp8 128x128 block quantization shared by sender and receiver, bit-exact with vLLM's per_block_cast_to_fp8."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from .format import BLOCK, FP8
from .rounding import ScaleRounding, block_scale, canonical_nans_
from .torch_quant import TorchTiles

log = logging.getLogger("weightplan.runtime")


def per_block_fp8(x: torch.Tensor, block: int = BLOCK, *, rounding: ScaleRounding) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor in block x block tiles: (fp8 values of x's shape, float32 scale per tile).

    The same ops in the same order as vllm.utils.deep_gemm.per_block_cast_to_fp8(use_ue8m0=False):
    zero-pad to whole tiles, amax per tile (floored at 1e-4), scale = amax / 448 (rounded as `rounding` says),
    value * (1 / scale); then NaNs made canonical (runtime/fp8/rounding.py).
    Tiles are independent, so any block-aligned sub-tensor quantizes to the same bytes as the whole.
    """
    assert x.dim() == 2, x.shape
    m, n = x.shape
    padded = torch.zeros((math.ceil(m / block) * block, math.ceil(n / block) * block), dtype=x.dtype, device=x.device)
    padded[:m, :n] = x
    tiles = padded.view(-1, block, padded.size(1) // block, block)
    amax = tiles.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    scale = block_scale(amax, rounding)
    values = (tiles * (1.0 / scale)).to(FP8).view_as(padded)[:m, :n].contiguous()
    scale = scale.view(tiles.size(0), tiles.size(2))
    canonical_nans_(values, scale)
    return values, scale


def block_grid(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, int, int]:
    """(matrices, block rows, block cols) of a 2-D or 3-D (experts first) quantized tensor."""
    *lead, rows, cols = shape
    return math.prod(lead), math.ceil(rows / block), math.ceil(cols / block)


def span_bands(shape: tuple[int, ...], first: int, count: int, block: int = BLOCK):
    """Split a span of flat block ids (matrix, block row, block col order) into per-band pieces.

    Yields (matrix, block_row, first_col, n_cols): consecutive blocks of one block row.
    """
    _, nbr, nbc = block_grid(shape, block)
    b, end = first, first + count
    while b < end:
        band, col = divmod(b, nbc)
        take = min(nbc - col, end - b)
        matrix, row = divmod(band, nbr)
        yield matrix, row, col, take
        b += take


def quantize_span(staging: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, first: int, count: int,
                  block: int = BLOCK, *, rounding: ScaleRounding) -> None:
    """Quantize blocks [first, first + count) of `staging` (bf16) into `weight` (fp8) and `scale` (float32).

    All three tensors are shaped as the plan says: weight like staging, scale [..., block rows, block cols].
    """
    rows, cols = staging.shape[-2:]
    s2 = staging.reshape(-1, rows, cols)
    w2 = weight.view(-1, rows, cols)
    sc = scale.view(s2.shape[0], -1, scale.shape[-1])
    for matrix, brow, bcol, n in span_bands(tuple(staging.shape), first, count, block):
        r0, c0 = brow * block, bcol * block
        r1, c1 = min(r0 + block, rows), min(c0 + n * block, cols)
        values, scales = per_block_fp8(s2[matrix, r0:r1, c0:c1], block, rounding=rounding)
        w2[matrix, r0:r1, c0:c1] = values
        sc[matrix, brow, bcol : bcol + n] = scales[0]


def span_dest_segments(shape: tuple[int, ...], first: int, count: int, block: int = BLOCK):
    """Flat element segments (offset, length) of the destination a span covers, in destination order."""
    rows, cols = shape[-2:]
    out = []
    for matrix, brow, bcol, n in span_bands(shape, first, count, block):
        c0, c1 = bcol * block, min((bcol + n) * block, cols)
        base = matrix * rows * cols
        for r in range(brow * block, min(brow * block + block, rows)):
            off = base + r * cols + c0
            if out and out[-1][0] + out[-1][1] == off:
                out[-1] = (out[-1][0], out[-1][1] + c1 - c0)
            else:
                out.append((off, c1 - c0))
    return out


def span_elements(shape: tuple[int, ...], first: int, count: int, block: int = BLOCK) -> int:
    """Destination elements (fp8 bytes) a span of blocks covers; edge blocks are smaller than block x block."""
    rows, cols = shape[-2:]
    total = 0
    for _, brow, bcol, n in span_bands(shape, first, count, block):
        total += (min(brow * block + block, rows) - brow * block) * (min((bcol + n) * block, cols) - bcol * block)
    return total


def _flat(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The elements from t[0, 0] to t[rows - 1, cols - 1] as one contiguous 1-D view (no copy)."""
    return torch.as_strided(t, ((rows - 1) * t.stride(0) + cols,), (1,), t.storage_offset())


class BlockQuantizer:
    """per_block_fp8 for large 2-D views, writing into given outputs, scales rounded as `rounding` says.

    Same bytes as per_block_fp8, on every path. With `use_kernel` (the default) the path is picked by device: whole tiles
    of host tensors go through the numba kernel in fp8/kernel.py, of CUDA tensors through the Triton kernel in
    fp8/triton_quant.py; without it (or without Triton), fp8/torch_quant.py's torch ops run on the tensors' own device,
    never leaving it. Tiles the numba kernel finds holding inf or NaN are redone by the torch path (the Triton kernel
    writes their canonical NaN bytes itself). Edge tiles (rows or columns not a multiple of the
    block) go through per_block_fp8's padding.
    """

    def __init__(self, rounding: ScaleRounding, chunk_elements: int = 1 << 18, block: int = BLOCK, use_kernel: bool = True):
        self.rounding = ScaleRounding(rounding)
        self.block, self.chunk_elements = block, chunk_elements
        self.use_kernel = use_kernel and block == BLOCK
        self._device_tiles: TorchTiles | None = None
        self._triton_failed: str | None = None  # why the Triton kernel did not run here, once it failed
        self._numba_missing = False  # numba (weightplan[host-kernels]) did not import: host tiles take torch ops

    def warm_up(self, device: torch.device = torch.device("cpu")) -> None:
        """Load the kernel of `device` now (numba's import and compiled-code cache take about a second in a fresh process,
        Triton's compile or cache load about as long), so that the first sync does not pay it."""
        if self.use_kernel:
            tile = torch.zeros(BLOCK, BLOCK, dtype=torch.bfloat16, device=device)
            self(tile, torch.empty(BLOCK, BLOCK, dtype=FP8, device=device), torch.empty(1, 1, device=device))

    def __call__(self, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
        """Quantize bf16 `x` (h, w) into fp8 `values` (h, w) and float32 `scales` (ceil(h/B), ceil(w/B)).

        All three may be strided views (unit stride along columns).
        """
        b = self.block
        h, w = x.shape
        hf, wf = h // b * b, w // b * b
        if hf and wf and not (self.use_kernel and (self._triton_tiles(x, values, scales, hf, wf)
                                                   or self._kernel_tiles(x, values, scales, hf, wf))):
            self._torch_tiles(x, values, scales, hf, wf)
        if wf < w:
            v, s = per_block_fp8(x[:, wf:], b, rounding=self.rounding)
            values[:, wf:] = v
            scales[:, wf // b :] = s
        if hf < h and wf:
            v, s = per_block_fp8(x[hf:, :wf], b, rounding=self.rounding)
            values[hf:, :wf] = v
            scales[hf // b :, : wf // b] = s

    def _kernel_tiles(self, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, hf: int, wf: int) -> bool:
        """Whole tiles x[:hf, :wf] through the numba kernel; False (nothing to keep) if it cannot take them."""
        if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.stride(1) != 1 or values.stride(1) != 1
                or self._numba_missing):
            return False  # device tensors (a GPU trainer's) go through torch ops where they are
        try:
            from .kernel import quantize_tiles  # numba compiles or loads its cache on first use
        except ImportError as exc:
            if (exc.name or "").partition(".")[0] not in ("numba", "llvmlite"):
                raise
            self._numba_missing = True
            log.warning("fp8 quantizer: numba is not installed (weightplan[host-kernels]); quantizing host tensors in "
                        "torch ops, the same bytes, more slowly")
            return False

        tile_scales = np.empty((hf // self.block, wf // self.block), dtype=np.float32)
        bits = _flat(x, hf, wf).view(torch.int16).numpy().view(np.uint16)
        out = _flat(values.view(torch.uint8), hf, wf).numpy()
        if quantize_tiles(bits, x.stride(0), out, values.stride(0), tile_scales, self.rounding is ScaleRounding.CUDA):
            return False
        scales[: hf // self.block, : wf // self.block] = torch.from_numpy(tile_scales)
        return True

    def _triton_tiles(self, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, hf: int, wf: int) -> bool:
        """Whole tiles of CUDA tensors through the Triton kernel (runtime/fp8/triton_quant.py), one launch; False if the
        tensors are not on a GPU, or Triton is missing (then torch ops run there)."""
        if (x.device.type != "cuda" or x.dtype != torch.bfloat16 or x.stride(1) != 1 or values.stride(1) != 1
                or self._triton_failed):
            return False
        try:
            from .triton_quant import quantize_tiles_triton

            quantize_tiles_triton(x, values, scales, hf, wf, self.rounding)
        except Exception as exc:  # no Triton, or one that cannot compile the kernel here: torch ops give the same bytes
            self._triton_failed = f"{type(exc).__name__}: {str(exc)[:200]}"
            log.warning("fp8 quantizer: the Triton kernel is unavailable (%s); quantizing in torch ops on %s",
                        self._triton_failed, x.device)
            return False
        return True

    def _torch_tiles(self, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, hf: int, wf: int) -> None:
        if self._device_tiles is None:
            self._device_tiles = TorchTiles(self.rounding, self.chunk_elements, self.block)
        self._device_tiles(x, values, scales, hf, wf)


def quantize_on_device(x: torch.Tensor, block: int = BLOCK, *, rounding: ScaleRounding) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D bf16 tensor's fp8 values and float32 block scales, allocated and computed on its own device in torch ops
    (BlockQuantizer without the numba kernel: TorchTiles for whole tiles, per_block_fp8 for edge tiles): what a GPU
    rank runs, and on host tensors the same code path."""
    values = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty((math.ceil(x.shape[0] / block), math.ceil(x.shape[1] / block)), dtype=torch.float32, device=x.device)
    BlockQuantizer(rounding, block=block, use_kernel=False)(x, values, scales)
    return values, scales
