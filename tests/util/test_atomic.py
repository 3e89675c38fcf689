"""clbench.atomic: a library writer's own error for a system fault becomes the OSError it is."""

from __future__ import annotations

import errno

import pytest

from clbench.atomic import os_errors_of


class SafetensorError(Exception):
    """Named like safetensors' Rust error: `os_errors_of` recognises it by name."""


@pytest.mark.parametrize("message", [
    # safetensors 0.4.x
    "Error while serializing: IoError(Os { code: 27, kind: FileTooLarge, "
    'message: "File too large" })',
    # later releases
    "Error while serializing: I/O error: File too large (os error 27)",
])
def test_a_safetensors_io_error_is_the_os_error_with_the_file(message: str) -> None:
    with pytest.raises(OSError) as caught, os_errors_of("w/base.safetensors"):
        raise SafetensorError(message)
    assert caught.value.errno == errno.EFBIG
    assert str(caught.value) == "[Errno 27] File too large: 'w/base.safetensors'"


def test_other_errors_pass_unchanged() -> None:
    with pytest.raises(SafetensorError, match="header too large"), os_errors_of("w"):
        raise SafetensorError("header too large")
    with pytest.raises(ValueError, match="os error 28"), os_errors_of("w"):
        raise ValueError("os error 28")
