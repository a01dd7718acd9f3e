"""Shared by the tests of the C++ CPU kernels (``tidal/kernels/csrc``): the skip mark for
a machine where the extension was not built, and a fixture that gives back torch's thread
count after a test that sets it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tidal.kernels.cpu_ext import kernel_available, kernel_status

needs_kernel = pytest.mark.skipif(not kernel_available(), reason=kernel_status())


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    """Import it into a test module to apply it there (autouse within that module)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
