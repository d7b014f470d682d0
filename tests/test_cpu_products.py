"""fp32 CPU targets compute few-row linear layers as `weight @ x.T` (specdec.models.cpu_products):
the same values as `F.linear`, only where they apply, and the engine stays lossless with them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.engine.api import SamplingParams
from specdec.engine.engine import SpeculativeEngine
from specdec.models.cpu_products import few_row_forward, route_few_row_products
from specdec.models.target import load_target
from tests.test_engine_lossless import random_drafter


@pytest.mark.parametrize("out_features,in_features", [(256, 32), (32, 96), (48, 48)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 3), (2, 4), (1, 8), (1, 9), (3, 7)])
def test_routed_linear_equals_f_linear(out_features, in_features, bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(*shape, in_features)
    want = F.linear(x, layer.weight, layer.bias)
    assert route_few_row_products(layer) == 1
    got = layer(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_fp32_linear_layers_are_routed():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.LayerNorm(8))
    assert route_few_row_products(model) == 1
    assert model[0].forward.__func__ is few_row_forward
    assert "forward" not in model[1].__dict__ and "forward" not in model[2].__dict__


def test_load_target_routes_fp32_cpu_targets_only(tiny_dirs):
    fp32 = load_target(str(tiny_dirs["llama"]), device="cpu", dtype="fp32")
    bf16 = load_target(str(tiny_dirs["llama"]), device="cpu", dtype="bf16")
    assert fp32.lm_head().forward.__func__ is few_row_forward
    assert "forward" not in bf16.lm_head().__dict__


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_with_routed_target_matches_plain(tiny_dirs, arch):
    target = load_target(str(tiny_dirs[arch]), device="cpu", dtype="fp32")
    assert target.lm_head().forward.__func__ is few_row_forward
    drafter = random_drafter(target)
    prompt = torch.randint(0, 250, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ref = SpeculativeEngine(target).generate(prompt, greedy).token_ids
    for k in (1, 3, 7):  # verify steps of 2, 4 and 8 rows: all routed
        assert SpeculativeEngine(target, drafter=drafter, k=k).generate(prompt, greedy).token_ids == ref
