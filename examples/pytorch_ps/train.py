"""Data-parallel training of a PyTorch model with one parameter server and two workers, each a
Python process, exchanging parameters and gradients over tensorverbs (grpc+verbs by default).

    PYTHONPATH=build/python python3 examples/pytorch_ps/train.py            # starts all three
    python3 examples/pytorch_ps/train.py --job ps --task 0 --cluster ...     # one task, by hand

Each step, the parameter server sends the model's parameters to every worker; a worker computes
the loss and its gradients on its own shard of the data and sends them back with the loss; the
server averages the gradients, takes an SGD step and prints the mean loss. The parameters live
in the server's registered pool (`server.empty`, viewed by torch) and go out without a copy; the
workers compute on the received buffers themselves (`torch.from_numpy`).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch

import tensorverbs as tv

PS = "ps:0"


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def shard(worker, workers, samples=1024):
    """This worker's share of a fixed synthetic regression problem."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 16, generator=g)
    true_w = torch.randn(16, 1, generator=g)
    y = torch.sin(x @ true_w) + 0.1 * torch.randn(samples, 1, generator=g)
    return x[worker::workers], y[worker::workers]


def run_ps(server, workers, steps, lr):
    model = make_model()
    names = [name for name, _ in model.named_parameters()]
    # The parameters as torch views of pool memory: sent without a copy, updated in place.
    params = {}
    for name, p in model.named_parameters():
        params[name] = torch.from_numpy(server.empty(tuple(p.shape), "float32"))
        params[name].copy_(p.detach())
    first = last = None
    for step_id in range(1, steps + 1):
        with server.step(step_id) as step:
            for w in range(workers):
                for name in names:
                    step.send(f"worker:{w}", f"param/{name}", params[name])
            grads = {name: torch.zeros_like(params[name]) for name in names}
            losses = []
            for w in range(workers):
                for name in names:
                    grads[name] += torch.from_numpy(step.recv(f"worker:{w}", f"grad/{name}"))
                losses.append(float(step.recv(f"worker:{w}", "loss")))
            # Every worker took this step's parameters before it sent its gradients, so they
            # can change now.
            with torch.no_grad():
                for name in names:
                    params[name] -= lr * grads[name] / workers
        loss = sum(losses) / len(losses)
        first = loss if first is None else first
        last = loss
        print(f"step {step_id} loss {loss:.4f}", flush=True)
    # The trained parameters go to every worker: their last recv, after which all tasks are
    # done with each other and may stop.
    with server.step(steps + 1) as step:
        for w in range(workers):
            for name in names:
                step.send(f"worker:{w}", f"param/{name}", params[name])
        step.wait_until_sends_taken(60)
    print(f"loss fell from {first:.4f} to {last:.4f} in {steps} steps", flush=True)


def run_worker(server, task, workers, steps):
    x, y = shard(task, workers)
    model = make_model()  # its structure only: the values come from the server each step
    names = [name for name, _ in model.named_parameters()]
    for step_id in range(1, steps + 1):
        with server.step(step_id) as step:
            # The received buffers themselves, as leaves autograd differentiates against.
            params = {name: torch.from_numpy(step.recv(PS, f"param/{name}")).requires_grad_()
                      for name in names}
            out = torch.func.functional_call(model, params, (x,)) if hasattr(torch, "func") \
                else _forward(params, x)
            loss = torch.nn.functional.mse_loss(out, y)
            loss.backward()
            for name in names:
                step.send(PS, f"grad/{name}", params[name].grad)
            step.send(PS, "loss", loss.detach().reshape(()))
            step.wait_until_sends_taken(60)  # ending a step drops what no peer took yet
    with server.step(steps + 1) as step:
        trained = {name: torch.from_numpy(step.recv(PS, f"param/{name}")) for name in names}
    if task == 0:
        with torch.no_grad():
            final = torch.nn.functional.mse_loss(torch.func.functional_call(model, trained, (x,))
                                                 if hasattr(torch, "func")
                                                 else _forward(trained, x), y)
        print(f"worker 0: loss on its shard with the trained parameters {float(final):.4f}",
              flush=True)


def _forward(params, x):
    # The model above, written out (PyTorch before torch.func).
    h = torch.tanh(x @ params["0.weight"].t() + params["0.bias"])
    return h @ params["2.weight"].t() + params["2.bias"]


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch(args):
    """Starts the server and the workers as processes of their own and waits for them."""
    ports = free_ports(1 + args.workers)
    cluster = {"ps": [f"127.0.0.1:{ports[0]}"],
               "worker": [f"127.0.0.1:{p}" for p in ports[1:]]}
    common = ["--cluster", json.dumps(cluster), "--steps", str(args.steps),
              "--protocol", args.protocol, "--lr", str(args.lr)]
    me = os.path.abspath(__file__)
    procs = [subprocess.Popen([sys.executable, me, "--job", "worker", "--task", str(w)] + common)
             for w in range(args.workers)]
    procs.insert(0, subprocess.Popen([sys.executable, me, "--job", "ps", "--task", "0"] + common))
    deadline = time.monotonic() + args.timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print(f"train.py: the tasks did not finish in {args.timeout} s", file=sys.stderr)
            return 1
    if any(codes):
        print(f"train.py: task exit codes {codes}", file=sys.stderr)
        return 1
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=["ps", "worker"], help="run one task (else all)")
    parser.add_argument("--task", type=int, default=0)
    parser.add_argument("--cluster", help="JSON: {\"ps\": [host:port], \"worker\": [...]}")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--protocol", default="grpc+verbs", choices=tv.available_protocols())
    parser.add_argument("--timeout", type=float, default=300, help="seconds, for all tasks")
    args = parser.parse_args()
    if args.job is None:
        return launch(args)
    cluster = json.loads(args.cluster)
    workers = len(cluster["worker"])
    with tv.Server(cluster, args.job, args.task, args.protocol, recv_timeout=60) as server:
        server.wait_for_peers(60)
        if args.job == "ps":
            run_ps(server, workers, args.steps, args.lr)
        else:
            run_worker(server, args.task, workers, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
