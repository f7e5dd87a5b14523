"""A DLPack producer made with ctypes, standing in for a PyTorch CUDA tensor or a CuPy array:
it hands out a "dltensor" capsule over memory it names, on the device it names, and counts
the calls of its deleter."""

import ctypes


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                ("dtype", _DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p),
                     ("deleter", _Deleter)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_NAME = ctypes.create_string_buffer(b"dltensor")  # lives as long as the module

# DLPack type codes by NumPy kind letter, plus bfloat16 and bool.
_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


class Producer:
    """A tensor of `shape` at `address` on (`device_type`, `device_id`): its __dlpack__ capsule
    is taken by whoever consumes it, and `deleted` counts the deleter's calls."""

    def __init__(self, address, shape, kind="f", bits=32, device_type=2, device_id=0,
                 strides=None, byte_offset=0):
        self.deleted = 0
        self.capsules = 0
        self.streams = []  # the stream argument of each __dlpack__ call
        self._device = (device_type, device_id)
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
        self._deleter = _Deleter(self._delete)  # kept: ctypes callbacks die with their object
        self._managed = []
        self._fields = (address, kind, bits, byte_offset)

    def _delete(self, managed):
        self.deleted += 1

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        address, kind, bits, byte_offset = self._fields
        m = _Managed()
        t = m.dl_tensor
        t.data = address
        t.device = _Device(*self._device)
        t.ndim = len(self._shape)
        t.dtype = _DataType(4 if kind == "bf" else _CODES[kind], bits, 1)
        t.shape = self._shape
        t.strides = self._strides
        t.byte_offset = byte_offset
        m.deleter = self._deleter
        self._managed.append(m)  # the consumer's pointer stays valid while this lives
        self.capsules += 1
        return _capsule_new(ctypes.addressof(m), _NAME, None)


class StreamlessProducer(Producer):
    """A producer whose __dlpack__ takes no stream argument (older DLPack producers)."""

    def __dlpack__(self):  # noqa: the protocol's older form
        return super().__dlpack__()
