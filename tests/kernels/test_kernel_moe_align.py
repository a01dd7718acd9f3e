"""moe_align_block_size (Triton) vs its torch reference, plus the reference's invariants."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels import moe_align
from tidal.kernels.moe_align import (
    max_padded_slots,
    moe_align_block_size,
    moe_align_block_size_reference,
)


def _local_ids(tokens: int, top_k: int, experts: int, remote_frac: float) -> torch.Tensor:
    """[T, top_k] int64 distinct local ids per token, some replaced by -1 (remote)."""
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).reshape(
        tokens, top_k
    )
    remote = torch.rand(tokens, top_k) < remote_frac
    return torch.where(remote, torch.full_like(ids, -1), ids)


def _check_invariants(ids_local: torch.Tensor, outs, block: int, experts: int) -> None:
    """What the GEMM relies on, independent of any implementation."""
    sorted_ids, expert_ids, post = (t.cpu() for t in outs)
    numel = ids_local.numel()
    total = int(post.item())
    assert total % block == 0 and total <= sorted_ids.numel()
    live = sorted_ids[:total]
    real = live[live < numel]
    # Every slot exactly once, padding everywhere else.
    assert torch.equal(real.sort().values, torch.arange(numel, dtype=torch.int32))
    assert (sorted_ids[total:] == numel).all()
    flat = ids_local.reshape(-1).cpu()
    for b in range(total // block):
        rows = live[b * block : (b + 1) * block]
        rows = rows[rows < numel].long()
        assert rows.numel() > 0, "no block is pure padding"
        want = int(expert_ids[b])
        got = flat[rows]
        if want == -1:
            assert ((got < 0) | (got >= experts)).all()
        else:
            assert (got == want).all()
    assert (expert_ids[total // block :] == -1).all()


CASES = [
    # (T, top_k, E, block, remote fraction)
    (1, 1, 4, 16, 0.0),
    (1, 2, 4, 16, 0.0),
    (5, 2, 4, 16, 0.0),  # T*K < block
    (13, 3, 8, 16, 0.3),  # with remote slots
    (40, 4, 8, 32, 0.0),
    (64, 2, 16, 16, 0.5),  # experts with no tokens
    (100, 8, 32, 64, 0.1),  # several chunks
]


@pytest.mark.parametrize("tokens,top_k,experts,block,remote", CASES)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_align_matches_reference(tokens, top_k, experts, block, remote, id_dtype, device):
    ids = _local_ids(tokens, top_k, experts, remote).to(id_dtype)
    want = moe_align_block_size_reference(ids, block, experts)
    got = moe_align_block_size(ids.to(device), block, experts)
    for name, g, w in zip(("sorted_token_ids", "expert_ids", "num_post_padded"), got, want):
        assert g.dtype == torch.int32, name
        assert torch.equal(g.cpu(), w.cpu()), name
    _check_invariants(ids, want, block, experts)


@pytest.mark.parametrize("path", ["one_program", "chunked"])
@pytest.mark.parametrize(
    "tokens,top_k,experts,block,with_map",
    [(1, 8, 128, 16, False), (8, 8, 128, 16, True), (3, 2, 6, 64, True), (16, 4, 16, 32, False)],
)
def test_align_paths_agree(tokens, top_k, experts, block, with_map, path, device, monkeypatch):
    """Decode-sized routings (the shapes a serving step sends) through each path: the
    one-program kernel and the count/scan/scatter kernels give the reference's bits."""
    if path == "chunked":
        monkeypatch.setattr(moe_align, "_SMALL_TILE_ELEMENTS", 0)
    e_global = 2 * experts if with_map else experts
    ids = torch.stack([torch.randperm(e_global)[:top_k] for _ in range(tokens)])
    expert_map = None
    if with_map:
        expert_map = torch.full((e_global,), -1, dtype=torch.int32)
        expert_map[torch.randperm(e_global)[:experts]] = torch.arange(experts, dtype=torch.int32)
    want = moe_align_block_size_reference(ids, block, experts, expert_map)
    got = moe_align_block_size(
        ids.to(device), block, experts, None if expert_map is None else expert_map.to(device)
    )
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())


def test_align_all_slots_one_expert(device):
    ids = torch.full((50, 2), 3, dtype=torch.int64)
    ids[:, 1] = 1
    got = moe_align_block_size(ids.to(device), 16, 4)
    sorted_ids, expert_ids, post = (t.cpu() for t in got)
    # 50 slots for each of experts 1 and 3 -> 64 + 64 padded rows.
    assert int(post) == 128
    assert expert_ids[:4].tolist() == [1] * 4 and expert_ids[4:8].tolist() == [3] * 4
    assert torch.equal(sorted_ids[:50], torch.arange(1, 100, 2, dtype=torch.int32))
    _check_invariants(ids, got, 16, 4)


def test_align_with_expert_map(device):
    experts_global, experts_local = 12, 4
    expert_map = torch.full((experts_global,), -1, dtype=torch.int32)
    expert_map[torch.tensor([9, 2, 5, 7])] = torch.arange(experts_local, dtype=torch.int32)
    ids = torch.stack([torch.randperm(experts_global)[:3] for _ in range(21)])
    want = moe_align_block_size_reference(ids, 16, experts_local, expert_map)
    got = moe_align_block_size(ids.to(device), 16, experts_local, expert_map.to(device))
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())
    # Mapping first and aligning the local ids must give the same answer.
    local = expert_map[ids].long()
    for g, w in zip(moe_align_block_size_reference(local, 16, experts_local), want):
        assert torch.equal(g, w.cpu())
    _check_invariants(local, want, 16, experts_local)


def test_align_out_of_range_ids_are_remote(device):
    ids = torch.tensor([[0, 7], [-3, 1]])  # 7 and -3 are not local experts of E=2
    sorted_ids, expert_ids, post = (t.cpu() for t in moe_align_block_size(ids.to(device), 16, 2))
    assert int(post) == 48
    assert expert_ids[:3].tolist() == [0, 1, -1]
    assert sorted_ids[32:34].tolist() == [1, 2]


def test_align_zero_tokens(device):
    ids = torch.zeros((0, 2), dtype=torch.int64, device=device)
    got = moe_align_block_size(ids, 16, 4)
    want = moe_align_block_size_reference(ids.cpu(), 16, 4)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())
    assert int(got[2]) == 0 and got[0].numel() == 0


def test_max_padded_slots_bound():
    assert max_padded_slots(1, 128, 16) == 16
    assert max_padded_slots(8, 128, 16) == 128
    assert max_padded_slots(1000, 3, 16) == 1072  # 1000 + 4 * 15, rounded up to blocks of 16


@pytest.mark.parametrize(
    "ids,block,experts,err",
    [
        (torch.zeros(4, dtype=torch.int64), 16, 4, ValueError),  # not 2-D
        (torch.zeros(4, 2), 16, 4, TypeError),  # float ids
        (torch.zeros(4, 2, dtype=torch.int64), 12, 4, ValueError),  # block not a power of 2
        (torch.zeros(4, 2, dtype=torch.int64), 16, 0, ValueError),
        (torch.zeros(2, 4, dtype=torch.int64).t(), 16, 4, ValueError),  # not contiguous
    ],
)
def test_align_rejects_bad_arguments(ids, block, experts, err):
    with pytest.raises(err):
        moe_align_block_size(ids, block, experts)
