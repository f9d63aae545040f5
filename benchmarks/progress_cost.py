"""CPU cost of each target-side progress mode of an idle NIXL agent: CPU seconds per wall second; last line JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time

from weightplan.runtime.transport.nixl_agent import NixlAgent


def idle_cpu(mode: str, seconds: float) -> float:
    """CPU seconds this process spends per wall second while one agent in `mode` sits idle (polling, for "poll")."""
    agent = NixlAgent(f"progress-cost.{mode}", mode)
    agent.background(True)
    time.sleep(0.2)  # let a progress thread start
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    agent.close()
    return cpu / wall


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="idle time measured per mode")
    parser.add_argument("--smoke", action="store_true", help="0.5 s per mode")
    args = parser.parse_args(argv)
    seconds = 0.5 if args.smoke else args.seconds
    figures = {mode: round(idle_cpu(mode, seconds), 4) for mode in ("none", "poll", "thread")}
    for mode, value in figures.items():
        print(f"{mode:>6}: {value:.4f} CPU s per wall s", file=sys.stderr)
    print(json.dumps({"idle_cpu_per_wall_s": figures, "seconds": seconds}))


if __name__ == "__main__":
    main()
