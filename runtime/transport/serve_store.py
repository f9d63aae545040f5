"""`weightplan-store`: host a job's rendezvous TCPStore in a process of its own, so no trainer's death takes its records."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ..errors import WeightplanError, one_line
from .etcd_store import is_etcd
from .rendezvous import DEFAULT_ADDRESS, Rendezvous


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="weightplan-store",
        description="Serve the rendezvous TCPStore of a weightplan job until SIGTERM or Ctrl-C; every trainer and "
                    "inference process then connects to --address (none of them serves it).")
    parser.add_argument("--job", required=True, help="the job id every process of the job uses")
    parser.add_argument("--address", default=DEFAULT_ADDRESS,
                        help=f"HOST:PORT to listen on, that host only (default {DEFAULT_ADDRESS}; port 0: a free one). "
                             "Off loopback the job needs a secret (WEIGHTPLAN_SECRET_FILE or WEIGHTPLAN_SECRET)")
    parser.add_argument("--insecure", action="store_true", help="serve off loopback without a job secret")
    args = parser.parse_args(argv)
    stop = threading.Event()
    try:
        if is_etcd(args.address):
            raise WeightplanError(f"{args.address} is an etcd cluster, which etcd serves: give every process of the job "
                                  "that address, and run no weightplan-store")
        store = Rendezvous.connect(args.job, args.address, serve=True, insecure=args.insecure)
    except WeightplanError as exc:
        print(f"weightplan-store: {one_line(exc)}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    print(f"weightplan-store: serving job {args.job!r} at {store.address}", flush=True)
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
