"""One rank of a torch.distributed test over the tensorverbs backend, run as a process of its
own by test_torch_backend.py:

    torch_ranks.py SCENARIO RANK WORLD STORE_FILE

Each scenario checks its results itself and exits 0 when they are right; what it prints, the
test reads. The expected values are computed here from the same seeds on every rank.
"""

import datetime
import faulthandler
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import tensorverbs.torch as tvt

SCENARIO, RANK, WORLD, STORE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# A rank the harness finds hung gets SIGUSR1 first: every Python thread's stack, then gdb's.
faulthandler.register(signal.SIGUSR1, all_threads=True)
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("TV_TEST_TIMEOUT_S", "60")))


def init(world=WORLD, backend="tensorverbs", init_method=None):
    dist.init_process_group(backend, init_method=init_method or "file://" + STORE, rank=RANK,
                            world_size=world, timeout=TIMEOUT)


def value(rank, n, dtype, seed=0):
    """Rank `rank`'s tensor: small integers, exact in every dtype and in sums of a few ranks."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    v = torch.randint(1, 5, (n,), generator=g)
    if dtype == torch.bool:
        return v % 2 == 0
    return v.to(dtype)


def check(name, got, want):
    if not torch.equal(got, want):
        raise AssertionError(f"rank {RANK}: {name}: got {got[:8]} want {want[:8]}")


def reduce_all(tensors, op):
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op == dist.ReduceOp.SUM:
            out = out | t if out.dtype == torch.bool else out + t
        elif op == dist.ReduceOp.PRODUCT:
            out = out & t if out.dtype == torch.bool else out * t
        elif op == dist.ReduceOp.MIN:
            out = torch.minimum(out, t)
        elif op == dist.ReduceOp.MAX:
            out = torch.maximum(out, t)
        elif op == dist.ReduceOp.BAND:
            out = out & t
        elif op == dist.ReduceOp.BOR:
            out = out | t
        elif op == dist.ReduceOp.BXOR:
            out = out ^ t
    return out


def collectives():
    # 5 elements take the trees, 40,000 (160 KB of float32) the rings; 7 and 40,001 split
    # unevenly across the ranks.
    sizes = [1, 7, 40001]
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
    for n in sizes:
        for dtype in [torch.float32, torch.float64, torch.int64, torch.int32, torch.float16,
                      torch.bfloat16, torch.uint8, torch.bool]:
            for op in ops:
                if op == dist.ReduceOp.PRODUCT and dtype in (torch.uint8, torch.float16,
                                                             torch.bfloat16) and n > 7:
                    continue  # 4^WORLD overflows these; the small sizes cover them
                mine = [value(r, n, dtype, seed=n) for r in range(WORLD)]
                t = mine[RANK].clone()
                dist.all_reduce(t, op=op)
                check(f"all_reduce {op} {dtype}[{n}]", t, reduce_all(mine, op))
        mine = [value(r, n, torch.int64, seed=n + 1) for r in range(WORLD)]
        for op in [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]:
            t = mine[RANK].clone()
            dist.all_reduce(t, op=op)
            check(f"all_reduce {op} int64[{n}]", t, reduce_all(mine, op))
        floats = [value(r, n, torch.float64, seed=n + 2) for r in range(WORLD)]
        t = floats[RANK].clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        if not torch.allclose(t, sum(floats) / WORLD):
            raise AssertionError(f"rank {RANK}: AVG float64[{n}] {t[:4]}")

        for root in range(WORLD):
            t = value(root, n, torch.float32, seed=n + 3) if RANK == root else torch.zeros(n)
            dist.broadcast(t, root)
            check(f"broadcast from {root} [{n}]", t, value(root, n, torch.float32, seed=n + 3))
            t = mine[RANK].clone()
            dist.reduce(t, root, op=dist.ReduceOp.SUM)
            check(f"reduce to {root} [{n}]", t, sum(mine) if RANK == root else mine[RANK])
            gathered = [torch.zeros(n, dtype=torch.int64) for _ in range(WORLD)] \
                if RANK == root else None
            dist.gather(mine[RANK], gathered, dst=root)
            if RANK == root:
                for r in range(WORLD):
                    check(f"gather to {root} from {r}", gathered[r], mine[r])
            out = torch.zeros(n, dtype=torch.int64)
            pieces = [value(r, n, torch.int64, seed=n + 10 + root) for r in range(WORLD)]
            dist.scatter(out, pieces if RANK == root else None, src=root)
            check(f"scatter from {root}", out, pieces[RANK])

        outs = [torch.zeros(n, dtype=torch.int64) for _ in range(WORLD)]
        dist.all_gather(outs, mine[RANK])
        for r in range(WORLD):
            check(f"all_gather [{n}] from {r}", outs[r], mine[r])
        flat = torch.zeros(n * WORLD, dtype=torch.int64)
        dist.all_gather_into_tensor(flat, mine[RANK])
        check(f"all_gather_into_tensor [{n}]", flat, torch.cat(mine))

        # The coalesced forms: several tensors in one operation, as gloo's.
        for dtypes in ([torch.float32, torch.float32, torch.float32],
                       [torch.int64, torch.int64, torch.int64]):  # torch wants one dtype
            lengths = [n, 3, n + 5]
            mine3 = [[value(r, lengths[k], dtypes[k], seed=n + 20 + k) for k in range(3)]
                     for r in range(WORLD)]
            ts = [t.clone() for t in mine3[RANK]]
            dist.all_reduce_coalesced(ts)
            for k in range(3):
                check(f"all_reduce_coalesced {dtypes[k]}[{lengths[k]}]", ts[k],
                      reduce_all([mine3[r][k] for r in range(WORLD)], dist.ReduceOp.SUM))
            outs = [[torch.zeros(lengths[k], dtype=dtypes[k]) for k in range(3)]
                    for _ in range(WORLD)]
            dist.all_gather_coalesced(outs, mine3[RANK])
            for r in range(WORLD):
                for k in range(3):
                    check(f"all_gather_coalesced from {r} [{k}]", outs[r][k], mine3[r][k])

        blocks = [[value(r * WORLD + b, n, torch.float32, seed=n + 4) for b in range(WORLD)]
                  for r in range(WORLD)]
        out = torch.zeros(n)
        dist.reduce_scatter(out, blocks[RANK])
        check(f"reduce_scatter [{n}]", out, sum(blocks[r][RANK] for r in range(WORLD)))
        out = torch.zeros(n)
        dist.reduce_scatter_tensor(out, torch.cat(blocks[RANK]))
        check(f"reduce_scatter_tensor [{n}]", out, sum(blocks[r][RANK] for r in range(WORLD)))

        ins = [torch.full((n,), float(RANK * 10 + d)) for d in range(WORLD)]
        outs = [torch.zeros(n) for _ in range(WORLD)]
        dist.all_to_all(outs, ins)
        for s in range(WORLD):
            check(f"all_to_all [{n}] from {s}", outs[s], torch.full((n,), float(s * 10 + RANK)))
    # Tensors large enough that a rank lends its own memory over grpc+verbs (ring segments of
    # 512 KiB, a broadcast root's tensor): each rank overwrites its tensor the moment its
    # collective returns, so a lent part that a peer had not taken yet would reach it as NaN.
    lent_before = tvt.stats()["lent_sends"]
    in_place_before = tvt.stats()["in_place_recvs"]
    n = 1000003
    mine = [value(r, n, torch.float32, seed=5) for r in range(WORLD)]
    for op in [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG]:
        for rep in range(3):
            t = mine[RANK].clone()
            dist.all_reduce(t, op=op)
            got = t.clone()
            t.fill_(float("nan"))
            want = sum(mine) / WORLD if op == dist.ReduceOp.AVG else reduce_all(mine, op)
            if not torch.allclose(got, want):
                raise AssertionError(f"rank {RANK}: large all_reduce {op} #{rep}: {got[:8]}")
    for root in range(WORLD):
        t = mine[root].clone() if RANK == root else torch.zeros(n)
        dist.broadcast(t, root)
        check(f"large broadcast from {root}", t, mine[root])
        t.fill_(float("nan"))
    if tvt.stats()["protocol"] == "grpc+verbs" and tvt.stats()["lent_sends"] == lent_before:
        raise AssertionError(f"large collectives lent nothing: {tvt.stats()}")
    # Where the fabric writes the caller's memory (TV_TEST_IN_PLACE=1), the ring's allgather
    # and the broadcast land in the output tensors themselves; elsewhere nothing does.
    in_place = tvt.stats()["in_place_recvs"] > in_place_before
    if in_place != (os.environ.get("TV_TEST_IN_PLACE") == "1"):
        raise AssertionError(f"large collectives, in place: {in_place}: {tvt.stats()}")
    # all_to_all_single with uneven splits: rank r sends d+1 rows to rank d.
    inp = torch.cat([torch.full((d + 1, 2), float(RANK * 10 + d)) for d in range(WORLD)])
    out = torch.zeros((RANK + 1) * WORLD, 2)
    dist.all_to_all_single(out, inp, output_split_sizes=[RANK + 1] * WORLD,
                           input_split_sizes=[d + 1 for d in range(WORLD)])
    want = torch.cat([torch.full((RANK + 1, 2), float(s * 10 + RANK)) for s in range(WORLD)])
    check("all_to_all_single uneven", out, want)
    # Asynchronous collectives and their futures, as DDP's comm hooks use them.
    works = []
    for i in range(8):
        t = torch.full((3,), float(RANK + i))
        works.append((i, t, dist.all_reduce(t, async_op=True)))
    for i, t, w in works:
        got = w.get_future().wait()[0]
        check(f"async all_reduce {i}", got, torch.full((3,), float(sum(range(WORLD)) + WORLD * i)))
    dist.barrier()
    # A subgroup of the first and last rank: its own tasks, its own numbering.
    pair = dist.new_group([0, WORLD - 1], backend="tensorverbs")
    if RANK in (0, WORLD - 1):
        t = torch.full((5,), float(RANK + 1))
        dist.all_reduce(t, group=pair)
        check("all_reduce in a subgroup", t, torch.full((5,), float(WORLD + 1)))
        if RANK == 0:
            dist.send(torch.tensor([7]), WORLD - 1, group=pair)
        else:
            got = torch.zeros(1, dtype=torch.int64)
            dist.recv(got, 0, group=pair)
            check("recv in a subgroup", got, torch.tensor([7]))
        dist.destroy_process_group(pair)
    dist.barrier()
    # A synchronous collective's wait runs it on the waiting thread where the group's worker has
    # not started it: of the hundreds above, the caller ran some (which, depends on the race).
    counts = tvt.stats()
    if counts["collectives_on_caller"] == 0 or \
            counts["collectives_on_caller"] > counts["collectives"]:
        raise AssertionError(f"rank {RANK}: collectives on the caller: {counts}")
    # Ranks all on this host over grpc+verbs reduce through shared memory, unless told not to.
    shared = (counts["protocol"] == "grpc+verbs" and
              os.environ.get("TENSORVERBS_TORCH_SAME_HOST", "1") != "0" and
              os.environ.get("TENSORVERBS_FABRIC", "auto") in ("auto", "shmem"))
    if (counts["same_host_collectives"] > 0) != shared:
        raise AssertionError(f"rank {RANK}: shared memory expected {shared}: {counts}")
    print(f"rank {RANK}: collectives ok ({counts['collectives_on_caller']} of "
          f"{counts['collectives']} on the caller, {counts['same_host_collectives']} through "
          f"shared memory)", flush=True)


def point_to_point():
    nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    # Tags keep streams apart: sent tag 1 then tag 0, received tag 0 then tag 1.
    reqs = [dist.isend(torch.full((4,), 100.0 + RANK), nxt, tag=1),
            dist.isend(torch.full((4,), 200.0 + RANK), nxt, tag=0)]
    a, b = torch.zeros(4), torch.zeros(4)
    dist.recv(a, prv, tag=0)
    dist.recv(b, prv, tag=1)
    check("recv tag 0", a, torch.full((4,), 200.0 + prv))
    check("recv tag 1", b, torch.full((4,), 100.0 + prv))
    for r in reqs:
        r.wait()
    # Order within one (source, tag): 50 messages, received in the order sent.
    for i in range(50):
        dist.isend(torch.tensor([i, RANK]), nxt, tag=7)
    for i in range(50):
        t = torch.zeros(2, dtype=torch.int64)
        dist.irecv(t, prv, tag=7).wait()
        check(f"message {i} in order", t, torch.tensor([i, prv]))
    # batch_isend_irecv of a ring, both ways, of 1 MiB tensors.
    in_place_before = tvt.stats()["in_place_recvs"]
    big = torch.arange(262144, dtype=torch.float32) + RANK
    got_prev, got_next = torch.zeros_like(big), torch.zeros_like(big)
    ops = [dist.P2POp(dist.isend, big, nxt), dist.P2POp(dist.isend, big, prv),
           dist.P2POp(dist.irecv, got_prev, prv), dist.P2POp(dist.irecv, got_next, nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check("batch from prev", got_prev, torch.arange(262144, dtype=torch.float32) + prv)
    check("batch from next", got_next, torch.arange(262144, dtype=torch.float32) + nxt)
    # Over grpc+verbs a send from 64 KiB lends the tensor itself and completes once the peer
    # has it: not before the peer asks (here, after a barrier), and with the bytes sent then.
    lent_before = tvt.stats()["lent_sends"]
    held = torch.full((65536,), float(RANK))
    w = dist.isend(held, nxt, tag=9)
    if tvt.stats()["protocol"] == "grpc+verbs":
        if lent_before < 2 or tvt.stats()["lent_sends"] != lent_before + 1:
            raise AssertionError(f"lent sends: {lent_before} after the batch, then {tvt.stats()}")
        time.sleep(0.2)
        if w.is_completed():
            raise AssertionError("a lent isend completed before its peer asked for it")
    dist.barrier()
    t = torch.zeros(65536)
    dist.recv(t, prv, tag=9)
    w.wait()
    check("lent send", t, torch.full((65536,), float(prv)))
    # Those three recvs landed in their tensors themselves where the fabric writes the caller's
    # memory (TV_TEST_IN_PLACE=1: grpc+verbs over tcp), and were copied into them elsewhere.
    in_place = tvt.stats()["in_place_recvs"] - in_place_before
    if in_place != (3 if os.environ.get("TV_TEST_IN_PLACE") == "1" else 0):
        raise AssertionError(f"{in_place} recvs landed in place: {tvt.stats()}")
    # Any source: rank 0 hears from every other rank, twice each, and learns who sent what.
    if RANK == 0:
        seen = []
        for _ in range(2 * (WORLD - 1)):
            t = torch.zeros(1, dtype=torch.int64)
            src = dist.recv(t, tag=3)
            if t.item() // 10 != src:
                raise AssertionError(f"recv from any source: {t.item()} came from rank {src}")
            seen.append(t.item())
        want = sorted(r * 10 + k for r in range(1, WORLD) for k in range(2))
        if sorted(seen) != want:
            raise AssertionError(f"any source: saw {sorted(seen)}, want {want}")
        for r in range(1, WORLD):  # per source, in the order it sent
            mine = [s for s in seen if s // 10 == r]
            if mine != sorted(mine):
                raise AssertionError(f"any source: rank {r}'s messages out of order: {mine}")
    else:
        for k in range(2):
            dist.send(torch.tensor([RANK * 10 + k]), 0, tag=3)
    dist.barrier()
    print(f"rank {RANK}: point to point ok", flush=True)


def conformance():
    init()
    point_to_point()
    collectives()
    s = tvt.stats()
    print(f"rank {RANK}: stats {s}", flush=True)
    if s["failed"] != 0 or s["collectives"] == 0 or s["staged_copies"] == 0:
        raise AssertionError(f"stats {s}")
    dist.destroy_process_group()


def expect_error(what, call, *needles):
    try:
        call()
    except (RuntimeError, ValueError) as e:
        text = str(e)
        for n in needles:
            if n not in text:
                raise AssertionError(f"{what}: error '{text}' lacks '{n}'")
        print(f"rank {RANK}: {what} refused: {text.splitlines()[0]}", flush=True)
        return
    raise AssertionError(f"{what}: no error")


def bad_input():
    init()
    expect_error("non-contiguous", lambda: dist.all_reduce(torch.zeros(4, 4).t()), "contiguous")
    expect_error("sparse", lambda: dist.all_reduce(torch.zeros(4).to_sparse()), "sparse")
    expect_error("AVG of int64", lambda: dist.all_reduce(torch.ones(3, dtype=torch.long),
                                                         op=dist.ReduceOp.AVG), "AVG", "Long")
    expect_error("BAND of float", lambda: dist.all_reduce(torch.ones(3),
                                                          op=dist.ReduceOp.BAND), "BAND")
    expect_error("quantized dtype", lambda: dist.broadcast(
        torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), 0), "dtype")
    expect_error("root out of range", lambda: dist.broadcast(torch.ones(3), WORLD + 1),
                 "root rank")
    expect_error("send to self", lambda: dist.send(torch.ones(3), RANK), "rank")
    outs = [torch.zeros(3) for _ in range(WORLD)]
    expect_error("all_gather of mixed sizes", lambda: dist.all_gather(outs, torch.ones(4)),
                 "Float[4]")
    # Nothing was sent: the group still agrees and works.
    t = torch.ones(3)
    dist.all_reduce(t)
    check("all_reduce after refusals", t, torch.full((3,), float(WORLD)))
    # A shape that differs across ranks is named when the bytes arrive.
    t = torch.ones(1000 if RANK == 0 else 1001)
    expect_error("shapes differ across ranks", lambda: dist.all_reduce(t), "bytes")
    # wait(timeout) that expires fails the work, and nothing lands in its tensor afterwards.
    if RANK == 0:
        t = torch.zeros(5)
        w = dist.irecv(t, 1, tag=9)
        expect_error("wait with timeout", lambda: w.wait(datetime.timedelta(milliseconds=300)),
                     "wait() gave up")
        dist.send(torch.ones(1), 1, tag=10)  # now rank 1 sends the tensor
        time.sleep(1.0)
        check("no write after a failed wait", t, torch.zeros(5))
    elif RANK == 1:
        dist.recv(torch.zeros(1), 0, tag=10)
        dist.send(torch.ones(5), 0, tag=9)
    print(f"rank {RANK}: bad input ok", flush=True)
    dist.destroy_process_group()


def peer_dies():
    init()
    t = torch.ones(100000)
    dist.all_reduce(t)
    # The last rank dies only once every other rank has its first result: a rank's collective
    # ends when its own result is whole, while the others may still be pulling its parts, so a
    # rank killed at that moment can take a part of the first all_reduce with it.
    reduced = dist.FileStore(STORE + ".reduced", WORLD)
    if RANK == WORLD - 1:
        reduced.wait([f"rank {r}" for r in range(WORLD - 1)], datetime.timedelta(seconds=60))
        print(f"rank {RANK}: exiting without a word", flush=True)
        os._exit(0)
    reduced.set(f"rank {RANK}", "1")
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(100000))
    except RuntimeError as e:
        print(f"rank {RANK}: all_reduce failed after {time.monotonic() - started:.1f} s: {e}",
              flush=True)
        try:
            dist.all_reduce(torch.ones(3))
        except RuntimeError as later:
            print(f"rank {RANK}: the next one failed at once: {later}", flush=True)
            os._exit(0)
        raise AssertionError("the collective after a failure did not fail")
    raise AssertionError("all_reduce survived a dead peer")


def p2p_peer_dies():
    # A recv whose peer dies before sending fails within the peer timeout, naming the peer,
    # and leaves the tensor as it was: also one the fabric would have written in place.
    init()
    dist.barrier()
    # Rank 0 dies only once rank 1 is through the barrier, whose last message rank 0 sends.
    through = dist.FileStore(STORE + ".through", WORLD)
    if RANK == 0:
        through.wait(["rank 1"], datetime.timedelta(seconds=60))
        print(f"rank {RANK}: exiting without a word", flush=True)
        os._exit(0)
    through.set("rank 1", "1")
    t = torch.full((262144,), -1.0)
    started = time.monotonic()
    try:
        dist.recv(t, 0, tag=5)
    except RuntimeError as e:
        print(f"rank {RANK}: recv failed after {time.monotonic() - started:.1f} s: {e}",
              flush=True)
        if not bool((t == -1.0).all()):
            raise AssertionError("the failed recv wrote into its tensor")
        os._exit(0)
    raise AssertionError("recv survived a dead peer")


def recv_never_sent():
    # A recv whose live peer never sends fails at the group's timeout (plus, where it would
    # have landed in place, the bounded wait for the task to let go of the tensor), naming the
    # peer, and the group goes on.
    init()
    if RANK == 1:
        started = time.monotonic()
        try:
            dist.recv(torch.zeros(65536), 0, tag=6)
            raise AssertionError("a recv of a message never sent completed")
        except RuntimeError as e:
            print(f"rank 1: the recv failed after {time.monotonic() - started:.1f} s: {e}",
                  flush=True)
    goes_on_after(1, "failed")


def goes_on_after(rank, what):
    # The ranks meet outside the group once `rank` has seen its operation end (the group's
    # timeout would otherwise end the others' next collective), then run one together.
    met = dist.FileStore(f"{STORE}.{what}", WORLD)
    if RANK == rank:
        met.set(what, "1")
    else:
        met.wait([what], datetime.timedelta(seconds=60))
    t = torch.ones(3)
    dist.all_reduce(t)
    check(f"all_reduce after the {what} operation", t, torch.full((3,), float(WORLD)))
    print(f"rank {RANK}: the group goes on", flush=True)
    dist.destroy_process_group()


def send_never_taken():
    # A send that lends its tensor (grpc+verbs, from 64 KiB) completes when the peer takes it:
    # one the peer never asks for fails at the group's timeout, naming the peer, and the group
    # goes on. Staged sends complete at once.
    init()
    if RANK == 0:
        started = time.monotonic()
        w = dist.isend(torch.ones(65536), 1, tag=5)
        try:
            w.wait()
            print(f"rank 0: the send completed after {time.monotonic() - started:.1f} s",
                  flush=True)
        except RuntimeError as e:
            print(f"rank 0: the send failed after {time.monotonic() - started:.1f} s: {e}",
                  flush=True)
    goes_on_after(0, "sent")


def short_lived_groups():
    # Groups made, used once on a tensor only torch holds, and dropped at once: the group's
    # last reference goes on this thread (with the GIL) while its worker may still hold that
    # tensor, whose Python object died first and needs the GIL to go.
    init()
    for i in range(int(os.environ.get("TV_TEST_GROUPS", "40"))):
        g = dist.new_group(list(range(WORLD)), backend="tensorverbs")
        dist.all_reduce(torch.full((3,), float(RANK)), group=g)
        dist.destroy_process_group(g)
        del g
    print(f"rank {RANK}: short-lived groups ok", flush=True)
    dist.destroy_process_group()


def group_dropped_in_its_callback():
    # The last reference to a group goes inside its own work's future callback, which runs on
    # the group's worker thread: the destructor cannot wait for that thread, so it must neither
    # drain nor join it, and the rank goes on.
    init()
    for i in range(int(os.environ.get("TV_TEST_GROUPS", "5"))):
        g = dist.new_group(list(range(WORLD)), backend="tensorverbs")
        holder = [g]
        ran = threading.Event()

        def drop(fut, holder=holder, ran=ran):
            holder.clear()  # the last reference, on the worker
            ran.set()
            return fut.value()

        t = torch.full((3,), float(RANK))
        fut = dist.all_reduce(t, group=g, async_op=True).get_future().then(drop)
        dist.destroy_process_group(g)
        del g
        fut.wait()
        assert ran.wait(TIMEOUT.total_seconds()), "the callback never ran"
        check("all_reduce before the drop", t, torch.full((3,), float(sum(range(WORLD)))))
    dist.all_reduce(torch.ones(3))  # the default group still works
    print(f"rank {RANK}: groups dropped in their callbacks ok", flush=True)
    dist.destroy_process_group()


def mismatch():
    # Rank 0 thinks the world has two ranks; rank 1 thinks three.
    try:
        init(world=2 if RANK == 0 else 3)
    except RuntimeError as e:
        print(f"rank {RANK}: init refused: {e}", flush=True)
        return
    raise AssertionError("init accepted mismatched world sizes")


def stores():
    # torch's own stores carry the addresses: TV_TEST_INIT is "tcp://HOST:PORT" (rank 0 hosts
    # the TCPStore) or "env://" (MASTER_ADDR and MASTER_PORT in the environment).
    method = os.environ["TV_TEST_INIT"]
    init(init_method=method)
    t = torch.full((5,), float(RANK + 1))
    dist.all_reduce(t)
    check("all_reduce", t, torch.full((5,), float(sum(range(1, WORLD + 1)))))
    # A ring of sends: each rank's tensor reaches the next one intact.
    got = torch.zeros(7, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, torch.arange(7) + 100 * RANK, (RANK + 1) % WORLD),
           dist.P2POp(dist.irecv, got, (RANK - 1) % WORLD)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check("ring", got, torch.arange(7) + 100 * ((RANK - 1) % WORLD))
    print(f"rank {RANK}: {method.split(':')[0]} store ok", flush=True)
    dist.destroy_process_group()


def unsupported():
    init()
    expect_error("PREMUL_SUM", lambda: dist.all_reduce(
        torch.ones(3), op=dist._make_nccl_premul_sum(2.0)), "PREMUL_SUM")
    outs = [[torch.zeros(3)] for _ in range(WORLD)]
    expect_error("all_gather_coalesced", lambda: dist.all_gather_coalesced(
        outs, [torch.ones(4)]), "tensorverbs", "allgather_coalesced", "[4]")
    # Nothing was sent: the group still agrees and works.
    t = torch.ones(3)
    dist.all_reduce(t)
    check("all_reduce after refusals", t, torch.full((3,), float(WORLD)))
    print(f"rank {RANK}: unsupported ok", flush=True)
    dist.destroy_process_group()


def init_fails(what, **kwargs):
    """init must raise, not hang: prints the first line of its error."""
    try:
        init(**kwargs)
    except RuntimeError as e:
        print(f"rank {RANK}: {what}: init refused: {e}", flush=True)
        return
    raise AssertionError(f"{what}: init accepted")


def duplicate_rank():
    # Started with ranks 0, 1, 1 of a world of 3 (the harness's TV_TEST_RANKS): rank 2 never
    # joins, and the rank started twice is named.
    init_fails("duplicate rank")


def other_backend():
    # Rank 0 asks for tensorverbs, the others for gloo: each side waits for keys the other never
    # writes, and both fail at init within the timeout.
    init_fails("other backend", backend="tensorverbs" if RANK == 0 else "gloo")


SCENARIOS = {"conformance": conformance, "bad_input": bad_input, "peer_dies": peer_dies,
             "p2p_peer_dies": p2p_peer_dies, "recv_never_sent": recv_never_sent,
             "send_never_taken": send_never_taken,
             "mismatch": mismatch, "short_lived_groups": short_lived_groups,
             "group_dropped_in_its_callback": group_dropped_in_its_callback, "stores": stores,
             "unsupported": unsupported, "duplicate_rank": duplicate_rank,
             "other_backend": other_backend}

if __name__ == "__main__":
    SCENARIOS[SCENARIO]()
