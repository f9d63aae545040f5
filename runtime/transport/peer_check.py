"""What a reader checks of a trainer rank's published info before loading its agent: incarnation, plan, regions."""

from __future__ import annotations

from ..errors import PlanMismatchError, SyncError
from ..plan.format import Plan
from ..tables.quant import QuantTables, exposed_regions
from .protocol import TrainerInfo


def checked_regions(plan: Plan, tables: QuantTables | None, rank: int, info: TrainerInfo, incarnation: str) -> list[int]:
    """Addresses of trainer `rank`'s exposed regions, once its info names this incarnation, this plan and its regions."""
    if info.incarnation != incarnation:
        raise SyncError(f"trainer rank {rank} restarted after publishing this version; sync a newer one")
    if info.fingerprint != plan.fingerprint:
        raise PlanMismatchError(f"trainer rank {rank} runs plan {info.fingerprint[:12]}, this rank "
                                f"runs {plan.fingerprint[:12]}: both sides must load the same plan file")
    expected = [(r.source, r.chain, r.nbytes) for r in exposed_regions(plan, tables, rank)]
    if [(r.source, r.chain, r.nbytes) for r in info.regions] != expected:
        raise PlanMismatchError(f"trainer rank {rank} exposes regions that differ from what the plan says it serves")
    return [r.address for r in info.regions]


def region_fields(info: TrainerInfo, used) -> dict[str, tuple[int, int]]:
    """{"regions[i]": (address, bytes)} of the regions `used` (indexes) of an info checked_regions accepted, to name the
    one a peer lacks (a region served only packed is never read at its address)."""
    return {f"regions[{i}]": (info.regions[i].address, info.regions[i].nbytes) for i in sorted(set(used))}
