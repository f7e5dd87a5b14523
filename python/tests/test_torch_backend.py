"""The torch.distributed backend `tensorverbs` from real processes (torch_ranks.py): every
point-to-point and collective operation on every protocol, bad input, a peer that dies, and
ranks that disagree at init."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
try:
    import tensorverbs.torch  # noqa: F401
except ImportError as e:
    pytest.skip(f"the torch backend is not built: {e}", allow_module_level=True)

RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_ranks.py")


def run_ranks(tmp_path, scenario, world, protocol="grpc+verbs", timeout_s=60, env=None,
              ranks=None):
    """Runs `world` ranks of `scenario` (or the processes of `ranks`, which may repeat or leave
    out a rank); returns [(returncode, output)] by process."""
    run_env = dict(os.environ, TENSORVERBS_PROTOCOL=protocol, TV_TEST_TIMEOUT_S=str(timeout_s),
                   PYTHONDONTWRITEBYTECODE="1")
    run_env.update(env or {})
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, RANKS, scenario, str(r), str(world), store],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=run_env)
             for r in (range(world) if ranks is None else ranks)]
    results = []
    deadline = time.monotonic() + timeout_s + 60
    stacks = {}
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stacks = {q.pid: dump_stacks(q) for q in procs if q.poll() is None}
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        if p.pid in stacks:
            out += "\n(killed: the rank hung)\n" + stacks[p.pid]
        results.append((p.returncode, out))
    return results


def dump_stacks(proc):
    """What a hung rank was doing: its Python stacks (faulthandler, into its own output) and,
    where gdb is installed, every thread's native stack."""
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb: native stacks not taken)"
    try:
        r = subprocess.run([gdb, "-p", str(proc.pid), "-batch", "-nx", "-ex",
                            "thread apply all bt 30"], capture_output=True, text=True, timeout=60)
        return "native stacks:\n" + r.stdout[-20000:]
    except subprocess.TimeoutExpired:
        return "(gdb took over 60 s)"


def assert_all_ok(results):
    # Every rank's output on a failure: the cause often shows in another rank's (a stall report,
    # a slow start) than the one that failed.
    everything = "\n".join(f"--- rank {r} (exit {c}):\n{o}" for r, (c, o) in enumerate(results))
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}\n{everything}"


@pytest.mark.parametrize("protocol", ["grpc+verbs", "grpc", "grpc+verbs-copy", "grpc+gdr"])
def test_every_operation_on_three_ranks(tmp_path, protocol):
    results = run_ranks(tmp_path, "conformance", 3, protocol)
    assert_all_ok(results)
    for rank, (_, out) in enumerate(results):
        assert f"rank {rank}: point to point ok" in out
        assert f"rank {rank}: collectives ok" in out


def test_every_operation_on_three_ranks_over_messages_alone(tmp_path):
    # Every rank is on this host, so grpc+verbs reduces through the ranks' shared memory; told
    # not to, it takes the trees and rings of messages, which ranks on several hosts take.
    results = run_ranks(tmp_path, "conformance", 3, "grpc+verbs",
                        env={"TENSORVERBS_TORCH_SAME_HOST": "0"})
    assert_all_ok(results)
    for rank, (_, out) in enumerate(results):
        assert f"rank {rank}: collectives ok" in out
        assert "0 through shared memory" in out, out


# Over libfabric tcp the fabric writes a recv's message into the caller's tensor itself.
OVER_TCP = {"TENSORVERBS_FABRIC": "ofi", "TENSORVERBS_OFI_PROVIDER": "tcp", "TV_TEST_IN_PLACE": "1"}


def test_every_operation_over_tcp_landing_large_recvs_in_place(tmp_path):
    results = run_ranks(tmp_path, "conformance", 3, "grpc+verbs", env=OVER_TCP)
    assert_all_ok(results)
    for rank, (_, out) in enumerate(results):
        assert f"rank {rank}: point to point ok" in out


@pytest.mark.parametrize("fabric", ["default", "tcp"])
def test_a_recv_whose_peer_dies_fails_within_the_peer_timeout_and_writes_nothing(tmp_path,
                                                                                 fabric):
    env = {"TENSORVERBS_PEER_TIMEOUT_MS": "2000"}
    if fabric == "tcp":
        env.update(OVER_TCP)
    results = run_ranks(tmp_path, "p2p_peer_dies", 2, timeout_s=120, env=env)
    assert_all_ok(results)
    out = results[1][1]
    assert "recv failed after" in out, out
    seconds = float(out.split("recv failed after ")[1].split(" s")[0])
    assert seconds < 60, out  # far below the group's 120 s timeout
    assert "rank 0" in out.split("recv failed after")[1], out
    # The channel's close gives the tensor back at once, so the recv fails with the peer's
    # error, not at the end of the wait for the task to let go of it.
    assert "did not let go" not in out, out


@pytest.mark.parametrize("fabric", ["default", "tcp"])
def test_a_recv_never_sent_fails_soon_after_the_groups_timeout_naming_the_peer(tmp_path, fabric):
    results = run_ranks(tmp_path, "recv_never_sent", 2, timeout_s=3,
                        env=OVER_TCP if fabric == "tcp" else None)
    assert_all_ok(results)
    for rank in range(2):
        assert f"rank {rank}: the group goes on" in results[rank][1], results
    out = results[1][1]
    assert "the recv failed after" in out, out
    seconds = float(out.split("the recv failed after ")[1].split(" s")[0])
    assert 2.5 < seconds < 30, out
    assert "rank:0" in out, out


def test_every_operation_on_four_ranks(tmp_path):
    assert_all_ok(run_ranks(tmp_path, "conformance", 4))


@pytest.mark.parametrize("protocol", ["grpc+verbs", "grpc", "grpc+verbs-copy", "grpc+gdr"])
def test_bad_input_raises_naming_the_problem_and_sends_nothing(tmp_path, protocol):
    results = run_ranks(tmp_path, "bad_input", 2, protocol=protocol)
    assert_all_ok(results)
    assert "rank 0: wait with timeout refused" in results[0][1]


# "grpc+verbs/tcp": over libfabric tcp, where large collectives land in the output tensors.
@pytest.mark.parametrize("protocol",
                         ["grpc+verbs", "grpc", "grpc+verbs-copy", "grpc+gdr", "grpc+verbs/tcp"])
def test_a_peer_that_dies_fails_every_rank_within_the_peer_timeout(tmp_path, protocol):
    env = {"TENSORVERBS_PEER_TIMEOUT_MS": "2000"}
    if protocol.endswith("/tcp"):
        protocol = protocol[:-len("/tcp")]
        env.update(OVER_TCP)
    results = run_ranks(tmp_path, "peer_dies", 3, protocol=protocol, timeout_s=120, env=env)
    assert_all_ok(results)
    for rank in range(2):
        out = results[rank][1]
        assert "all_reduce failed after" in out, out
        assert "the next one failed at once" in out, out
        seconds = float(out.split("all_reduce failed after ")[1].split(" s")[0])
        assert seconds < 60, out  # far below the group's 120 s timeout
    # Every rank's error names the dead one: a rank that found it itself, and a rank that
    # learned of it through the store, whose error carries the first rank's.
    for rank in range(2):
        assert "from rank 2 (task rank:2" in results[rank][1].split("failed after")[1], results


@pytest.mark.parametrize("protocol", ["grpc+verbs", "grpc"])
def test_a_send_no_peer_takes_fails_at_the_groups_timeout_naming_the_peer(tmp_path, protocol):
    results = run_ranks(tmp_path, "send_never_taken", 2, protocol=protocol, timeout_s=3)
    assert_all_ok(results)
    out = results[0][1]
    for rank in range(2):
        assert f"rank {rank}: the group goes on" in results[rank][1], results
    if protocol == "grpc+verbs":  # the send lent its tensor: it waits for the peer
        assert "the send failed after" in out, out
        seconds = float(out.split("the send failed after ")[1].split(" s")[0])
        assert 2.5 < seconds < 30, out
        assert "rank:1" in out and "did not take the message" in out, out
    else:  # staged: complete at once
        assert "the send completed after" in out, out


@pytest.mark.parametrize("protocol", ["grpc+verbs", "grpc"])
def test_groups_dropped_from_python_right_after_use_go_without_a_deadlock(tmp_path, protocol):
    # Before the destructor let go of the GIL, this hung within the first few groups.
    results = run_ranks(tmp_path, "short_lived_groups", 3, protocol, timeout_s=30,
                        env={"TV_TEST_GROUPS": "20"})
    assert_all_ok(results)
    for rank, (_, out) in enumerate(results):
        assert f"rank {rank}: short-lived groups ok" in out


def test_a_group_whose_last_reference_goes_in_its_own_callback_goes_and_the_rank_goes_on(
        tmp_path):
    # Before, the destructor on the group's worker waited for that worker to drain and join.
    results = run_ranks(tmp_path, "group_dropped_in_its_callback", 2, timeout_s=30)
    assert_all_ok(results)
    for rank, (_, out) in enumerate(results):
        assert f"rank {rank}: groups dropped in their callbacks ok" in out, out


def test_ranks_that_disagree_on_the_world_size_fail_at_init(tmp_path):
    results = run_ranks(tmp_path, "mismatch", 2, timeout_s=5)
    assert_all_ok(results)
    assert "world_size 3" in results[0][1], results[0][1]
    assert "init refused" in results[1][1], results[1][1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("method", ["tcp", "env"])
def test_torchs_own_stores_carry_the_addresses(tmp_path, method):
    port = free_port()
    env = {"TV_TEST_INIT": f"tcp://127.0.0.1:{port}" if method == "tcp" else "env://",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    results = run_ranks(tmp_path, "stores", 3, env=env, timeout_s=30)
    assert_all_ok(results)
    for rank, (_, out) in enumerate(results):
        assert f"rank {rank}: {method} store ok" in out, out


def test_an_unsupported_operation_raises_naming_it_and_the_group_goes_on(tmp_path):
    results = run_ranks(tmp_path, "unsupported", 2)
    assert_all_ok(results)
    for rank, (_, out) in enumerate(results):
        assert f"rank {rank}: PREMUL_SUM refused" in out, out
        assert f"rank {rank}: all_gather_coalesced refused" in out, out
        assert f"rank {rank}: unsupported ok" in out, out


def test_a_rank_started_twice_fails_init_naming_the_rank_that_never_joined(tmp_path):
    started = time.monotonic()
    results = run_ranks(tmp_path, "duplicate_rank", 3, timeout_s=5, ranks=[0, 1, 1])
    assert_all_ok(results)
    assert time.monotonic() - started < 60
    for _, out in results:
        assert "duplicate rank: init refused" in out, out
    # The ranks that met name the missing one; the second process of rank 1 names itself.
    assert "rank(s) 2 did not join" in results[0][1], results[0][1]
    assert any("more than one process" in out and "rank 1" in out for _, out in results[1:]), \
        results


def test_ranks_on_different_backends_fail_at_init_naming_the_backend(tmp_path):
    results = run_ranks(tmp_path, "other_backend", 2, timeout_s=5)
    assert_all_ok(results)
    assert "rank(s) 1 did not join" in results[0][1], results[0][1]
    assert "backend='tensorverbs'" in results[0][1], results[0][1]
    assert "other backend: init refused" in results[1][1], results[1][1]
