"""The backend's JSON-native init and update infos, validated field by field with one clear error."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from weightplan.runtime.checks import MAX_VERSION
from weightplan.runtime.errors import WeightplanError, one_line
from weightplan.runtime.layout.shards import MAX_RANKS
from weightplan.runtime.transport.rendezvous import check_address, check_job

MODES = ("auto", "staged", "direct")
DRAFT_JOB_SUFFIX = ".draft"  # the draft plan's job id is the target's job id plus this
MAX_JOB = 64  # runtime/transport/rendezvous.py: job ids are 1-64 characters
MAX_PATH = 4096  # bytes of a plan path (PATH_MAX)


class InitInfoError(ValueError):
    """Init or update info that the weightplan backend cannot use; the message names the field."""


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InitInfoError(f"weightplan init_info field {name!r} must be a non-empty string, got {repr(value)[:60]}")
    return value


def _number(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        raise InitInfoError(f"weightplan init_info field {name!r} must be a number in ({low:g}, {high:g}], got {value!r}")
    return float(value)


def _int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InitInfoError(f"weightplan init_info field {name!r} must be an integer in {low}..{high}, got {repr(value)[:40]}")
    return value


def _runtime_checked(name: str, check, value: str):
    """`check(value)` of the runtime (the rendezvous' own rule for this field), its refusal as an InitInfoError."""
    try:
        return check(value)
    except WeightplanError as exc:
        raise InitInfoError(f"weightplan init_info field {name!r}: {one_line(exc)}") from None


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InitInfoError(f"weightplan init_info field {name!r} must be true or false, got {value!r}")
    return value


@dataclass
class WeightplanInitInfo(WeightTransferInitInfo):
    """What every inference worker needs to join a weightplan job (all JSON-native).

    `plan`: the plan file, or a list of plan files one of which matches this engine (the first
    whose inference layout and parameters match is used). `address`: HOST:PORT of the job's
    rendezvous store. `job`: the job id. `timeout`: seconds a sync may take. `verify`: compare
    each sync's landed bytes with the trainers' digests. `rank_offset`: added to the rank vLLM's
    parallel config gives, for independent engine replicas sharing one plan. `mode`: "auto"
    (chosen from the live engine and reported), "staged" or "direct". `fingerprint`: if given,
    the plan's fingerprint must equal it (the trainer passes its own plan's). `draft_plan`: the
    speculative-decoding draft's plan file(s) (`compile-plan --draft`); with it the engine takes
    draft updates (`start_draft_weight_update`), synced in job `job + ".draft"`. `delta`: the Receiver's delta
    fraction (docs/runtime.md, delta syncs; 0: every update full), in [0, 1]. `lora_slots`: for a LoRA plan
    (`compile-plan --lora`), the two adapter slots its versions alternate between (docs/lora.md). `pool_ranks`: the
    inference ranks the job's trainers serve when engine replicas beyond the plan's ranks join (the trainers' own
    `pool_ranks`; a replica's rank is `rank_offset` plus its worker rank; docs/operations.md#the-pool-grows-and-shrinks).
    """

    plan: str | list[str]
    address: str
    job: str
    timeout: float = 60.0
    verify: bool = False
    rank_offset: int = 0
    mode: str = "auto"
    fingerprint: str | None = None
    draft_plan: str | list[str] | None = None
    delta: float = 0.0
    lora_slots: tuple[int, int] = (0, 1)
    pool_ranks: int | None = None

    @property
    def plans(self) -> list[str]:
        return _paths(self.plan)

    @property
    def draft_plans(self) -> list[str]:
        return [] if self.draft_plan is None else _paths(self.draft_plan)

    @property
    def draft_job(self) -> str:
        return self.job + DRAFT_JOB_SUFFIX

    @classmethod
    def from_dict(cls, info: Any) -> "WeightplanInitInfo":
        """Validate a JSON-native dict; raise InitInfoError naming the first bad or unknown field."""
        if not isinstance(info, dict):
            raise InitInfoError(f"weightplan init_info must be a JSON object, got {type(info).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(info) - known)
        if unknown:
            raise InitInfoError(f"weightplan init_info field {unknown[0]!r} is not known; fields: {', '.join(sorted(known))}")
        missing = [name for name in ("plan", "address", "job") if name not in info]
        if missing:
            raise InitInfoError(f"weightplan init_info field {missing[0]!r} is required")
        plan = _plan_field("plan", info["plan"])
        draft_plan = None if info.get("draft_plan") is None else _plan_field("draft_plan", info["draft_plan"])
        job = _str("job", info["job"])
        _runtime_checked("job", check_job, job)
        if draft_plan is not None and len(job) + len(DRAFT_JOB_SUFFIX) > MAX_JOB:
            raise InitInfoError(f"weightplan init_info field 'draft_plan' syncs in job {job + DRAFT_JOB_SUFFIX!r}, longer than "
                                f"{MAX_JOB} characters: shorten field 'job'")
        address = _str("address", info["address"])
        _runtime_checked("address", check_address, address)
        mode = _str("mode", info.get("mode", "auto"))
        if mode not in MODES:
            raise InitInfoError(f"weightplan init_info field 'mode' must be one of {', '.join(MODES)}, got {mode!r}")
        fingerprint = info.get("fingerprint")
        if fingerprint is not None:
            _str("fingerprint", fingerprint)
        return cls(plan=plan, address=address, job=job,
                   timeout=_number("timeout", info.get("timeout", 60.0), 0, 86400),
                   verify=_bool("verify", info.get("verify", False)),
                   rank_offset=_int("rank_offset", info.get("rank_offset", 0), 0, MAX_RANKS - 1), mode=mode,
                   fingerprint=fingerprint,
                   draft_plan=draft_plan,
                   delta=_fraction("delta", info.get("delta", 0.0)),
                   lora_slots=_slot_pair(info.get("lora_slots", [0, 1])),
                   pool_ranks=None if info.get("pool_ranks") is None else _int("pool_ranks", info["pool_ranks"], 1,
                                                                                MAX_RANKS))


def _slot_pair(value: Any) -> tuple[int, int]:
    """Two different adapter slot indices (whether the engine has them is checked against its max_loras)."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2 or value[0] == value[1]
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)):
        raise InitInfoError(f"weightplan init_info field 'lora_slots' must be two different slot indices >= 0, "
                            f"got {repr(value)[:40]}")
    return (value[0], value[1])


def _fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InitInfoError(f"weightplan init_info field {name!r} must be a number in [0, 1], got {repr(value)[:40]}")
    return float(value)


def _plan_field(name: str, value: Any) -> str | list[str]:
    """A plan path or a non-empty list of plan paths."""
    if isinstance(value, list):
        if not value:
            raise InitInfoError(f"weightplan init_info field {name!r} is an empty list")
        return [_plan_path(name, p) for p in value]
    return _plan_path(name, value)


def _plan_path(name: str, value: Any) -> str:
    path = _str(name, value)
    if "\0" in path or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH:
        raise InitInfoError(f"weightplan init_info field {name!r} must be a file path (no NUL byte, at most {MAX_PATH} "
                            f"bytes), got {path[:60]!r}")
    return path


def _paths(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


@dataclass
class WeightplanUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version every trainer rank published. With `prefetch`, the worker starts syncing that version
    into its staging buffers in the background and returns at once (the engine keeps generating); the next update of
    the same version without `prefetch` waits for that sync and applies it."""

    version: int
    prefetch: bool = False

    @classmethod
    def from_dict(cls, info: Any) -> "WeightplanUpdateInfo":
        if not isinstance(info, dict) or "version" not in info or not set(info) <= {"version", "prefetch"}:
            raise InitInfoError(f"weightplan update_info must be {{'version': <int in 1..{MAX_VERSION}>[, 'prefetch': "
                                f"true|false]}}, got {repr(info)[:80]}")
        return cls(version=_int("version", info["version"], 1, MAX_VERSION),
                   prefetch=_bool("prefetch", info.get("prefetch", False)))
