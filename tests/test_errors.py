"""sfstore.errors: one base class, builtins mixed in, errno and path in messages."""

from __future__ import annotations

import errno

import pytest

from sfstore import errors


def test_every_exported_error_is_an_sfstore_error() -> None:
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, Warning):  # and every warning an SfstoreWarning
            assert issubclass(obj, errors.SfstoreWarning), name
        elif isinstance(obj, type):
            assert issubclass(obj, errors.SfstoreError), name


@pytest.mark.parametrize(
    ("err", "cls", "builtin"),
    [
        (errno.ENOENT, errors.PathNotFoundError, FileNotFoundError),
        (errno.EEXIST, errors.PathExistsError, FileExistsError),
        (errno.EACCES, errors.AccessDeniedError, PermissionError),
        (errno.ENOSPC, errors.NoSpaceError, OSError),
        (errno.EBADF, errors.BadFileDescriptorError, OSError),
        (errno.EIO, errors.SfstoreOSError, OSError),
    ],
)
def test_os_error_maps_errno_to_class(err: int, cls: type, builtin: type) -> None:
    exc = errors.os_error(err, "opening the thing", "/data/x")
    assert type(exc) is cls and isinstance(exc, builtin)
    assert exc.errno == err and exc.filename == "/data/x"
    assert "opening the thing" in str(exc) and "/data/x" in str(exc)


def test_engine_errors_keep_their_class_except_for_space_and_bad_fds() -> None:
    assert type(errors.os_error(errno.EIO, "r", None, errors.IOEngineError)) is errors.IOEngineError
    assert type(errors.os_error(errno.EISDIR, "r", None, errors.IOEngineError)) is errors.IOEngineError
    assert type(errors.os_error(errno.ENOSPC, "w", None, errors.IOEngineError)) is errors.NoSpaceError


def test_native_error_kinds() -> None:
    assert type(errors.native_error("too_small", 0, "m")) is errors.BufferTooSmallError
    assert isinstance(errors.native_error("alignment", errno.EINVAL, "m"), ValueError)
    assert isinstance(errors.native_error("read_only", 0, "m"), TypeError)
    assert isinstance(errors.native_error("in_use", 0, "m"), BufferError)
    reg = errors.native_error("registration", errno.EPERM, "m", "/dev/x")
    assert isinstance(reg, errors.RegistrationError) and reg.errno == errno.EPERM
    bad = errors.native_error("os", errno.EBADF, "m")
    assert isinstance(bad, errors.BadFileDescriptorError) and bad.errno == errno.EBADF


def test_path_escape_is_a_permission_error() -> None:
    assert issubclass(errors.PathEscapeError, PermissionError)
