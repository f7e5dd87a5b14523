"""DistributedDataParallel training with the `tensorverbs` torch.distributed backend.

    PYTHONPATH=build/python python3 examples/torch_ddp/train.py --nprocs 4
    PYTHONPATH=build/python python3 examples/torch_ddp/train.py --backend gloo   # the same on gloo
    torchrun --nproc_per_node 4 examples/torch_ddp/train.py                       # one rank each

Every rank trains the same model on its own shard of a synthetic regression problem; DDP
averages the gradients with all_reduce over the backend after each backward pass, so every rank
takes the same step. Rank 0 prints the mean loss of each step and the mean step time. Run as it
is, the script starts --nprocs ranks itself and meets them through a file store; under torchrun
(RANK and WORLD_SIZE set) it is one rank and meets the others through env://.
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
from torch.nn.parallel import DistributedDataParallel as DDP


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                               torch.nn.Tanh(), torch.nn.Linear(256, 1))


def shard(rank, world, samples=4096):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 32, generator=g)
    true_w = torch.randn(32, 1, generator=g)
    y = torch.tanh(x @ true_w / 4) + 0.01 * torch.randn(samples, 1, generator=g)
    return x[rank::world], y[rank::world]


def train(rank, world, args, init_method):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if args.backend == "tensorverbs":
        import tensorverbs.torch  # noqa: F401 (registers the backend)
    dist.init_process_group(args.backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, y = shard(rank, world)
    batch = args.batch // world
    times = []
    for step in range(args.steps):
        lo = (step * batch) % len(x)
        xb, yb = x[lo:lo + batch], y[lo:lo + batch]
        started = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()  # DDP's all_reduce of the gradients runs here
        opt.step()
        times.append(time.perf_counter() - started)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {mean.item() / world:.6f}", flush=True)
    # The same forward and backward passes without DDP's gradient all_reduce (no_sync), the
    # ranks still sharing the cores: what a step costs without communication.
    alone = []
    for step in range(args.compute_steps):
        lo = (step * batch) % len(x)
        started = time.perf_counter()
        opt.zero_grad()
        with model.no_sync():
            torch.nn.functional.mse_loss(model(x[lo:lo + batch]), y[lo:lo + batch]).backward()
        alone.append(time.perf_counter() - started)
    opt.zero_grad()
    if rank == 0:
        steady = sorted(times[len(times) // 4:])
        step_ms = 1e3 * steady[len(steady) // 2]
        if alone:
            alone_ms = 1e3 * sorted(alone)[len(alone) // 2]
            share = max(0.0, 1 - alone_ms / step_ms)
            print(f"{args.backend}: {world} ranks, compute alone {alone_ms:.2f} ms a step, "
                  f"communication {100 * share:.0f}% of the step", flush=True)
        print(f"{args.backend}: {world} ranks, median step {step_ms:.2f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def spawned(rank, world, args, store):
    train(rank, world, args, "file://" + store)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="tensorverbs")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--compute-steps", type=int, default=10,
                   help="steps timed without the gradient all_reduce (0: none)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(spawned, args=(args.nprocs, args, os.path.join(tmp, "store")),
                 nprocs=args.nprocs, join=True)


if __name__ == "__main__":
    sys.exit(main())
