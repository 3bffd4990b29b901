"""The sdpa backend's own steps."""

import torch

from attnkit.backends.sdpa import _with_sink_key
from attnkit.testing import random_qkv


def test_sdpa_sink_logit_keeps_float32_precision_in_bfloat16():
    # the logit rides on q's extra columns in three rounded parts: with a bfloat16 q the
    # sink key's score is the logit to float32 precision (one bfloat16 column would round 3.3 to 3.296875)
    q, k, v = random_qkv(2, 4, 2, 21, 29, 16, 16, dtype=torch.bfloat16)
    sinks = torch.tensor([3.3, -2.3, 0.1, 300.7]).expand(2, 4)
    q2, k2, v2 = _with_sink_key(q, k, v, sinks, scale=0.25)
    assert q2.shape[-1] % 8 == 0 and k2.shape[2] == k.shape[2] + 1 and v2.shape[2] == v.shape[2] + 1
    score = (q2.float() @ k2[:, :, -1:].float().repeat_interleave(2, 1).transpose(-1, -2)).squeeze(-1) * 0.25
    torch.testing.assert_close(score, sinks[:, :, None].expand_as(score), rtol=1e-6, atol=1e-6)
    assert torch.equal(v2[:, :, -1], torch.zeros_like(v2[:, :, -1]))
