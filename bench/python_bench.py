#!/usr/bin/env python3
"""The Python API against torch.distributed's gloo backend, two processes on this host.

For each size it measures, on the receiving process:
  stream      a step of --count tensors sent at once and received, repeated for --seconds:
              tensors/s and bytes/s, received with recv_async (one future per tensor), with
              recv_many (one call per step) and with blocking recvs, and over gloo with
              isend/irecv (the receiver posts every irecv, then waits for them all);
  recv latency  a chain of blocking recvs of a tensor sent before it is asked for, each in its
              own step with the same key, as `tensorverbs bench p2p` times the C++ recv:
              p50 and p90 in microseconds (tensorverbs only);
  round trip  one tensor there and one back, repeated: the p50 and p90 in microseconds.

With --torch-backend, the stream and round trip also run through torch.distributed over the
tensorverbs backend (rows "tvtorch"), the same calls as gloo's.

    PYTHONPATH=build/python python3 bench/python_bench.py --json out.json
    python3 bench/python_bench.py --sizes 4B,64KiB --seconds 1 --no-gloo

Each figure runs in a fresh pair of processes. The machine is noisy: --repeat N gives each
figure's median and spread over N runs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import free_ports

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text):
    for unit in sorted(UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return int(text[: -len(unit)]) * UNITS[unit]
    return int(text)


# --- the two roles, each in its own process -------------------------------------------------


def tensorverbs_role(args):
    import numpy as np

    import tensorverbs as tv

    ports = [int(p) for p in args.ports.split(",")]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    size = args.size
    names = [f"t{i}" for i in range(args.count)]
    with tv.Server(cluster, "worker", args.rank, args.protocol) as server:
        server.wait_for_peers(60)
        peer = f"worker:{1 - args.rank}"
        # Pool arrays: what a training loop sends without a copy.
        values = [server.empty(max(size // 4, 1), np.float32) for _ in range(args.count)]
        if args.figure == "round_trip":
            return tensorverbs_round_trip(server, args, peer, values[0])
        if args.figure == "recv_latency":
            return tensorverbs_recv_latency(server, args, peer, values[0])
        keys = [(peer, n) for n in names]
        if args.rank == 1:
            return tensorverbs_sender(server, peer, names, values)
        step_id = 0
        received = 0
        start = time.perf_counter()
        end = start + args.seconds
        while time.perf_counter() < end:
            step_id += 1
            with server.step(step_id) as step:
                if args.method == "recv_async":
                    futures = [step.recv_async(peer, n) for n in names]
                    for f in futures:
                        f.result()
                elif args.method == "recv_many":
                    step.recv_many(keys)
                else:
                    for n in names:
                        step.recv(peer, n)
            received += args.count
        elapsed = time.perf_counter() - start
        # Step 0 carries the sender's "stop", kept until it is taken.
        with server.step(0) as control:
            control.send(peer, "stop", [b"stop"])
            control.wait_until_sends_taken(60)
        print(json.dumps({"tensors_per_s": received / elapsed,
                          "bytes_per_s": received * size / elapsed}), flush=True)


def tensorverbs_sender(server, peer, names, values):
    import tensorverbs as tv

    with server.step(0) as control:
        stop = control.recv_async(peer, "stop")
        step_id = 0
        while not stop.done():
            step_id += 1
            with server.step(step_id) as step:
                if hasattr(step, "send_many"):
                    step.send_many([(peer, n, v) for n, v in zip(names, values)])
                else:  # an older package (a baseline)
                    for n, v in zip(names, values):
                        step.send(peer, n, v)
                while not stop.done():
                    try:
                        step.wait_until_sends_taken(0.05)
                        break
                    except tv.DeadlineExceededError:
                        pass
        stop.result()


def tensorverbs_round_trip(server, args, peer, value):
    samples = []
    step_id = 0
    end = time.perf_counter() + args.seconds
    while True:
        step_id += 1
        with server.step(step_id) as step:
            if args.rank == 0:
                t0 = time.perf_counter()
                step.send(peer, "ping", value)
                step.recv(peer, "pong")
                samples.append(time.perf_counter() - t0)
                stop = time.perf_counter() >= end
                step.send(peer, "more", [b"0" if stop else b"1"])
                step.wait_until_sends_taken(60)
                if stop:
                    break
            else:
                step.send(peer, "pong", step.recv(peer, "ping"))
                more = step.recv(peer, "more")
                step.wait_until_sends_taken(60)
                if more == [b"0"]:
                    return
    print(json.dumps(percentiles(samples)), flush=True)


def tensorverbs_recv_latency(server, args, peer, value):
    """As `tensorverbs bench p2p` times a recv: each recv its own step, the same key, the tensor
    sent before it is asked for; a chain of blocking recvs."""
    steps = args.latency_steps
    if args.rank == 1:
        held = []
        for step_id in range(1, steps + 1):
            step = server.step(step_id)
            step.send(peer, "x", value)
            held.append(step)
        with server.step(0) as control:
            control.recv(peer, "done", timeout=600)
        for step in held:
            step.end()
        return
    samples = []
    for step_id in range(1, steps + 1):
        with server.step(step_id) as step:
            t0 = time.perf_counter()
            step.recv(peer, "x")
            samples.append(time.perf_counter() - t0)
    with server.step(0) as control:
        control.send(peer, "done", [b"done"])
        control.wait_until_sends_taken(60)
    # The first tenth warms up (channels, pools, caches).
    print(json.dumps(percentiles(samples[steps // 10:])), flush=True)


def torch_role(args):
    """torch.distributed's isend/irecv and send/recv, over gloo or the tensorverbs backend."""
    import torch
    import torch.distributed as dist

    backend = "gloo"
    if args.role == "tvtorch":
        import tensorverbs.torch  # noqa: F401 (registers the backend)
        backend = "tensorverbs"
        os.environ["TENSORVERBS_PROTOCOL"] = args.protocol
    store = dist.FileStore(args.store, 2)
    dist.init_process_group(backend, store=store, rank=args.rank, world_size=2)
    peer = 1 - args.rank
    elements = max(args.size // 4, 1)
    tensors = [torch.zeros(elements, dtype=torch.float32) for _ in range(args.count)]
    if args.figure == "round_trip":
        samples = []
        flag = torch.zeros(1, dtype=torch.int32)
        end = time.perf_counter() + args.seconds
        while True:
            if args.rank == 0:
                t0 = time.perf_counter()
                dist.send(tensors[0], peer)
                dist.recv(tensors[0], peer)
                samples.append(time.perf_counter() - t0)
                stop = time.perf_counter() >= end
                flag[0] = 0 if stop else 1
                dist.send(flag, peer)
                if stop:
                    break
            else:
                dist.recv(tensors[0], peer)
                dist.send(tensors[0], peer)
                dist.recv(flag, peer)
                if flag[0] == 0:
                    break
        if args.rank == 0:
            print(json.dumps(percentiles(samples)), flush=True)
        dist.destroy_process_group()
        return
    go = torch.ones(1, dtype=torch.int32)
    received = 0
    start = time.perf_counter()
    end = start + args.seconds
    while True:
        # Rank 0 says whether another step follows, so both ranks agree on the last one.
        if args.rank == 0:
            go[0] = 1 if time.perf_counter() < end else 0
            dist.send(go, peer)
        else:
            dist.recv(go, peer)
        if go[0] == 0:
            break
        if args.rank == 1:
            works = [dist.isend(t, peer, tag=i) for i, t in enumerate(tensors)]
        else:
            works = [dist.irecv(t, peer, tag=i) for i, t in enumerate(tensors)]
        for w in works:
            w.wait()
        received += args.count
    elapsed = time.perf_counter() - start
    if args.rank == 0:
        print(json.dumps({"tensors_per_s": received / elapsed,
                          "bytes_per_s": received * args.size / elapsed}), flush=True)
    dist.destroy_process_group()


def percentiles(samples):
    samples.sort()
    return {"p50_us": samples[len(samples) // 2] * 1e6,
            "p90_us": samples[int(len(samples) * 0.9)] * 1e6,
            "round_trips": len(samples)}


# --- the driver ------------------------------------------------------------------------------


def count_for(size, args):
    """Tensors per stream step: --count, fewer for large sizes (at most 128 MiB a step)."""
    return min(args.count, max(2, (128 << 20) // max(size, 1)))


def run_pair(backend, figure, size, args, method=""):
    ports = free_ports(2)
    with tempfile.TemporaryDirectory() as tmp:
        common = [sys.executable, os.path.abspath(__file__), "--role", backend,
                  "--figure", figure, "--size", str(size), "--count", str(count_for(size, args)),
                  "--seconds", str(args.seconds), "--protocol", args.protocol,
                  "--method", method, "--ports", ",".join(map(str, ports)),
                  "--latency-steps", str(args.latency_steps),
                  "--store", os.path.join(tmp, "store")]
        procs = [subprocess.Popen(common + ["--rank", str(r)], stdout=subprocess.PIPE,
                                  text=True) for r in (0, 1)]
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=args.seconds * 10 + 120)
            if p.returncode != 0:
                raise RuntimeError(f"{backend} {figure} {size} B: a process exited {p.returncode}")
            outs.append(out)
    lines = [line for line in outs[0].splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def summarize(runs, key):
    values = [r[key] for r in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": len(values)}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4B,64KiB,1MiB,64MiB")
    parser.add_argument("--count", type=int, default=256,
                        help="tensors per stream step (fewer above 512 KiB: 128 MiB a step)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per figure and run")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--protocol", default="grpc+verbs")
    parser.add_argument("--methods", default="recv_async,recv_many,recv")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--torch-backend", action="store_true",
                        help="also torch.distributed over the tensorverbs backend (tvtorch)")
    parser.add_argument("--no-round-trip", action="store_true")
    parser.add_argument("--latency-steps", type=int, default=3000,
                        help="recvs in the recv_latency figure")
    parser.add_argument("--json", help="write the figures here")
    # A role's own arguments (the driver starts two processes of this script).
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--figure", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "tensorverbs":
        return tensorverbs_role(args)
    if args.role in ("gloo", "tvtorch"):
        return torch_role(args)

    results = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        rows = [("tensorverbs", "stream", m) for m in args.methods.split(",")]
        if args.torch_backend:
            rows.append(("tvtorch", "stream", "isend/irecv"))
        if not args.no_gloo:
            rows.append(("gloo", "stream", "isend/irecv"))
        if not args.no_round_trip:
            rows.append(("tensorverbs", "recv_latency", "recv"))
            rows.append(("tensorverbs", "round_trip", "recv"))
            if args.torch_backend:
                rows.append(("tvtorch", "round_trip", "send/recv"))
            if not args.no_gloo:
                rows.append(("gloo", "round_trip", "send/recv"))
        for backend, figure, method in rows:
            runs = [run_pair(backend, figure, size, args, method) for _ in range(args.repeat)]
            row = {"backend": backend, "figure": figure, "method": method, "bytes": size,
                   "count": count_for(size, args)}
            if figure == "stream":
                row["tensors_per_s"] = summarize(runs, "tensors_per_s")
                row["bytes_per_s"] = summarize(runs, "bytes_per_s")
                shown = (f"{row['tensors_per_s']['median']:>12,.0f} tensors/s "
                         f"{row['bytes_per_s']['median'] / 1e9:8.3f} GB/s")
            else:
                row["p50_us"] = summarize(runs, "p50_us")
                row["p90_us"] = summarize(runs, "p90_us")
                shown = f"p50 {row['p50_us']['median']:9.1f} us  p90 {row['p90_us']['median']:9.1f} us"
            print(f"{size:>10} B  {backend:<11} {figure:<10} {method:<12} {shown}", flush=True)
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"protocol": args.protocol, "count": args.count, "seconds": args.seconds,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
