"""PyTorch CPU tensors (shared through numpy() and DLPack): every dtype both ways, received buffers and pool memory
shared with torch without copies, and tensors DLPack cannot carry refused clearly."""

import numpy as np
import pytest

import tensorverbs as tv

torch = pytest.importorskip("torch")

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128]


def sample(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 100, shape, generator=g)
    if dtype.is_complex:
        return torch.complex(values.double(), values.flip(-1).double() if values.dim() else
                             values.double()).to(dtype)
    return values.to(dtype)


def test_torch_tensors_of_every_dtype_round_trip(pair):
    a, b = pair
    shapes = [(), (5,), (3, 4), (2, 0, 3)]
    with a.step(1) as receiving, b.step(1) as sending:
        sent = {}
        for i, dtype in enumerate(DTYPES):
            for j, shape in enumerate(shapes):
                name = f"{dtype}/{j}"
                sent[name] = sample(dtype, shape, i * 10 + j)
                sending.send("worker:0", name, sent[name])
        for name, value in sent.items():
            got = torch.from_numpy(receiving.recv("worker:1", name, timeout=20))
            assert got.dtype == value.dtype, name
            assert got.shape == value.shape, name
            assert torch.equal(got, value), name


def test_a_received_tensor_becomes_a_torch_tensor_without_a_copy(verbs_pair):
    a, b = verbs_pair
    copies = a.stats()["copies"]
    with a.step(1) as receiving, b.step(1) as sending:
        sending.send("worker:0", "w", torch.arange(1 << 14, dtype=torch.float32))
        got = receiving.recv("worker:1", "w", timeout=20)
    t = torch.from_dlpack(got)
    address, size = tv.tensor_buffer(got)
    assert t.data_ptr() == address  # the tensor is the buffer the transport wrote into
    assert t.numel() * t.element_size() == size
    assert a.stats()["copies"] == copies
    # The buffer lives as long as the torch tensor, after the array and the task are gone.
    del got
    a.stop()
    assert torch.equal(t, torch.arange(1 << 14, dtype=torch.float32))


def test_torch_tensors_in_pool_memory_are_sent_without_a_copy(verbs_pair):
    a, b = verbs_pair
    pooled = torch.from_numpy(b.empty((128, 64), np.float32))  # torch's view of pool memory
    pooled.fill_(3.0)
    via_dlpack = torch.from_dlpack(b.empty(1000, np.int64))
    via_dlpack.copy_(torch.arange(1000))
    ordinary = torch.full((64,), 7.0)
    staged = b.stats()["staged"]
    with a.step(1) as receiving, b.step(1) as sending:
        sending.send("worker:0", "pooled", pooled)
        sending.send("worker:0", "via_dlpack", via_dlpack)
        assert b.stats()["staged"] == staged  # both went as the pool tensors they view
        sending.send("worker:0", "ordinary", ordinary)
        assert b.stats()["staged"] == staged + 1  # an ordinary tensor is copied once
        assert torch.equal(torch.from_dlpack(receiving.recv("worker:1", "pooled", timeout=20)),
                           pooled)
        assert torch.equal(torch.from_dlpack(receiving.recv("worker:1", "via_dlpack", timeout=20)),
                           via_dlpack)
        assert torch.equal(torch.from_dlpack(receiving.recv("worker:1", "ordinary", timeout=20)),
                           ordinary)
        sending.wait_until_sends_taken(20)

    # A received tensor sent on (forwarded) goes as the buffer it is, too.
    with a.step(2) as sending, b.step(2) as receiving:
        sending.send("worker:1", "seed", torch.arange(256, dtype=torch.float64))
        forwarded = torch.from_dlpack(receiving.recv("worker:0", "seed", timeout=20))
        staged = b.stats()["staged"]
        receiving.send("worker:0", "back", forwarded)
        assert b.stats()["staged"] == staged
        back = torch.from_dlpack(sending.recv("worker:1", "back", timeout=20))
        assert torch.equal(back, torch.arange(256, dtype=torch.float64))


def test_tensors_dlpack_or_the_wire_cannot_carry_raise_clear_errors(verbs_pair):
    a, b = verbs_pair
    with b.step(1) as sending:
        with pytest.raises(TypeError, match="bfloat16"):
            sending.send("worker:0", "bf16", torch.ones(4, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="not C-contiguous"):
            sending.send("worker:0", "transposed", torch.ones(3, 5).t())
        with pytest.raises(TypeError, match="detached from autograd"):
            sending.send("worker:0", "grad", torch.ones(3, requires_grad=True))
        # A tensor that needs no gradient, or its detached value, goes.
        sending.send("worker:0", "detached", torch.ones(3, requires_grad=True).detach())


def test_a_torch_tensor_is_received_into_as_out_and_returned(verbs_pair):
    a, b = verbs_pair
    with a.step(1) as receiving, b.step(1) as sending:
        sent = torch.arange(12, dtype=torch.float64).reshape(3, 4)
        sending.send("worker:0", "t", sent)
        out = torch.zeros(3, 4, dtype=torch.float64)
        got = receiving.recv("worker:1", "t", timeout=20, out=out)
        assert got is out
        assert torch.equal(out, sent)
        sending.send("worker:0", "u", sent)
        with pytest.raises(ValueError, match=r"float64\[3,4\], `out` is int32\[3,4\]"):
            receiving.recv("worker:1", "u", timeout=20, out=torch.zeros(3, 4, dtype=torch.int32))
