#!/usr/bin/env python3
"""torch.distributed collectives over the tensorverbs backend against gloo, on this host.

    PYTHONPATH=build/python python3 bench/torch_bench.py --ranks 4 --repeat 3 --json out.json

For each backend it starts --ranks processes (one torch thread each) that time all_reduce
(SUM, float32) per size: each size runs until --seconds pass, and the figure is the mean time
of one all_reduce on rank 0, after a barrier. Then it runs examples/torch_ddp/train.py with each
backend and reads the median DDP step time it prints, and the same passes timed without the
gradient all_reduce (no_sync): the step's share spent communicating is one less their ratio.
Backends alternate within each of the
--repeat runs, and each figure is given as the median and spread of the runs. The point to point
figures (streams and round trips) are bench/python_bench.py's, with --torch-backend.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_size(text):
    for unit in sorted(UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return int(text[: -len(unit)]) * UNITS[unit]
    return int(text)


def rank_role(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.backend == "tensorverbs":
        import tensorverbs.torch  # noqa: F401 (registers the backend)
    dist.init_process_group(args.backend, init_method="file://" + args.store, rank=args.rank,
                            world_size=args.ranks)
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        t = torch.ones(max(size // 4, 1))
        for _ in range(3):
            dist.all_reduce(t)
        done = 0
        dist.barrier()
        start = time.perf_counter()
        flag = torch.ones(1)
        while True:
            for _ in range(4):
                dist.all_reduce(t)
            done += 4
            # Rank 0 decides when to stop, so every rank runs the same number.
            flag[0] = 1.0 if time.perf_counter() - start < args.seconds else 0.0
            dist.broadcast(flag, 0)
            if flag[0] == 0:
                break
        elapsed = time.perf_counter() - start
        if args.rank == 0:
            print(json.dumps({"bytes": size, "us": elapsed / done * 1e6, "count": done}),
                  flush=True)
    dist.destroy_process_group()


def run_ranks(backend, args):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "rank", "--backend", backend,
               "--ranks", str(args.ranks), "--sizes", args.sizes, "--seconds", str(args.seconds),
               "--store", os.path.join(tmp, "store")]
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, text=True)
                 for r in range(args.ranks)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        for p in procs:
            if p.returncode != 0:
                raise RuntimeError(f"{backend}: a rank exited {p.returncode}")
    return [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]


def ddp_step_ms(backend, args):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "torch_ddp", "train.py"),
                          "--backend", backend, "--nprocs", str(args.ranks), "--steps",
                          str(args.ddp_steps)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=600)
    m = re.search(r"median step ([0-9.]+) ms", run.stdout)
    if run.returncode != 0 or m is None:
        raise RuntimeError(f"DDP on {backend} failed:\n{run.stdout}")
    alone = re.search(r"compute alone ([0-9.]+) ms", run.stdout)
    return float(m.group(1)), float(alone.group(1)) if alone else None


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": len(values)}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--sizes", default="4B,4KiB,256KiB,4MiB,64MiB")
    p.add_argument("--seconds", type=float, default=1.0, help="per size, backend and run")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--backends", default="tensorverbs,gloo")
    p.add_argument("--ddp-steps", type=int, default=40)
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "rank":
        return rank_role(args)

    backends = args.backends.split(",")
    allreduce = {b: {} for b in backends}
    ddp = {b: [] for b in backends}
    alone = {b: [] for b in backends}
    for _ in range(args.repeat):
        for b in backends:
            for row in run_ranks(b, args):
                allreduce[b].setdefault(row["bytes"], []).append(row["us"])
            if not args.no_ddp:
                step, compute = ddp_step_ms(b, args)
                ddp[b].append(step)
                if compute is not None:
                    alone[b].append(compute)
    results = {"ranks": args.ranks, "seconds": args.seconds, "all_reduce": [], "ddp_step_ms": {},
               "ddp_compute_alone_ms": {}, "ddp_communication_share": {}}
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        row = {"bytes": size}
        line = f"all_reduce {size:>10} B"
        for b in backends:
            row[b] = spread(allreduce[b][size])
            us = row[b]["median"]
            line += f"  {b} {us:10.1f} us {size / us / 1e3:7.3f} GB/s"
        if len(backends) == 2:
            row["ratio"] = row[backends[1]]["median"] / row[backends[0]]["median"]
            line += f"  {backends[0]} {row['ratio']:.2f}x faster"
        print(line, flush=True)
        results["all_reduce"].append(row)
    if not args.no_ddp:
        line = f"DDP step, {args.ranks} ranks:"
        for b in backends:
            results["ddp_step_ms"][b] = spread(ddp[b])
            line += f"  {b} {results['ddp_step_ms'][b]['median']:.2f} ms"
            if alone[b]:
                # The step less the same passes without the gradient all_reduce, as a share.
                results["ddp_compute_alone_ms"][b] = spread(alone[b])
                share = [max(0.0, 1 - a / s) for a, s in zip(alone[b], ddp[b])]
                results["ddp_communication_share"][b] = spread(share)
                line += f" (communicating {100 * statistics.median(share):.0f}%)"
        if len(backends) == 2:
            ratio = (results["ddp_step_ms"][backends[1]]["median"] /
                     results["ddp_step_ms"][backends[0]]["median"])
            results["ddp_ratio"] = ratio
            line += f"  {backends[0]} {ratio:.2f}x faster"
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
