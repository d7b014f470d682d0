import pytest
import torch

from specdec.conventions import default_aux_layer_ids, from_canonical, resolve_aux_layer_ids, to_canonical
from specdec.errors import SpecdecError
from tests.conftest import ARCHS


def test_defaults_match_design_table():
    # 32-layer target (Llama-3.1-8B): EAGLE/vLLM ids [2, 16, 29]; SpecForge writes [1, 15, 28].
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert from_canonical([2, 16, 29], "specforge") == [1, 15, 28]
    assert to_canonical([1, 15, 28], "modelopt") == [2, 16, 29]
    assert to_canonical([2, 16, 29], "vllm") == [2, 16, 29]


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_sglang_always_adds_one_for_llama_family(model_type):
    # srt/models/llama.py 929-941, qwen2.py 781-794, qwen3.py 778-791 (SGLang 0.5.23): val + 1.
    assert to_canonical([3, 6, 9], "sglang", model_type) == [4, 7, 10]
    assert to_canonical([1, 15, 28], "sglang", model_type) == [2, 16, 29]
    assert from_canonical([3, 6, 9], "sglang", model_type) == [2, 5, 8]
    for ids in ([2, 16, 29], [3, 16, 29], [1, 2, 3]):
        assert to_canonical(from_canonical(ids, "sglang", model_type), "sglang", model_type) == ids


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2", "kimi_k2", "glm4_moe_lite"])
def test_sglang_adds_one_only_when_first_is_one_for_deepseek(model_type):
    # srt/models/deepseek_v2.py 3458-3473, glm4_moe_lite.py 805-820: +1 only when layer_ids[0] == 1.
    assert to_canonical([1, 29, 57], "sglang", model_type) == [2, 30, 58]
    assert to_canonical([2, 30, 58], "sglang", model_type) == [2, 30, 58]  # Kimi-K2.5's drafter
    assert from_canonical([3, 31, 59], "sglang", model_type) == [3, 31, 59]
    assert from_canonical([2, 30, 58], "sglang", model_type) == [1, 29, 57]
    with pytest.raises(SpecdecError, match="cannot be told"):
        from_canonical([1, 2, 4], "sglang", model_type)


def test_sglang_without_architecture_converts_only_what_every_rule_reads_alike():
    assert to_canonical([1, 15, 28], "sglang") == [2, 16, 29]
    assert from_canonical([2, 16, 29], "sglang") == [1, 15, 28]
    with pytest.raises(SpecdecError, match=r"add 1 \(\[4, 17, 30\]\).*\(\[3, 16, 29\]\)"):
        to_canonical([3, 16, 29], "sglang")


def test_layer_order_must_be_ascending_and_distinct():
    from specdec.conventions import require_layer_order

    assert require_layer_order([2, 6, 9], "ids") == [2, 6, 9]
    for bad in ([9, 2, 6], [2, 2, 9]):
        with pytest.raises(SpecdecError, match="pass 2,6,9|pass 2,9"):
            require_layer_order(bad, "--aux-layer-ids")


def test_out_of_range_and_unknown_convention_are_refused():
    with pytest.raises(SpecdecError, match="out of range"):
        resolve_aux_layer_ids(4, [1, 2, 9])
    with pytest.raises(SpecdecError, match="unknown layer-id convention"):
        to_canonical([1], "medusa")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("convention,ids", [("eagle", [1, 2, 3]), ("specforge", [0, 1, 2])])
def test_hooks_capture_hf_hidden_states(tiny_targets, arch, convention, ids):
    """Canonical id k must be HF output_hidden_states[k] for every architecture."""
    target = tiny_targets[arch]
    target.set_aux_layer_ids(ids, convention)
    try:
        x = torch.randint(0, 250, (2, 9))
        out = target.forward(x)
        ref = target.model(x, output_hidden_states=True).hidden_states
        h = target.hidden_size
        for slot, k in enumerate(to_canonical(ids, convention)):
            torch.testing.assert_close(out.aux_hidden[..., slot * h : (slot + 1) * h], ref[k])
        torch.testing.assert_close(out.logits, target.model(x).logits)
    finally:
        target.set_aux_layer_ids(None)


def test_shift_moves_every_id(tiny_targets):
    t = tiny_targets["llama"]
    assert resolve_aux_layer_ids(t.num_layers, [1, 2, 3], shift=1) == [2, 3, 4]
