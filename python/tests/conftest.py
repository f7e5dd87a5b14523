"""Fixtures of the tensorverbs Python tests: free ports, and two tasks in this process."""

import contextlib
import os

import pytest

# A task reads the TENSORVERBS_* variables once per process, at its first start: a peer that
# stops answering is declared dead after 2 s here (10 s by default), for every test and for the
# peer processes they start.
os.environ["TENSORVERBS_PEER_TIMEOUT_MS"] = "2000"

import tensorverbs as tv


def free_ports(n):
    """n ports of 127.0.0.1 for tasks of this test (reserved while the test process lives)."""
    return tv.free_ports(n)


def cluster_of(n):
    return {"worker": [f"127.0.0.1:{p}" for p in free_ports(n)]}


@contextlib.contextmanager
def two_tasks(protocol, recv_timeout=20):
    """Tasks worker:0 and worker:1 of one cluster, both in this process, peers found."""
    cluster = cluster_of(2)
    with tv.Server(cluster, "worker", 0, protocol, recv_timeout) as a, \
            tv.Server(cluster, "worker", 1, protocol, recv_timeout) as b:
        a.wait_for_peers(30)
        b.wait_for_peers(30)
        yield a, b


PROTOCOLS = ["grpc+verbs", "grpc", "grpc+gdr", "grpc+verbs-copy"]


@pytest.fixture(params=PROTOCOLS)
def pair(request):
    with two_tasks(request.param) as tasks:
        yield tasks


@pytest.fixture
def verbs_pair():
    with two_tasks("grpc+verbs") as tasks:
        yield tasks
