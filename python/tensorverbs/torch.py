"""The `tensorverbs` backend of torch.distributed.

    import torch.distributed as dist
    import tensorverbs.torch  # registers the backend

    dist.init_process_group("tensorverbs", init_method="tcp://10.0.0.1:29500",
                            rank=rank, world_size=world_size)
    dist.all_reduce(tensor)

Every rank starts a tensorverbs task and meets the others through torch's store (any
init_method: tcp://, file://, env://). The backend is C++ (PyTorch's c10d API): no Python runs
per tensor. It moves CPU tensors of every numeric dtype and bool, contiguous and dense:

- point to point: send, recv (also from any source), isend, irecv, batch_isend_irecv, tags;
- collectives: barrier, broadcast, all_reduce (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR),
  reduce, all_gather, all_gather_into_tensor, gather, scatter, reduce_scatter,
  reduce_scatter_tensor, all_to_all, all_to_all_single; binomial trees for small tensors, rings
  for large ones.

A send copies the tensor once into the task's registered pool and completes at once; a
received message lands in the pool (over RDMA writes with grpc+verbs) and is copied once into
the caller's tensor. `stats(group)` counts both copies.

Settings come from the environment: TENSORVERBS_PROTOCOL (grpc+verbs by default; grpc,
grpc+verbs-copy, ...), TENSORVERBS_HOST (the address peers reach this rank at; by default this
host's name resolved), and every TENSORVERBS_* variable of the task (fabric, pool, peer timeout).
The timeout of init_process_group bounds every operation. A collective that fails (a peer died,
a timeout) raises from wait() naming the operation and the peer's rank and task, and fails the
group's later collectives: the ranks no longer agree where they are, so make a new group.
"""

import atexit
import datetime

import torch.distributed as _dist

from . import _tensorverbs_torch

__all__ = ["BACKEND", "stats"]

BACKEND = "tensorverbs"


def _create(store, rank, size, timeout):
    return _tensorverbs_torch.create_process_group(store, rank, size, timeout)


def stats(group=None):
    """Counters of a tensorverbs group (the default group when None): staged_copies and
    staged_bytes (sends copied into the pool), lent_sends and lent_bytes (sends written from the
    caller's tensor itself), landed_copies and landed_bytes (received messages copied into
    tensors), in_place_recvs and in_place_bytes (messages the fabric wrote straight into the
    recv's tensor), collectives, collectives_on_caller (run by the thread that waited for them
    rather than the group's worker), same_host_collectives (all_reduce and reduce_scatter done
    through the ranks' shared memory, every rank being on this host) and failed, and the
    protocol."""
    if group is None:
        group = _dist.distributed_c10d._get_default_group()
    return _tensorverbs_torch.stats(group)


@atexit.register
def _drain():
    # A rank that exits right after its last collective may not have had every message of it
    # taken yet; the ranks still waiting for them would fail. Wait (bounded) until they are.
    _tensorverbs_torch.drain_all(datetime.timedelta(seconds=10))


# A second import (a reload) must not register the name twice: torch refuses that.
if BACKEND.upper() not in _dist.Backend._plugins:
    _dist.Backend.register_backend(BACKEND, _create)
