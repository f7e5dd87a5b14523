"""tensorverbs: send and receive tensors between the tasks of a training cluster over gRPC and
RDMA (TensorFlow's grpc+verbs design), from Python.

    import numpy as np
    import tensorverbs as tv

    cluster = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}
    with tv.Server(cluster, job="worker", task=0) as server:
        server.wait_for_peers(timeout=30)
        with server.step(1) as step:
            step.send("worker:1", "weights", np.ones((4, 4), np.float32))
            grad = step.recv("worker:1", "grad", timeout=10)

A Server is one task of the cluster; every task runs one (in its own process, as a rule). A
Step is one training step's sends and recvs: leaving its `with` block cancels its pending
recvs and drops what no peer took. Tasks are named "job:index" or "/job:J/replica:0/task:T".

What can be sent: NumPy arrays of every numeric dtype (bool, int8-64, uint8-64, float16-64,
complex64/128), C-contiguous, and scalars (rank 0); objects with __dlpack__ on the CPU (PyTorch tensors); lists of
bytes or str (string tensors). An array from `server.empty(shape, dtype)` lives in the task's
registered pool and is sent without a copy (do not change it until its step's sends are
taken); any other value is copied once into the pool.

What a recv returns: a NumPy array viewing the received buffer itself (no copy; the buffer
lives as long as the array, also after the step and the server are gone), a list of bytes for a string tensor, or None for a dead tensor.

GPU tensors: `send` takes CUDA tensors by DLPack (PyTorch CUDA tensors, CuPy arrays), waiting
for the work queued before it on the device's default stream, and holds them until their
device-to-host copy is done; `recv(..., device="cuda:0")` lands the tensor in that GPU's memory
and returns a DeviceTensor (`torch.from_dlpack(t)` or `cupy.from_dlpack(t)` view it without a
copy; `__cuda_array_interface__` too). Between two tasks of one host over grpc+verbs, a tensor
received into the GPU or made by `server.empty(shape, dtype, device="cuda:0")` is written from
GPU to GPU directly; other GPU tensors cross in host memory, one copy each way.

PyTorch: `torch.from_numpy(step.recv(...))` (or `torch.from_dlpack`, for dtypes but bool) is the
received buffer as a tensor, and `torch.from_numpy(server.empty(...))` a tensor in the pool; sending either (or any tensor viewing
all of a pool array) sends the pool memory without a copy. Other CPU tensors are staged once.

Waiting releases the GIL, and Ctrl-C interrupts a blocking recv. Failures raise a subclass of
tensorverbs.Error whose message names the key, the peer and any setting involved.
"""

import asyncio
import atexit
import signal
import threading
import weakref

import numpy as _np

from . import _tensorverbs
from ._errors import (  # noqa: F401 (the package's exceptions)
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StatusCode,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    UnknownError,
    error_from_status,
)

__version__ = _tensorverbs.__version__
RecvFuture = _tensorverbs.RecvFuture


def _restore_signal_handlers():
    # Debian's libfabric links libinfinipath (its psm provider), whose constructor, run when the
    # core above was loaded, installs SIGINT and SIGTERM handlers that exit(1) at once: Ctrl-C
    # would end the program with no KeyboardInterrupt and no clean-up. Python's own go back.
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)


_restore_signal_handlers()

__all__ = [
    "ClusterSpec",
    "Server",
    "Step",
    "RecvFuture",
    "DeviceTensor",
    "available_protocols",
    "free_ports",
    "Error",
    "StatusCode",
]


def available_protocols():
    """The protocols this build provides, best first."""
    return list(_tensorverbs.available_protocols())


def free_ports(count, host="127.0.0.1"):
    """`count` distinct TCP ports of `host` for tasks about to start on it: free now, and kept
    from other pickers on this host (tensorverbs' own, in any process) while this process lives.
    They come from outside the kernel's ephemeral range, so no outgoing connection takes one
    before its task listens."""
    return list(_tensorverbs.pick_free_ports(int(count), str(host)))


class ClusterSpec:
    """The jobs of a cluster and each task's host:port.

    From TensorFlow's text form ("ps=h0:2222;worker=h1:2222,h2:2222"), a dict of job name to a
    list of addresses, or JSON text.
    """

    def __init__(self, spec):
        if isinstance(spec, ClusterSpec):
            text = spec.text
        elif isinstance(spec, dict):
            parts = []
            for job, addresses in spec.items():
                if isinstance(addresses, str) or not all(isinstance(a, str) for a in addresses):
                    raise TypeError(f"job {job!r}: give a list of 'host:port' strings")
                parts.append(f"{job}={','.join(addresses)}")
            text = ";".join(parts)
        elif isinstance(spec, str):
            text = spec
        else:
            raise TypeError(f"a cluster spec is a str or a dict, not a {type(spec).__name__}")
        self.text = _tensorverbs.parse_cluster(text)

    def __str__(self):
        return self.text

    def __repr__(self):
        return f"ClusterSpec({self.text!r})"


# Servers still running, stopped before the interpreter goes so that no callback thread needs
# the interpreter while it is being torn down.
_live_servers = weakref.WeakSet()


@atexit.register
def _stop_live_servers():
    for server in list(_live_servers):
        server.stop()


DeviceTensor = _tensorverbs.DeviceTensor

_DLPACK_CUDA = 2


def _device_ordinal(device):
    """The GPU ordinal `device` names ("cuda", "cuda:1", 1, torch.device("cuda:1")), or None
    for host memory (None, "cpu")."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"device {device}: a GPU ordinal is 0 or more")
        return device
    kind, index = getattr(device, "type", None), getattr(device, "index", None)
    if kind is None:  # text, not a torch.device
        kind, _, number = str(device).partition(":")
        try:
            index = int(number) if number else None
        except ValueError:
            index = -1
    if kind == "cpu" and index is None:
        return None
    if kind == "cuda" and (index is None or index >= 0):
        return index or 0
    raise ValueError(f"device {device!r}: name a GPU as 'cuda' or 'cuda:N' (or 'cpu', or None)")


def _is_gpu_tensor(value):
    try:
        return value.__dlpack_device__()[0] == _DLPACK_CUDA
    except (AttributeError, TypeError, IndexError):
        return False


def _to_sendable(value):
    if isinstance(value, (_np.ndarray, list, tuple, DeviceTensor)):
        return value
    if isinstance(value, (_np.generic, bool, int, float, complex)):
        return _np.asarray(value)  # a scalar: a rank-0 tensor
    if _is_gpu_tensor(value):
        # The core takes it by DLPack, without a copy (a PyTorch CUDA tensor, a CuPy array).
        return value
    if hasattr(value, "__dlpack__"):
        try:
            # A PyTorch tensor's numpy() shares its memory as DLPack does and also takes bool,
            # which DLPack (as PyTorch 1.13 and NumPy 1.24 speak it) cannot carry.
            array = value.numpy() if hasattr(value, "numpy") else _np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError) as e:
            raise TypeError(
                f"cannot send this {type(value).__name__} ({e}): send a CPU tensor of a dtype "
                "NumPy has (not bfloat16), detached from autograd, e.g. "
                "tensor.detach().cpu().float()") from e
        # A tensor viewing a pool array (torch.from_numpy of a received or Server.empty array)
        # is found by the core, which sends the pool memory itself.
        return array
    return value  # the core says what it takes


class Server:
    """One task of a cluster, serving its peers until stop() or the end of its `with` block.

    protocol: "grpc+verbs" (RDMA writes into the receiver's memory; the default), "grpc",
    "grpc+gdr" or "grpc+verbs-copy". recv_timeout: seconds a recv may wait at most (default
    TENSORVERBS_RECV_TIMEOUT_MS). Other settings come from the TENSORVERBS_* variables.
    """

    def __init__(self, cluster, job, task, protocol="grpc+verbs", recv_timeout=None):
        self._task = _tensorverbs.Task(
            str(ClusterSpec(cluster)), job, int(task), protocol,
            None if recv_timeout is None else float(recv_timeout))
        self._stopped = False
        _live_servers.add(self)

    @classmethod
    def from_environment(cls, source="slurm", protocol="grpc+verbs", recv_timeout=None):
        """The task the launcher started this process as: source "slurm" (SLURM_* variables,
        with TENSORVERBS_SLURM_JOBS and TENSORVERBS_SLURM_PORT) or "tf_config" (TF_CONFIG).
        Raises InvalidArgumentError naming the variable that is missing or wrong."""
        cluster, job, task = _tensorverbs.placement_from_environment(source)
        return cls(cluster, job, task, protocol, recv_timeout)

    @property
    def name(self):
        """This task's name, /job:J/replica:0/task:T."""
        return self._task.name

    @property
    def protocol(self):
        return self._task.protocol

    @property
    def incarnation(self):
        return self._task.incarnation

    def wait_for_peers(self, timeout=30.0, tasks=None):
        """Waits until every other task answers, or only `tasks` (names such as
        "/job:ps/replica:0/task:0") where given. Channels are set up on a pair's first tensor."""
        self._task.wait_for_peers(float(timeout), None if tasks is None else [str(t) for t in tasks])

    def step(self, step_id):
        """The sends and recvs of step `step_id`, a context manager that ends the step."""
        return Step(self, _tensorverbs.Step(self._task, int(step_id)))

    def empty(self, shape, dtype=_np.float32, device=None):
        """An uninitialized array in the task's registered pool: sent without a copy. With
        `device` ("cuda:N"), a DeviceTensor in that GPU's pool of this task instead: sent to a
        task on this host straight from GPU to GPU over grpc+verbs."""
        if isinstance(shape, int):
            shape = (shape,)
        return self._task.empty([int(d) for d in shape], _np.dtype(dtype),
                                _device_ordinal(device))

    def stats(self):
        """Counters since the start: tensors and bytes received, errors, copies the transport
        made, and arrays staged into the pool on send (`staged`, `staged_bytes`); then every
        counter `tensorverbs stats` shows for the task, under the same names
        (`tensors_received`, `tensors_sent`, `pushed_requests`, `pool_bytes_in_use`, ...)."""
        return self._task.stats()

    def stop(self):
        """Fails pending recvs with CancelledError and shuts the task down. Idempotent."""
        if not self._stopped:
            self._stopped = True
            self._task.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def __repr__(self):
        return f"<tensorverbs.Server {self.name} {self.protocol}>"


class Step:
    """One step's sends and recvs (made by Server.step). Ending it (end(), or leaving its
    `with` block) cancels its pending recvs and drops the tensors no peer took."""

    def __init__(self, server, core):
        self._server = server
        self._core = core

    @property
    def id(self):
        return self._core.id

    def send(self, task, name, value):
        """Makes `value` available to `task` under `name` in this step; returns at once."""
        self._core.send(task, name, _to_sendable(value))

    def send_many(self, items):
        """send for each (task, name, value) of `items`, in one call: every value is checked
        before any is sent."""
        self._core.send_many([(t, n, _to_sendable(v)) for t, n, v in items])

    def recv_async(self, task, name, device=None):
        """A future of the tensor `task` sends under `name`: a tensorverbs.RecvFuture, with
        concurrent.futures.Future's methods (result(timeout), exception(), done(),
        add_done_callback(fn), ...). result() after `timeout` raises DeadlineExceededError (a
        TimeoutError) and the recv stays asked for. `device` as for recv."""
        return self._core.recv_async(task, name, _device_ordinal(device))

    def recv(self, task, name, timeout=None, device=None, out=None):
        """The tensor `task` sends under `name`: waits at most `timeout` seconds (None: the
        server's recv timeout). DeadlineExceededError after `timeout`; the recv stays asked
        for in this step, so receiving the same name again in this step fails. With `device`
        ("cuda", "cuda:N", an ordinal or a torch.device) the tensor lands in that GPU's memory
        and comes as a DeviceTensor (torch.from_dlpack takes it without a copy).

        With `out` (a writable, C-contiguous NumPy array or CPU torch tensor of the tensor's
        dtype and shape) the tensor is received into `out`, which is returned. Over grpc+verbs
        on a fabric that can write any memory (libfabric tcp, ibverbs) the bytes land in `out`
        itself, with no copy (`stats()["in_place_recvs"]` counts them); elsewhere they are
        copied in once (`out_copies`). Here `timeout` ends the recv itself; a recv that fails
        may hold `out` until its sender answers: it raises once the task let go of `out`, or
        after 10 s more, saying so, with `out` kept alive for the sender."""
        timeout = None if timeout is None else float(timeout)
        if out is None:
            return self._core.recv(task, name, timeout, _device_ordinal(device))
        if device is not None:
            raise ValueError("recv: give `out` or `device`, not both (`out` is host memory)")
        array = out
        if not isinstance(out, _np.ndarray) and hasattr(out, "numpy"):
            array = out.numpy()  # a CPU torch tensor: the same memory
        if not isinstance(array, _np.ndarray):
            raise TypeError(f"recv: `out` must be a NumPy array or a CPU torch tensor, not "
                            f"{type(out).__name__}")
        self._core.recv_into(task, name, timeout, array)
        return out

    def recv_many(self, keys, timeout=None, device=None):
        """The tensors of `keys`, a list of (task, name) pairs, in order: all asked for at once
        and waited for together (the fast way to receive many small tensors). Raises the first
        failed recv's error once all ended, or DeadlineExceededError naming the first still
        waiting after `timeout` seconds. `device` as for recv, for every key."""
        return self._core.recv_many(list(keys), None if timeout is None else float(timeout),
                                    _device_ordinal(device))

    async def arecv(self, task, name, timeout=None, device=None):
        """recv for asyncio: `await step.arecv(task, name)`."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def ended(future):
            try:
                loop.call_soon_threadsafe(_settle, waiter, future)
            except RuntimeError:  # the loop closed: nobody awaits this recv any more
                pass

        self._core.recv_async(task, name, _device_ordinal(device)).add_done_callback(ended)
        try:
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise self._timed_out(task, name, timeout) from None

    def _timed_out(self, task, name, timeout):
        return DeadlineExceededError(
            f"recv of {name!r} from {task} in step {self.id} took over {timeout} s",
            StatusCode.DEADLINE_EXCEEDED)

    def wait_until_sends_taken(self, timeout=30.0):
        """Waits until peers took every tensor this step sent, so ending it drops nothing."""
        self._core.wait_until_sends_taken(float(timeout))

    def end(self):
        self._core.end()

    @property
    def ended(self):
        return self._core.ended

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.end()
        return False


def _settle(waiter, future):
    if waiter.done():  # the awaiting coroutine timed out or was cancelled
        return
    error = future.exception()
    if error is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(future.result())


def tensor_buffer(array):
    """(address, bytes) of the tensor buffer a received or pool array views, or None: the
    array's data pointer equals that address when no copy was made."""
    return _tensorverbs.tensor_buffer(array)


