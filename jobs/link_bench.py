"""``dtm bench comm`` between two "hosts" joined by a link of a chosen speed, on one machine.

One rank in each of two Linux network namespaces, each joined by a veth link to a bridge
(``tests/netns_hosts.py``), Open MPI over TCP only (no shared memory), both links shaped by
``tc`` (``tbf rate RATE``): what a collective costs where a network, not memory, is the limit
-- the case the quantized allreduce and payload checksums are for. Needs root and iproute2
(it says why not otherwise, exit 2). The arguments after ``--`` go to ``dtm bench comm``.

    python jobs/link_bench.py --rate 1gbit -- --ops allreduce --sizes 1M,8M --quantize 64
    python jobs/link_bench.py --rate 1gbit -- --ops allreduce,all_to_all --integrity
    python jobs/link_bench.py --rate none -- --ops allreduce     # the veth link unshaped

The figures are this machine's: both ranks, the kernel's TCP stack and the shaping share its
cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.netns_hosts import make_hosts, why_not


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="tc rate of each link (none: unshaped)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then dtm bench comm's options")
    args = ap.parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    reason = why_not()
    if reason is not None:
        print(f"link_bench: {reason}", file=sys.stderr)
        return 2
    hosts = make_hosts()
    try:
        if args.rate != "none":
            # a burst of 256 kbit and 50 ms of queue: the shaping of a switch port, not a cap
            # that drops every burst
            reason = hosts.shape(f"tbf rate {args.rate} burst 256kbit latency 50ms")
            if reason is not None:
                print(f"link_bench: {reason}", file=sys.stderr)
                return 2
        print(f"link: {args.rate} each way (tc tbf on both veth ends), TCP only, 1 rank per host")
        cmd = [sys.executable, "-m", "mpi4py", "-m", "dtm_mpi", "bench", "comm", *bench]
        done = hosts.mpirun((1, 1), *cmd, timeout=args.timeout)
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        return done.returncode
    finally:
        hosts.remove()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
