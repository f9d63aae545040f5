"""The delta codec's rates per path (host numba kernels, device Triton kernels) and the per-sync choice they make:
a delta is taken only when reading and applying it is predicted faster than reading the same bytes full."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace

ENV = "WEIGHTPLAN_DELTA_RATES"  # a JSON object of DeltaRates fields overriding the defaults, e.g. {"read_gbytes_per_s": 25}


@dataclass(frozen=True)
class DeltaRates:
    """GB/s of the delta codec and of a full READ, with where each figure comes from (`sources`). Override any of
    them: `Receiver(..., delta_rates=DeltaRates(read_gbytes_per_s=25.0))`."""

    host_encode_gbytes_per_s: float = 1.6  # page bytes diffed and encoded per second
    host_apply_gbytes_per_s: float = 0.22  # delta bytes decoded and scattered per second
    device_encode_gbytes_per_s: float = 800.0
    device_apply_gbytes_per_s: float = 200.0
    read_gbytes_per_s: float = 7.1  # full READs into the destinations
    sources: dict[str, str] = field(default_factory=lambda: dict(SOURCES), compare=False)

    def __post_init__(self):
        for name in ("host_encode_gbytes_per_s", "host_apply_gbytes_per_s", "device_encode_gbytes_per_s",
                     "device_apply_gbytes_per_s", "read_gbytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and not math.isnan(value)):
                raise ValueError(f"DeltaRates.{name} must be a positive number of GB/s, got {value!r}")

    @classmethod
    def from_env(cls) -> "DeltaRates":
        """The defaults with WEIGHTPLAN_DELTA_RATES's overrides (what a Receiver without `delta_rates` uses)."""
        text = os.environ.get(ENV)
        if not text:
            return cls()
        try:
            given = json.loads(text)
        except ValueError:
            given = None
        names = {f.name for f in fields(cls)} - {"sources"}
        if not isinstance(given, dict) or set(given) - names:
            raise ValueError(f"{ENV} must be a JSON object of {', '.join(sorted(names))}, got {text[:80]!r}")
        return cls(**given, sources={**SOURCES, **dict.fromkeys(given, f"{ENV}={text}")})

    def apply_gbytes_per_s(self, path: str) -> float:
        return self.device_apply_gbytes_per_s if path == "device" else self.host_apply_gbytes_per_s

    def encode_gbytes_per_s(self, path: str) -> float:
        return self.device_encode_gbytes_per_s if path == "device" else self.host_encode_gbytes_per_s

    def measured(self, path: str, encode: float, apply: float, source: str) -> "DeltaRates":
        """These rates with `path`'s encode and apply rates replaced by measured ones, and their source."""
        names = (f"{path}_encode_gbytes_per_s", f"{path}_apply_gbytes_per_s")
        return replace(self, **dict(zip(names, (encode, apply))), sources={**self.sources, **dict.fromkeys(names, source)})


SOURCES = {
    "host_encode_gbytes_per_s": "measured: runtime/delta/kernels.py on one core of this project's CPU host "
                                "(benchmarks/measure_delta_codec.py, docs/benchmark-results.md#the-delta-codecs-rates)",
    "host_apply_gbytes_per_s": "measured: the same benchmark, decode + scatter of delta bytes on one core",
    "device_encode_gbytes_per_s": "assumption awaiting the H200 measurement (runtime/delta/measure_device.py): "
                                  "memory-bound diff-and-encode at half of 4.8 TB/s, 3 bytes moved per page byte",
    "device_apply_gbytes_per_s": "assumption awaiting the H200 measurement (runtime/delta/measure_device.py): "
                                 "about 11 bytes moved per delta byte at half of 4.8 TB/s",
    "read_gbytes_per_s": "measured: bench-delta's full syncs of the 1 GB model over NIXL loopback (2026-12-04: "
                         "0.140 s); set the fabric's rate for another path",
}


@dataclass(frozen=True)
class DeltaChoice:
    """Whether one trainer rank's delta was taken on one sync, and the prediction that decided it."""

    trainer: int
    taken: bool
    path: str  # "host" or "device": where this receiver decodes and applies
    density: float | None  # changed units over page units, as the trainer measured them (None: not recorded)
    delta_bytes: int  # page index and blobs this rank would READ
    full_bytes: int  # the READs the delta replaces
    delta_seconds: float  # predicted: READ the delta, then decode and apply it
    full_seconds: float  # predicted: READ the full bytes

    @property
    def why(self) -> str:
        density = "" if self.density is None else f" at density {self.density:.4g}"
        verdict = "delta" if self.taken else "full"
        return (f"trainer rank {self.trainer}: {verdict}{density}: delta {self.delta_seconds:.3g} s ({self.delta_bytes} B "
                f"read, applied on the {self.path}) vs full {self.full_seconds:.3g} s ({self.full_bytes} B)")


def choose(rates: DeltaRates, trainer: int, path: str, density: float | None, delta_bytes: int, full_bytes: int,
           apply_bytes: int) -> DeltaChoice:
    """Take the delta iff READing `delta_bytes` and applying `apply_bytes` of blobs is predicted faster than READing
    `full_bytes`; the bytes written are the same either way."""
    read = rates.read_gbytes_per_s * 1e9
    delta = delta_bytes / read + apply_bytes / (rates.apply_gbytes_per_s(path) * 1e9)
    full = full_bytes / read
    return DeltaChoice(trainer, delta < full, path, density, delta_bytes, full_bytes, delta, full)
