"""GPU tensors from Python: sends of CUDA DLPack tensors and recvs into a GPU, against the
CUDA runtime stand-in (tests/support/fake_cudart.cc), whose "device memory" the host can read,
so every byte is checked here. CTest runs this file on its own with TENSORVERBS_CUDA_RUNTIME
naming the stand-in (PythonTest.DeviceTensors); a GPU machine runs the same paths through the
C++ suites of the GPU bundle."""

import ctypes
import os
import time

import numpy as np
import pytest

from conftest import two_tasks
from dlpack_producer import Producer, StreamlessProducer
import tensorverbs as tv

RUNTIME = os.environ.get("TENSORVERBS_CUDA_RUNTIME", "")
pytestmark = pytest.mark.skipif(
    "fake_cudart" not in RUNTIME,
    reason="needs TENSORVERBS_CUDA_RUNTIME naming the stand-in runtime (CTest sets it)")


@pytest.fixture(scope="module")
def cudart():
    lib = ctypes.CDLL(RUNTIME)  # the very library the tasks loaded
    lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.cudaFree.argtypes = [ctypes.c_void_p]
    lib.tv_fake_cudart_default_stream_syncs.restype = ctypes.c_long
    return lib


def device_bytes(t):
    """The bytes of a DeviceTensor, read through its CUDA array interface (host-readable here)."""
    address, read_only = t.__cuda_array_interface__["data"]
    assert not read_only
    return ctypes.string_at(address, t.nbytes)


def counter(server, name):
    return server.stats().get(name, 0)


@pytest.mark.parametrize("protocol", ["grpc+verbs", "grpc"])
def test_a_recv_into_the_gpu_is_a_device_tensor_that_goes_back_out(protocol):
    with two_tasks(protocol) as (a, b):
        sent = np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000)
        with a.step(1) as sa, b.step(1) as sb:
            sa.send("worker:1", "w", sent)
            got = sb.recv("worker:0", "w", timeout=20, device="cuda:0")
            assert isinstance(got, tv.DeviceTensor)
            assert got.shape == (3, 1000) and got.dtype == np.float32
            assert got.device == "cuda:0" and got.nbytes == sent.nbytes
            assert got.__dlpack_device__() == (2, 0)
            cai = got.__cuda_array_interface__
            assert cai["typestr"] == "<f4" and cai["shape"] == (3, 1000) and cai["version"] == 3
            assert device_bytes(got) == sent.tobytes()
            assert "cuda:0" in repr(got)
            # Back from the GPU to the other task's host memory.
            sb.send("worker:0", "w2", got)
            back = sa.recv("worker:1", "w2", timeout=20)
            np.testing.assert_array_equal(back, sent)
        landed = counter(b, "host_to_device_copies") + counter(b, "device_direct_recvs")
        assert landed >= 1
        left = counter(b, "device_to_host_copies") + counter(b, "device_direct_sends")
        assert left >= 1


def test_a_gpu_pool_tensor_goes_from_gpu_to_gpu_directly():
    with two_tasks("grpc+verbs") as (a, b):
        t = a.empty((64, 64), np.int32, device="cuda:0")
        assert isinstance(t, tv.DeviceTensor)
        values = np.arange(64 * 64, dtype=np.int32)
        ctypes.memmove(t.data_ptr, values.ctypes.data, values.nbytes)
        for step in (1, 2, 3):  # the direct path is known from the channel's second use on
            with a.step(step) as sa, b.step(step) as sb:
                sa.send("worker:1", "x", t)
                got = sb.recv("worker:0", "x", timeout=20, device=0)
                assert device_bytes(got) == values.tobytes()
        assert counter(a, "device_direct_sends") >= 1
        assert counter(b, "device_direct_recvs") >= 1


def test_recv_async_recv_many_and_arecv_land_in_the_gpu_too():
    import asyncio
    with two_tasks("grpc+verbs") as (a, b):
        with a.step(1) as sa, b.step(1) as sb:
            for i in range(4):
                sa.send("worker:1", f"t{i}", np.full(100, i, np.int64))
            future = sb.recv_async("worker:0", "t0", device="cuda")
            many = sb.recv_many([("worker:0", "t1"), ("worker:0", "t2")], timeout=20,
                                device="cuda:0")
            last = asyncio.run(sb.arecv("worker:0", "t3", timeout=20, device="cuda:0"))
            for i, got in enumerate([future.result(20)] + many + [last]):
                assert isinstance(got, tv.DeviceTensor)
                assert device_bytes(got) == np.full(100, i, np.int64).tobytes()


def test_a_cuda_dlpack_tensor_is_sent_without_a_copy_and_released_once(cudart):
    with two_tasks("grpc+verbs") as (a, b):
        values = np.linspace(0, 1, 5000, dtype=np.float64)
        memory = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(memory), values.nbytes + 64) == 0
        # 8 bytes in, as a view at an offset into a larger allocation would be.
        ctypes.memmove(memory.value + 8, values.ctypes.data, values.nbytes)
        tensor = Producer(memory.value, (50, 100), kind="f", bits=64, byte_offset=8)
        syncs = cudart.tv_fake_cudart_default_stream_syncs()
        staged = counter(a, "staged")
        with a.step(1) as sa, b.step(1) as sb:
            sa.send("worker:1", "x", tensor)
            assert cudart.tv_fake_cudart_default_stream_syncs() > syncs  # the producer's work
            np.testing.assert_array_equal(sb.recv("worker:0", "x", timeout=20),
                                          values.reshape(50, 100))
        deadline = time.monotonic() + 10
        while tensor.deleted == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # released once the device-to-host copy is done
        assert (tensor.capsules, tensor.deleted) == (1, 1)
        assert tensor.streams == [1]  # the legacy default stream, which the sender waits for
        assert counter(a, "staged") == staged  # no host staging in Python
        assert counter(a, "device_to_host_copies") >= 1
        cudart.cudaFree(memory)


def test_a_view_of_a_received_gpu_tensor_is_sent_as_that_tensor():
    # What torch.from_dlpack(received) is: another object over the same GPU memory.
    class View:
        def __init__(self, t):
            self._t = t

        def __dlpack_device__(self):
            return self._t.__dlpack_device__()

        def __dlpack__(self, stream=None):
            return self._t.__dlpack__(stream=stream)

    with two_tasks("grpc+verbs") as (a, b):
        t = a.empty((1000,), np.float32, device="cuda:0")
        ctypes.memset(t.data_ptr, 7, t.nbytes)
        for step in (1, 2, 3):
            with a.step(step) as sa, b.step(step) as sb:
                sa.send("worker:1", "v", View(t))
                assert device_bytes(sb.recv("worker:0", "v", timeout=20, device=0)) == \
                    b"\x07" * 4000
        # The pool tensor itself went: GPU to GPU, never through host memory on the sender.
        assert counter(a, "device_direct_sends") >= 1
        assert counter(a, "device_to_host_copies") == 0


def test_a_producer_that_takes_no_stream_is_asked_without_one(cudart):
    with two_tasks("grpc+verbs") as (a, b):
        memory = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(memory), 32) == 0
        ctypes.memmove(memory.value, np.arange(8, dtype=np.int32).ctypes.data, 32)
        tensor = StreamlessProducer(memory.value, (8,), kind="i", bits=32)
        with a.step(1) as sa, b.step(1) as sb:
            sa.send("worker:1", "old", tensor)
            np.testing.assert_array_equal(sb.recv("worker:0", "old", timeout=20),
                                          np.arange(8, dtype=np.int32))
        assert tensor.streams == [None]
        cudart.cudaFree(memory)


def test_bfloat16_travels_by_dlpack_but_has_no_array_interface(cudart):
    with two_tasks("grpc+verbs") as (a, b):
        memory = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(memory), 64) == 0
        ctypes.memmove(memory.value, bytes(range(64)), 64)
        tensor = Producer(memory.value, (32,), kind="bf", bits=16)
        with a.step(1) as sa, b.step(1) as sb:
            sa.send("worker:1", "bf", tensor)
            got = sb.recv("worker:0", "bf", timeout=20, device="cuda:0")
            assert got.dtype == "bfloat16" and got.shape == (32,)
            assert not hasattr(got, "__cuda_array_interface__")
            capsule = got.__dlpack__()
            assert type(capsule).__name__ == "PyCapsule"
            del capsule  # not consumed: the capsule lets its tensor go itself
            sb.send("worker:0", "back", got)
            assert sa.recv("worker:1", "back", timeout=20).tobytes() == bytes(range(64))
        cudart.cudaFree(memory)


def test_host_readable_cuda_memory_goes_as_host_memory(cudart):
    # CUDA managed memory (DLPack device type 13) is readable by the host: NumPy takes it.
    with two_tasks("grpc+verbs") as (a, b):
        memory = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(memory), 16) == 0
        ctypes.memmove(memory.value, np.arange(4, dtype=np.float32).ctypes.data, 16)
        with a.step(1) as sa, b.step(1) as sb:
            sa.send("worker:1", "m", Producer(memory.value, (4,), device_type=13))
            np.testing.assert_array_equal(sb.recv("worker:0", "m", timeout=20),
                                          np.arange(4, dtype=np.float32))
        cudart.cudaFree(memory)


def test_bad_devices_and_layouts_raise_clear_errors(cudart):
    with two_tasks("grpc+verbs") as (a, b):
        with b.step(1) as sb:
            for bad in ("tpu", "cuda:x", -1, "cuda:-2"):
                with pytest.raises(ValueError, match="GPU"):
                    sb.recv("worker:0", "x", timeout=1, device=bad)
            with pytest.raises(tv.InvalidArgumentError, match="cuda:3|ordinal|device"):
                sb.recv("worker:0", "x", timeout=1, device="cuda:3")
        memory = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(memory), 4096) == 0
        with a.step(2) as sa:
            strided = Producer(memory.value, (8, 8), strides=(16, 1))
            with pytest.raises(ValueError, match="contiguous"):
                sa.send("worker:1", "s", strided)
            assert strided.deleted == 0  # refused before it was taken: the producer keeps it
            rocm = Producer(memory.value, (4,), device_type=10)  # another vendor's GPU
            with pytest.raises(TypeError, match="cannot send"):
                sa.send("worker:1", "r", rocm)
            with pytest.raises(tv.InvalidArgumentError):
                a.empty((4,), np.float32, device="cuda:5")
        cudart.cudaFree(memory)
