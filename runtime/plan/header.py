"""The plan header's schema: types, ranges and cross-field rules, checked before any field is used."""

from __future__ import annotations

import math

from ..casts import CHAIN_RULE, is_chain
from ..errors import PlanFormatError
from ..layout.shards import MAX_RANKS

MAX_ELEMENTS = 1 << 48  # elements in one tensor, and any offset, length or stride a plan stores
MAX_DIMS = 8
MAX_ROWS = 1 << 28  # rows of any one column table (about 2 GB per int64 column)
QUANTS = ("none", "fp8_per_block")


def check_header(header, origin: str, dtype_sizes: dict) -> None:
    """Refuse a header that is not exactly what the writer produces, naming the first field that is not."""

    def fail(field: str, what: str):
        raise PlanFormatError(f"{origin}: header field {field!r} {what}")

    if not isinstance(header, dict):
        raise PlanFormatError(f"{origin}: the header is a JSON {type(header).__name__}, not an object")
    for key in ("vllm_version", "model", "config_sha256", "quant", "fingerprint", "kind"):
        if not isinstance(header.get(key), str):
            fail(key, "is missing or not a string")
    if header["quant"] not in QUANTS:
        fail("quant", f"is {header['quant']!r}, not one of {', '.join(QUANTS)}")
    _int(header, "src_ranks", 1, MAX_RANKS, fail)
    dst_ranks = _int(header, "dst_ranks", 1, MAX_RANKS, fail)
    for key in ("n_runs", "n_stage_runs", "n_spans"):
        _int(header, key, 0, MAX_ROWS, fail)
    for key in ("trainer", "inference", "quant_layout", "stats"):
        if not isinstance(header.get(key, {}), dict):
            fail(key, "is not an object")
    inference = header["inference"]
    tp, dp = (_int(inference, k, 1, MAX_RANKS, lambda f, w: fail(f"inference.{f}", w)) for k in ("tp", "dp"))
    if not isinstance(inference.get("ep"), bool):
        fail("inference.ep", "is not true or false")
    if tp * dp != dst_ranks:
        fail("dst_ranks", f"is {dst_ranks}, but inference tp={tp} x dp={dp} ranks")
    boxes = header["trainer"].get("boxes")
    if not isinstance(boxes, list) or not all(isinstance(c, list) and len(c) == header["src_ranks"] for c in boxes):
        fail("trainer.boxes", "is not a list of per-rank box tables, one box (or null) per trainer rank")
    for i, table in enumerate(boxes):
        for box in table:
            if box is not None and not (isinstance(box, list) and len(box) <= MAX_DIMS and all(
                    isinstance(r, list) and len(r) == 2 and _count(r[0], MAX_ELEMENTS) and _count(r[1], MAX_ELEMENTS)
                    and r[0] <= r[1] for r in box)):
                fail(f"trainer.boxes[{i}]", f"holds {str(box)[:60]}, not a list of [start, stop) ranges")

    chains = _list(header, "cast_chains", fail)
    for i, chain in enumerate(chains):
        if not isinstance(chain, list) or not is_chain(chain, dtype_sizes):
            fail(f"cast_chains[{i}]", f"is not {CHAIN_RULE}")
    for i, entry in enumerate(_list(header, "sources", fail)):
        where = f"sources[{i}]"
        if not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[0], str) or not _dtype(entry[2], dtype_sizes) \
                or not _count(entry[3], len(header["trainer"]["boxes"])):
            fail(where, "is not [name, shape, dtype, layout class]")
        _shape(entry[1], where, fail)

    def dest_row(entry, where: str) -> set:
        """(name, rank) pairs of a [name, shape, dtype, inference ranks] row."""
        if not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[0], str) or not _dtype(entry[2], dtype_sizes):
            fail(where, "is not [name, shape, dtype, inference ranks]")
        _shape(entry[1], where, fail)
        _ranks(entry[3], dst_ranks, where, fail)
        return {(entry[0], rank) for rank in entry[3]}

    names = set()
    for i, entry in enumerate(_list(header, "dests", fail)):
        where = f"dests[{i}]"
        held = dest_row(entry, where)
        if held & names:  # one name has one entry per rank (entries of other ranks may share the name)
            fail(where, f"gives destination {entry[0]!r} a second entry on inference rank {min(held & names)[1]}")
        names |= held
    for i, entry in enumerate(_list(inference, "unloaded", lambda f, w: fail(f"inference.{f}", w))):
        where = f"inference.unloaded[{i}]"  # parameters vLLM's load never writes: never a destination on the same rank
        if dest_row(entry, where) & names:
            fail(where, f"lists {entry[0]!r}, a destination of the plan on the same inference rank, as never written")
    n_dests = len(header["dests"])
    staging = _list(header, "staging", fail)
    block = header.get("quant_layout", {}).get("block")
    if staging and not (isinstance(block, list) and len(block) == 2 and all(_count(b, MAX_ELEMENTS) and b for b in block)):
        fail("quant_layout.block", f"is {str(block)[:40]}, not the [rows, cols] of a quantization block")
    for i, entry in enumerate(staging):
        where = f"staging[{i}]"
        if not isinstance(entry, list) or len(entry) != 6 or not isinstance(entry[0], str) or entry[2] != "bfloat16":
            fail(where, "is not [name, shape, bfloat16, inference ranks, weight entry, scale entry]")
        if not _count(entry[4], n_dests) or not _count(entry[5], n_dests):
            fail(where, f"names a destination outside the table ({str(entry[4:])[:40]} of {n_dests} entries)")
        _shape(entry[1], where, fail)
        _ranks(entry[3], dst_ranks, where, fail)
        _quantized(entry, header["dests"], block, where, fail)
    used = [e[k] for e in staging for k in (4, 5)]
    if len(set(used)) != len(used):
        fail("staging", "names one destination entry as the weight or scale of two quantized tensors")
    for i, entry in enumerate(_list(header, "constants", fail)):
        if not isinstance(entry, list) or len(entry) != 4:
            fail(f"constants[{i}]", "is not [dest, dst_off, length, value]")
    _list(header, "derived", fail)
    if "fanout" in header:
        _fanout(header["fanout"], n_dests, dst_ranks, fail)


def _fanout(fanout, n_dests: int, dst_ranks: int, fail) -> None:
    """{"gpus_per_node": G, "first_hops": [[dest, [ranks...]], ...]}: types and ranges (the rules are invariants.py's)."""
    if not isinstance(fanout, dict) or set(fanout) != {"gpus_per_node", "first_hops"}:
        fail("fanout", "is not an object with exactly gpus_per_node and first_hops")
    _int(fanout, "gpus_per_node", 1, MAX_RANKS, lambda f, w: fail(f"fanout.{f}", w))
    for i, row in enumerate(_list(fanout, "first_hops", lambda f, w: fail(f"fanout.{f}", w))):
        where = f"fanout.first_hops[{i}]"
        if not isinstance(row, list) or len(row) != 2 or not _count(row[0], n_dests):
            fail(where, f"is not [dest entry, pulling ranks] with an entry of the {n_dests} destinations")
        _ranks(row[1], dst_ranks, where, fail)


def _dtype(value, dtype_sizes: dict) -> bool:
    return isinstance(value, str) and value in dtype_sizes


def _int(mapping: dict, key: str, low: int, high: int, fail) -> int:
    value = mapping.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        fail(key, f"is {str(value)[:40]}, not an integer in {low}..{high}")
    return value


def _count(value, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def _list(header: dict, key: str, fail) -> list:
    value = header.get(key, [])
    if not isinstance(value, list):
        fail(key, "is not a list")
    return value


def _quantized(entry: list, dests: list, block: list, where: str, fail) -> None:
    """A staging tensor's weight entry is fp8 of its shape and its scale entry float32 per block, on the same ranks."""
    name, shape, _, ranks, weight, scale = entry
    if len(shape) < 2:
        fail(where, f"has shape {shape}: a quantized tensor has at least 2 dimensions")
    grid = [*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])]
    for index, dtype, expected in ((weight, "float8_e4m3fn", shape), (scale, "float32", grid)):
        dest = dests[index]
        if dest[2] != dtype or dest[1] != expected or dest[3] != ranks:
            fail(where, f"names entry {index} ({dest[0]!r} {dest[2]}{dest[1]} on ranks {dest[3]}); "
                        f"{name!r} needs {dtype}{expected} on ranks {ranks}")


def _shape(shape, where: str, fail) -> None:
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_count(d, MAX_ELEMENTS) for d in shape) \
            or math.prod(shape) >= MAX_ELEMENTS:
        fail(where, f"has shape {str(shape)[:60]}, not at most {MAX_DIMS} non-negative sizes of fewer than 2**48 elements")


def _ranks(ranks, dst_ranks: int, where: str, fail) -> None:
    if not isinstance(ranks, list) or not ranks or not all(_count(r, dst_ranks) for r in ranks) or ranks != sorted(set(ranks)):
        fail(where, f"lists inference ranks {str(ranks)[:40]}, not increasing ranks of the plan's {dst_ranks}")
