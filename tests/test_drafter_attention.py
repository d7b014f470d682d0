"""The drafter's inference attention equals attention written out, for grouped heads and any mask."""

import torch

from specdec.models.drafter import small_query_attention


def test_small_query_attention_matches_written_out_attention():
    g = torch.Generator().manual_seed(0)
    b, kvh, groups, t, s, hd = 1, 3, 3, 4, 37, 16
    q = torch.randn(b, kvh * groups, t, hd, generator=g)
    k = torch.randn(b, kvh, s, hd, generator=g)
    v = torch.randn(b, kvh, s, hd, generator=g)
    mask = torch.rand(t, s, generator=g) > 0.5
    mask[:, 0] = True  # every row attends somewhere (a tree row always sees the committed prefix)
    got = small_query_attention(q, k, v, mask)
    kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # head h reads KV head h // groups
    scores = (q @ kr.transpose(-1, -2)) / hd**0.5
    want = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vr
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
