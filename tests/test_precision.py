"""The one precision rule: bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere."""

import pytest
import torch

from specdec import precision
from specdec.errors import SpecdecError


@pytest.fixture
def cpu_bf16(monkeypatch):
    def set_native(native: bool):
        precision.cpu_has_native_bf16.cache_clear()
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)

    yield set_native
    precision.cpu_has_native_bf16.cache_clear()


def test_cpu_dtype_follows_native_bf16(cpu_bf16):
    cpu_bf16(True)
    assert precision.compute_dtype("cpu") == torch.bfloat16
    assert precision.parse_dtype("auto", "cpu") == torch.bfloat16
    cpu_bf16(False)
    assert precision.compute_dtype("cpu") == torch.float32
    assert precision.parse_dtype(None, torch.device("cpu")) == torch.float32
    assert precision.compute_dtype("cuda:0") == torch.bfloat16  # GPUs: bf16 whatever the CPU


def test_explicit_names_win_and_bad_names_say_what_is_expected():
    assert precision.parse_dtype("fp32", "cuda") == torch.float32
    assert precision.parse_dtype("bfloat16", "cpu") == torch.bfloat16
    assert precision.parse_dtype(torch.float16, "cpu") == torch.float16
    with pytest.raises(SpecdecError, match="auto, bf16, fp16, fp32.*'int8'"):
        precision.parse_dtype("int8", "cpu")
