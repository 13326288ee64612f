"""The torch reference attention's batched short-query path (decode, speculative verification)
against its per-sequence path and a dense causal oracle."""

import pytest
import torch
import torch.nn.functional as F

from sluice_engine.attention import torch_paged
from sluice_engine.attention.torch_paged import TorchPagedAttention
from sluice_engine.forward_context import AttentionMetadata


def _case(q_lens, seq_lens, hq=6, hkv=2, d=16, bs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()  # shuffled physical blocks
    tables, k_full, v_full = [], [], []
    cache = torch.zeros(2, num_blocks, bs, hkv, d)
    for s, nb in zip(seq_lens, blocks_per_seq, strict=True):
        table = [perm.pop() for _ in range(nb)]
        k = torch.randn(s, hkv, d, generator=g)
        v = torch.randn(s, hkv, d, generator=g)
        for pos in range(s):
            cache[0, table[pos // bs], pos % bs] = k[pos]
            cache[1, table[pos // bs], pos % bs] = v[pos]
        tables.append(table)
        k_full.append(k)
        v_full.append(v)
    width = max(map(len, tables))
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens), block_size=bs,
    )
    q = torch.randn(starts[-1], hq, d, generator=g)
    return q, cache, meta, k_full, v_full


def _dense(q, meta, k_full, v_full, scale):
    outs = []
    for i, (n, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        qi = q[meta.query_start_loc[i] : meta.query_start_loc[i] + n].transpose(0, 1)
        mask = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
        o = F.scaled_dot_product_attention(qi, k_full[i].transpose(0, 1), v_full[i].transpose(0, 1),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("q_lens,seq_lens", [
    ([1, 1, 1], [1, 17, 40]),  # decode
    ([5, 1, 3], [9, 33, 5]),  # speculative verification beside a decode
    ([8, 2], [8, 64]),  # a whole short prompt (no cached prefix) beside a prefix
])
def test_short_query_path_matches_dense_attention(q_lens, seq_lens, monkeypatch):
    q, cache, meta, k_full, v_full = _case(q_lens, seq_lens)
    want = _dense(q, meta, k_full, v_full, 0.25)
    backend = TorchPagedAttention()
    got = backend.attend(q, None, None, cache, meta, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(torch_paged, "SHORT_QUERY_LEN", 0)  # the per-sequence loop
    meta.per_step.clear()  # the plan is made once per step: this is a new one
    q_rows = [q[s : s + n] for s, n in zip(meta.query_start_loc[:-1].tolist(), q_lens, strict=True)]
    k_new = torch.cat([k[-n:] for k, n in zip(k_full, q_lens, strict=True)])
    v_new = torch.cat([v[-n:] for v, n in zip(v_full, q_lens, strict=True)])
    looped = backend.attend(torch.cat(q_rows), k_new, v_new, cache, meta, 0.25)
    torch.testing.assert_close(looped, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lens,seq_lens", [
    ([1, 20, 1, 3], [30, 20, 7, 12]),  # a whole prompt beside decodes and a verification
    ([1, 16, 1], [5, 40, 64]),  # a prompt chunk after a cached prefix, between decodes
    ([12, 1], [12, 9]),  # one short query: the loop alone
])
def test_mixed_step_batches_its_short_queries(q_lens, seq_lens):
    """A step with a prompt chunk (longer than SHORT_QUERY_LEN) beside short queries: the short ones go
    in one padded call and the long ones loop; both match dense attention."""
    q, cache, meta, k_full, v_full = _case(q_lens, seq_lens, seed=1)
    # The loop path reads this step's own K/V for a prompt without a cached prefix.
    k_new = torch.cat([k[-n:] for k, n in zip(k_full, q_lens, strict=True)])
    v_new = torch.cat([v[-n:] for v, n in zip(v_full, q_lens, strict=True)])
    got = TorchPagedAttention().attend(q, k_new, v_new, cache, meta, 0.25)
    torch.testing.assert_close(got, _dense(q, meta, k_full, v_full, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group_cost", [0, 64, 10**9])
def test_decode_groups_by_context_length_match_dense_attention(group_cost, monkeypatch):
    """Decodes of very different lengths: grouped by length (many groups at cost 0, one at a huge
    cost), with a verification and a prompt chunk in the same step, all match dense attention."""
    monkeypatch.setattr(torch_paged, "GROUP_COST_ROWS", group_cost)
    q_lens = [1, 1, 3, 1, 12, 1, 1]
    seq_lens = [200, 5, 70, 9, 40, 130, 17]
    q, cache, meta, k_full, v_full = _case(q_lens, seq_lens, seed=2)
    k_new = torch.cat([k[-n:] for k, n in zip(k_full, q_lens, strict=True)])
    v_new = torch.cat([v[-n:] for v, n in zip(v_full, q_lens, strict=True)])
    got = TorchPagedAttention().attend(q, k_new, v_new, cache, meta, 0.25)
    torch.testing.assert_close(got, _dense(q, meta, k_full, v_full, 0.25), atol=1e-5, rtol=1e-5)
    _, groups, long = meta.per_step["torch_paged"]
    assert long == [4]
    if group_cost == 10**9:
        assert len(groups) == 1
    else:
        assert len(groups) > 1


def test_length_groups_trade_padding_for_calls():
    lens = [16, 16, 16, 16, 400, 400]
    # Four short and two long sequences: padding the short ones to 400 costs 4 x 384 rows.
    assert torch_paged._length_groups(list(range(6)), lens, 16) == [[0, 1, 2, 3], [4, 5]]
    assert 4 * 384 > torch_paged.GROUP_COST_ROWS  # the split above pays for its extra call
    assert torch_paged._length_groups([0, 1, 2], [100, 110, 120], 16) == [[0, 1, 2]]
    assert torch_paged._length_groups([], [], 16) == []
