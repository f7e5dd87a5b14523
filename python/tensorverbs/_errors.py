"""The exceptions tensorverbs raises: one class per status code, each carrying the code and the
message the C++ core gave (which names the key, the peer and any setting involved).

Each class also derives from the built-in exception a Python user would catch for that kind of
failure: InvalidArgumentError is a ValueError, DeadlineExceededError a TimeoutError,
UnavailableError a ConnectionError, and so on.
"""

import enum


class StatusCode(enum.IntEnum):
    """absl::StatusCode (gRPC's codes)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Error(Exception):
    """A failed tensorverbs operation. `code` is its StatusCode; str() is the message."""

    code = StatusCode.UNKNOWN

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = StatusCode(code)

    @property
    def message(self):
        return self.args[0] if self.args else ""


class CancelledError(Error):
    code = StatusCode.CANCELLED


class UnknownError(Error):
    code = StatusCode.UNKNOWN


class InvalidArgumentError(Error, ValueError):
    code = StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(Error, TimeoutError):
    code = StatusCode.DEADLINE_EXCEEDED


class NotFoundError(Error, LookupError):
    code = StatusCode.NOT_FOUND


class AlreadyExistsError(Error):
    code = StatusCode.ALREADY_EXISTS


class PermissionDeniedError(Error, PermissionError):
    code = StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(Error, MemoryError):
    code = StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(Error):
    code = StatusCode.FAILED_PRECONDITION


class AbortedError(Error):
    code = StatusCode.ABORTED


class OutOfRangeError(Error, IndexError):
    code = StatusCode.OUT_OF_RANGE


class UnimplementedError(Error, NotImplementedError):
    code = StatusCode.UNIMPLEMENTED


class InternalError(Error):
    code = StatusCode.INTERNAL


class UnavailableError(Error, ConnectionError):
    code = StatusCode.UNAVAILABLE


class DataLossError(Error):
    code = StatusCode.DATA_LOSS


class UnauthenticatedError(Error, PermissionError):
    code = StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in Error.__subclasses__()}


def error_from_status(code, message):
    """The exception for a non-OK status (code, message)."""
    try:
        code = StatusCode(code)
    except ValueError:
        return UnknownError(f"{message} (status code {code})")
    return _BY_CODE.get(code, UnknownError)(message, code)
