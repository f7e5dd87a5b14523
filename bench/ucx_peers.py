#!/usr/bin/env python3
"""tensorverbs beside UCX over shared memory on this host, in one run, size by size.

For each size it runs, alternating, --repeat times:
  ucx tag_bw    ucx_perftest's UCP tag messages, streamed (UCX_TLS=shm,self): GB/s, messages/s
  ucx tag_lat   its tag ping-pong: one-way latency p50
  ucx put_bw    UCT puts into the peer's mapped shared memory (posix transport): GB/s
  tensorverbs   `tensorverbs bench p2p --protocols grpc+verbs` (the default configuration): a
                stream of recvs with a window outstanding, GB/s; and the recv latency p50, a
                whole request and answer (a round trip, where UCX's tag_lat is one way)
and prints the medians with tensorverbs' ratio to each, within the same run.

    python3 bench/ucx_peers.py --sizes 4KiB,64KiB,1MiB --repeat 3 --json out.json

ucx_perftest comes from Debian's ucx-utils (scripts/install-deps.sh installs it). Every UCX
server listens on 127.0.0.1 on a free port; GB/s is 10^9 bytes per second throughout (UCX prints
MB/s of 2^20 bytes, converted here).
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}


def parse_size(text):
    for unit in sorted(UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return int(text[: -len(unit)]) * UNITS[unit]
    return int(text)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iterations(size, test):
    """Enough messages for about a quarter of a second of each test at this size."""
    per_byte = {"tag_lat": 20_000, "tag_bw": 400_000, "put_bw": 400_000}[test]
    return max(200, min(per_byte, (256 << 20) // max(size, 1)))


def ucx(test, size):
    """One ucx_perftest run (server and client); its CSV figures as a dict."""
    port = free_port()
    env = dict(os.environ)
    extra = []
    if test == "put_bw":
        extra = ["-x", "posix", "-d", "memory"]
    else:
        env["UCX_TLS"] = "shm,self"
    server = subprocess.Popen(["ucx_perftest", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):  # the server listens within moments
            try:
                out = subprocess.run(
                    ["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size),
                     "-n", str(iterations(size, test)), "-f", "-v"] + extra,
                    env=env, capture_output=True, text=True, timeout=120)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"ucx_perftest {test} {size} B did not finish in 120 s")
            if out.returncode == 0:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"ucx_perftest {test} {size} B failed: {out.stderr.strip()}")
    finally:
        server.kill()
        server.wait()
    # The CSV rows right-align their first column: " 256,83.796,..." at few iterations.
    lines = [l.strip() for l in out.stdout.splitlines() if l.strip()[:1].isdigit()]
    if not lines:
        raise RuntimeError(f"ucx_perftest {test} {size} B printed no figures:\n{out.stdout}"
                           f"\n{out.stderr}")
    fields = lines[-1].split(",")
    return {"p50_us": float(fields[1]), "gbps": float(fields[5]) * (1 << 20) / 1e9,
            "msg_per_s": float(fields[7])}


def tensorverbs(tool, size):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p2p.json")
        run = subprocess.run([tool, "bench", "p2p", "--protocols", "grpc+verbs", "--sizes",
                              str(size), "--repeat", "1", "--no-baselines", "--json", path],
                             capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise RuntimeError(f"tensorverbs bench p2p failed:\n{run.stdout}\n{run.stderr}")
        rows = [r for r in json.load(open(path)) if r.get("protocol") == "grpc+verbs"]
    return {"p50_us": rows[0]["p50_us"], "gbps": rows[0]["bandwidth_gbps"],
            "msg_per_s": rows[0]["bandwidth_gbps"] * 1e9 / size}


def median(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tool", default=os.path.join(ROOT, "build", "tools", "tensorverbs"))
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if shutil.which("ucx_perftest") is None:
        sys.exit("ucx_perftest not found: install Debian's ucx-utils (scripts/install-deps.sh)")
    results = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        runs = {"ucx_tag_bw": [], "ucx_tag_lat": [], "ucx_put_bw": [], "tensorverbs": []}
        for _ in range(args.repeat):
            runs["ucx_tag_bw"].append(ucx("tag_bw", size))
            runs["tensorverbs"].append(tensorverbs(args.tool, size))
            runs["ucx_tag_lat"].append(ucx("tag_lat", size))
            runs["ucx_put_bw"].append(ucx("put_bw", size))
        row = {"size_bytes": size, "repeat": args.repeat}
        for name, figures in runs.items():
            for key in ("gbps", "p50_us", "msg_per_s"):
                row[f"{name}.{key}"] = median([f[key] for f in figures])
        # Ratios within each repetition, then their median: the runs drift together.
        row["bw_vs_tag"] = median([t["gbps"] / u["gbps"]
                                   for t, u in zip(runs["tensorverbs"], runs["ucx_tag_bw"])])
        row["bw_vs_put"] = median([t["gbps"] / u["gbps"]
                                   for t, u in zip(runs["tensorverbs"], runs["ucx_put_bw"])])
        results.append(row)
        print(f"{size:>10} B  tensorverbs {row['tensorverbs.gbps']['median']:8.3f} GB/s "
              f"(p50 {row['tensorverbs.p50_us']['median']:7.2f} us round trip)   "
              f"ucx tag {row['ucx_tag_bw.gbps']['median']:8.3f} GB/s "
              f"(p50 {row['ucx_tag_lat.p50_us']['median']:6.2f} us one way)   "
              f"ucx put {row['ucx_put_bw.gbps']['median']:8.3f} GB/s   "
              f"ratio to tag {row['bw_vs_tag']['median']:.2f}x "
              f"[{row['bw_vs_tag']['min']:.2f}-{row['bw_vs_tag']['max']:.2f}], "
              f"to put {row['bw_vs_put']['median']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
