"""What a reader checks of a trainer rank's published info before loading its agent: incarnation, plan, regions."""

from __future__ import annotations

from ..errors import PlanMismatchError, SyncError
from ..plan.format import Plan
from ..tables.quant import QuantTables, exposed_regions


def checked_regions(plan: Plan, tables: QuantTables | None, rank: int, info: dict, incarnation: str) -> list[int]:
    """Addresses of trainer `rank`'s exposed regions, once its info names this incarnation, this plan and its regions."""
    if info.get("incarnation") != incarnation:
        raise SyncError(f"trainer rank {rank} restarted after publishing this version; sync a newer one")
    if info.get("fingerprint") != plan.fingerprint:
        raise PlanMismatchError(f"trainer rank {rank} runs plan {str(info.get('fingerprint'))[:12]}, this rank "
                                f"runs {plan.fingerprint[:12]}: both sides must load the same plan file")
    expected = [[r.source, r.chain, r.nbytes] for r in exposed_regions(plan, tables, rank)]
    regions = info.get("regions")
    if not isinstance(regions, list) or not all(_words(r, 4) for r in regions):
        raise SyncError(f"trainer rank {rank}: its info's 'regions' is not a list of [source, chain, address, bytes]")
    if [[s, c, n] for s, c, _, n in regions] != expected:
        raise PlanMismatchError(f"trainer rank {rank} exposes regions that differ from what the plan says it serves")
    return [a for _, _, a, _ in regions]


def region_fields(info: dict, used) -> dict[str, tuple[int, int]]:
    """{"regions[i]": (address, bytes)} of the regions `used` (indexes) of an info checked_regions accepted, to name the
    one a peer lacks (a region served only packed is never read at its address)."""
    return {f"regions[{i}]": (info["regions"][i][2], info["regions"][i][3]) for i in sorted(set(used))}


def checked_word(rank: int, info: dict, key: str, n: int = 1) -> list[int]:
    """`info[key]` of trainer `rank`: `n` unsigned 64-bit integers (an address, a size), or a SyncError naming them."""
    value = info.get(key)
    value = [value] if n == 1 and not isinstance(value, list) else value
    if not _words(value, n):
        raise SyncError(f"trainer rank {rank}: its info's {key!r} is {str(info.get(key))[:40]}, expected {n} unsigned integer(s)")
    return value


def _words(value, n: int) -> bool:
    return (isinstance(value, list) and len(value) == n
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in value))
