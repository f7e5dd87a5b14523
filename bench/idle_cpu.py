#!/usr/bin/env python3
"""CPU an idle task uses: two tasks in two processes set up their channels, exchange one tensor
each way, then sit idle for --seconds while each measures its own CPU time (user + system of
every thread: progress loop, watchdog, gRPC). Prints each task's share of one core.

    PYTHONPATH=build/python python3 bench/idle_cpu.py --seconds 20
    TENSORVERBS_POLL_MODE=busy PYTHONPATH=build/python python3 bench/idle_cpu.py

Each process sleeps in Python meanwhile, so what is counted is the task's own threads.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from bench_common import free_ports


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def task(args):
    import numpy as np

    import tensorverbs as tv

    cluster = {"worker": [f"127.0.0.1:{p}" for p in args.ports.split(",")]}
    peer = f"worker:{1 - args.rank}"
    with tv.Server(cluster, "worker", args.rank, args.protocol) as server:
        server.wait_for_peers(60)
        with server.step(1) as step:
            step.send(peer, "x", np.ones(1024, np.float32))
            step.recv(peer, "x", timeout=60)
            step.wait_until_sends_taken(60)
        time.sleep(1)  # what the exchange left behind settles
        start_cpu, start = cpu_seconds(), time.monotonic()
        time.sleep(args.seconds)
        cpu, wall = cpu_seconds() - start_cpu, time.monotonic() - start
        # Both stay up until both measured: step 2 is the all-clear.
        with server.step(2) as step:
            step.send(peer, "done", [b"done"])
            step.recv(peer, "done", timeout=60)
            step.wait_until_sends_taken(60)
        print(json.dumps({"rank": args.rank, "cpu_s": cpu, "wall_s": wall,
                          "core_percent": 100 * cpu / wall}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--protocol", default="grpc+verbs")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return task(args)
    ports = ",".join(map(str, free_ports(2)))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r),
                               "--ports", ports, "--seconds", str(args.seconds),
                               "--protocol", args.protocol], stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=args.seconds + 180)
        if p.returncode != 0:
            sys.exit(f"a task exited {p.returncode}")
        for line in out.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                print(f"task {r['rank']}: {r['core_percent']:.2f} % of one core idle "
                      f"({r['cpu_s']:.3f} s CPU in {r['wall_s']:.1f} s), {args.protocol}, "
                      f"poll mode {os.environ.get('TENSORVERBS_POLL_MODE', 'default')}")


if __name__ == "__main__":
    main()
