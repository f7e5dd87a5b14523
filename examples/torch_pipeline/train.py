"""Two-stage pipeline-parallel training with the `tensorverbs` torch.distributed backend.

    PYTHONPATH=build/python python3 examples/torch_pipeline/train.py
    PYTHONPATH=build/python python3 examples/torch_pipeline/train.py --backend gloo

The model is cut in two: rank 0 holds the first layers and rank 1 the rest with the loss. Each
step splits the batch into micro-batches. Rank 0 runs their forward passes and sends each
activation to rank 1 with isend; rank 1 receives them with irecv, runs its forward and backward
passes and sends back the gradient of each activation; rank 0 receives those and finishes the
backward pass through its layers (GPipe's schedule: all forwards, then all backwards). Each rank
then takes its own optimizer step. Rank 1 prints the loss of each step.
"""

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 128


def stages():
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(32, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
    second = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                                 torch.nn.Linear(HIDDEN, 1))
    return first, second


def data(samples=2048):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 32, generator=g)
    true_w = torch.randn(32, 1, generator=g)
    return x, torch.tanh(x @ true_w / 4) + 0.01 * torch.randn(samples, 1, generator=g)


def run(rank, args, store):
    torch.set_num_threads(1)
    if args.backend == "tensorverbs":
        import tensorverbs.torch  # noqa: F401 (registers the backend)
    dist.init_process_group(args.backend, init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=args.timeout))
    model = stages()[rank]
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, y = data()
    micro = args.batch // args.micro_batches
    times = []
    for step in range(args.steps):
        lo = (step * args.batch) % len(x)
        started = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            outs = []
            sends = []
            for m in range(args.micro_batches):
                out = model(x[lo + m * micro:lo + (m + 1) * micro])
                outs.append(out)
                sends.append(dist.isend(out.detach(), 1, tag=m))
            grads = [torch.empty(micro, HIDDEN) for _ in range(args.micro_batches)]
            recvs = [dist.irecv(grads[m], 1, tag=m) for m in range(args.micro_batches)]
            for m in reversed(range(args.micro_batches)):
                recvs[m].wait()
                outs[m].backward(grads[m])
            for s in sends:
                s.wait()
        else:
            acts = [torch.empty(micro, HIDDEN) for _ in range(args.micro_batches)]
            recvs = [dist.irecv(acts[m], 0, tag=m) for m in range(args.micro_batches)]
            total = 0.0
            sends = []
            for m in reversed(range(args.micro_batches)):
                recvs[m].wait()
                act = acts[m].requires_grad_()
                target = y[lo + m * micro:lo + (m + 1) * micro]
                loss = torch.nn.functional.mse_loss(model(act), target) / args.micro_batches
                loss.backward()
                total += loss.item()
                sends.append(dist.isend(act.grad, 0, tag=m))
            for s in sends:
                s.wait()
            print(f"step {step} loss {total:.6f}", flush=True)
        opt.step()
        times.append(time.perf_counter() - started)
    if rank == 1:
        steady = sorted(times[len(times) // 4:])
        print(f"{args.backend}: median step {1e3 * steady[len(steady) // 2]:.2f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="tensorverbs")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(args, os.path.join(tmp, "store")), nprocs=2, join=True)


if __name__ == "__main__":
    sys.exit(main())
