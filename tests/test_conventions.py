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


def test_sglang_adds_one_only_when_first_id_is_one():
    assert to_canonical([1, 15, 28], "sglang") == [2, 16, 29]
    assert to_canonical([3, 16, 29], "sglang") == [3, 16, 29]
    for ids in ([2, 16, 29], [3, 16, 29]):
        assert to_canonical(from_canonical(ids, "sglang"), "sglang") == ids


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
