"""A peer task in its own process for the tests: starts task --task of --cluster (JSON),
prints "ready", sends the float32 array "x" (arange(1024)) to worker:0 at step 1, and stays
until killed or until its standard input closes."""

import argparse
import json
import sys

import numpy as np

import tensorverbs as tv


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--task", type=int, required=True)
    parser.add_argument("--protocol", default="grpc+verbs")
    args = parser.parse_args()
    with tv.Server(json.loads(args.cluster), "worker", args.task, args.protocol) as server:
        print("ready", flush=True)
        server.wait_for_peers(30)
        with server.step(1) as step:
            step.send("worker:0", "x", np.arange(1024, dtype=np.float32))
            sys.stdin.read()  # until the test closes it, or kills this process


if __name__ == "__main__":
    main()
