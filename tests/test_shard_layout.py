"""Dim-0 sharding arithmetic: every row lands on exactly one rank, as torch.chunk puts it."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.shard.layout import build_layout

shapes = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(shapes=shapes, world=st.integers(1, 8), n_frozen=st.integers(0, 6))
def test_rows_partition_like_torch_chunk(shapes, world, n_frozen):
    shapes = [torch.Size(s) for s in shapes]
    trainable = [i >= n_frozen for i in range(len(shapes))][::-1]
    trainable = sorted(trainable, reverse=True)
    lay = build_layout(shapes, trainable, world)
    offset = 0
    for shape, p in zip(shapes, lay.params):
        assert p.offset == offset
        offset += p.padded_numel
        full = torch.arange(max(1, shape.numel())).reshape(shape) if shape.numel() else \
            torch.empty(shape)
        rows = full.reshape(p.rows, p.row_numel)
        chunks = list(torch.chunk(rows, world)) if p.rows else []
        seen = []
        for r in range(world):
            lo, n = p.row_offset(r), p.local_rows(r)
            assert 0 <= n <= p.chunk_rows
            expect = chunks[r] if r < len(chunks) else rows[:0]
            assert torch.equal(rows[lo:lo + n], expect)
            seen.extend(range(lo, lo + n))
            if len(shape):
                assert p.local_shape(r) == torch.Size([n, *shape[1:]])
        assert seen == list(range(p.rows))
        assert p.chunk_rows * world - p.rows < world or p.rows == 0  # padding < one row/rank
    assert lay.shard_numel == offset and lay.full_numel == world * offset
    n_train = sum(trainable)
    assert lay.grad_numel == sum(p.padded_numel for p in lay.params[:n_train])


def test_scalar_lives_on_rank_zero():
    lay = build_layout([torch.Size([])], [True], 3)
    p = lay.params[0]
    assert [p.local_shape(r) for r in range(3)] == [torch.Size([]), torch.Size([0]),
                                                    torch.Size([0])]
    assert p.padded_numel == 1 and lay.shard_numel == 1
