"""CPU buffers on transparent huge pages (``tidal/kernels/host_memory.py``) and the
tensors the CPU kernels stream that live on them: packed experts, packed linear weights,
the KV cache."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from tidal import LLM
from tidal.kernels.cpu_linear import pack_linear_weight
from tidal.kernels.cpu_moe import CpuPackedExperts
from tidal.kernels.host_memory import HUGE_PAGE, empty_huge, is_huge_page_advised

needs_thp = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this OS"
)
BIG = (HUGE_PAGE // 4 + 4096,)  # just over one huge page of float32


@needs_thp
def test_large_buffer_is_zeroed_writable_and_advised():
    t = empty_huge((3, *BIG))
    assert t.shape == (3, *BIG) and t.dtype == torch.float32 and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    assert is_huge_page_advised(t)
    t[1].fill_(2.0)
    assert t.sum().item() == 2.0 * BIG[0]


def test_small_buffer_stays_with_torch_and_other_dtypes_work():
    small = empty_huge((16, 16))
    assert small.shape == (16, 16) and torch.count_nonzero(small) == 0
    assert not is_huge_page_advised(small)
    assert empty_huge((4, *BIG), torch.int64).dtype == torch.int64


@needs_thp
def test_a_view_keeps_the_mapping_alive():
    row = empty_huge((4, *BIG))[2]
    gc.collect()
    row.fill_(1.5)  # would fault if the mapping had been unmapped with the base tensor
    assert row.sum().item() == 1.5 * BIG[0]


@needs_thp
def test_streamed_tensors_live_on_huge_pages(qwen3_ckpt):
    experts = CpuPackedExperts(torch.randn(8, 2 * 256, 512), torch.randn(8, 512, 256))
    assert is_huge_page_advised(experts.w13) and is_huge_page_advised(experts.w2)
    assert is_huge_page_advised(pack_linear_weight(torch.randn(1024, 1024)))
    llm = LLM(qwen3_ckpt, dtype="float32", multiprocess=False)
    try:
        caches = llm.client.engine.executor.worker.model_runner.kv_caches
        assert caches and all(is_huge_page_advised(c) for c in caches)
        assert all(torch.count_nonzero(c) == 0 for c in caches)  # zeroed, as torch.zeros
    finally:
        llm.shutdown()
