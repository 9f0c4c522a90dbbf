"""The host side of a step: index lists become tensors through the stdlib array with the
values `torch.tensor` would give, CPU runs keep their tensors, and a step's layout
(positions, KV slots, attention metadata) is the one written out by hand."""

from __future__ import annotations

import pytest
import torch

from stage_worker.block_tables import BlockTables
from stage_worker.host_transfer import (
    HostCopy,
    copy_into,
    host_tensor,
    to_device,
    upload,
    write_ints,
)
from stage_worker.step_input import SeqChunk, build_context

CPU = torch.device("cpu")


@pytest.mark.parametrize(("values", "dtype"), [
    ([3, -1, 2**63 - 1, -(2**63)], torch.int64), ((7,), torch.int32), ([], torch.int64),
    ([0.7, 1.0, 1e-9, -2.5], torch.float32), ([0.1, 1e300], torch.float64),
    ([True, False, True], torch.bool), ([[1, 2], [3, 4]], torch.int32), ([], torch.bool),
    (((1, 2), (3, 4)), torch.int64), ([(5,), (6,)], torch.int64), ((2.5, 1), torch.float32),
])
def test_host_tensors_hold_what_torch_tensor_would(values: list[object],
                                                   dtype: torch.dtype) -> None:
    got, want = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)  # type: ignore[arg-type]
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_any_iterable_of_numbers_becomes_a_tensor() -> None:
    assert torch.equal(host_tensor(map(int, "1234")), torch.tensor([1, 2, 3, 4]))
    assert torch.equal(host_tensor(range(3), torch.int32), torch.arange(3, dtype=torch.int32))


def test_a_cpu_run_copies_nothing() -> None:
    t = torch.arange(5)
    assert upload(t, CPU) is t
    assert HostCopy([t, t + 1]).wait()[0] is t
    assert to_device([1, 2], torch.int64, CPU).tolist() == [1, 2]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_copy_into_overwrites_in_place(device: str) -> None:
    dst = torch.zeros(4, dtype=torch.int64, device=device)
    kept = dst
    copy_into(dst, host_tensor([5, -1, 2**63 - 1, 7]))
    assert dst is kept and dst.cpu().tolist() == [5, -1, 2**63 - 1, 7]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_write_ints_overwrites_in_place(device: str) -> None:
    dst = torch.zeros(4, dtype=torch.int64, device=device)
    kept = dst
    write_ints(dst, (5, -1, 2**63 - 1, 7))
    assert dst is kept and dst.cpu().tolist() == [5, -1, 2**63 - 1, 7]


def test_step_layout_of_a_mixed_batch() -> None:
    chunks = [SeqChunk(1, 17, 1, [4, 9, 2]),  # a decode at position 17 (block 2, offset 1)
              SeqChunk(2, 6, 3, [5, 7]),  # a prefill chunk: positions 6..8
              SeqChunk(3, 0, 1, [3], sample=False)]
    inv_freq = torch.tensor([1.0, 0.5])
    ctx = build_context(chunks, BlockTables(4, 4, 8, CPU), inv_freq, CPU)
    assert ctx.positions.tolist() == [17, 6, 7, 8, 0]
    assert ctx.slot_mapping.tolist() == [2 * 8 + 1, 5 * 8 + 6, 5 * 8 + 7, 7 * 8 + 0, 3 * 8]
    freqs = torch.tensor([17.0, 6, 7, 8, 0])[:, None] * inv_freq
    torch.testing.assert_close(ctx.cos, torch.cat([freqs, freqs], -1).cos(), rtol=0, atol=0)
    attn = ctx.attn
    assert attn.block_tables.dtype == torch.int32 and attn.seq_lens.dtype == torch.int32
    assert attn.block_tables.tolist() == [[4, 9, 2], [5, 7, -1], [3, -1, -1]]
    assert attn.seq_lens.tolist() == [18, 9, 1] and attn.query_start.tolist() == [0, 1, 4, 5]
    assert (attn.seq_lens_host, attn.query_start_host) == ((18, 9, 1), (0, 1, 4, 5))
    assert (attn.max_query_len, attn.max_seq_len) == (3, 18)
    assert attn.decode_seqs == (0, 2) and attn.prefill_seqs == (1,)
    assert attn.decode_rows is not None and attn.decode_rows.tolist() == [0, 4]
    assert attn.decode_index is not None and attn.decode_index.tolist() == [0, 2]
    with pytest.raises(ValueError, match="sequence 4: 1 blocks cannot hold 9 tokens"):
        build_context([SeqChunk(4, 8, 1, [0])], BlockTables(4, 4, 8, CPU), inv_freq, CPU)
