"""Contract tests: specdec's exports as vLLM 0.34.0 and SGLang 0.5.23 read them.

The rules live in specdec/engine_rules.py, each with the engine file and lines it was read from
(`pip download --no-deps vllm==0.34.0 sglang==0.5.23`, unzip). The first tests pin single rules
to what those lines do; the matrix then exports drafters for every supported target architecture
in both formats and checks that each engine loads every tensor into a parameter of the right
shape and, fed the states it would capture in its order, gives the logits of the drafter fed as
in training; the last tests show the faults of earlier exports being caught.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.engine_rules import (
    TargetFacts,
    check_folder,
    read_config,
    read_folder,
    sglang_fed_ids,
    vllm_fed_ids,
    vllm_short_form_ok,
)
from specdec.models.drafter import DrafterConfig, Eagle3Drafter
from specdec.models.formats import load_drafter, parse_config, save_drafter

VOCAB, DRAFT_VOCAB, H, TH = 300, 96, 32, 48  # target hidden differs from the drafter's on purpose
DEPTH = {"llama": 32, "qwen2": 24, "qwen3": 36, "mistral": 32, "deepseek_v3": 61}
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def make_drafter(model_type, ids, *, draft_vocab=DRAFT_VOCAB, flags=(), seed=0, hidden=H):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=VOCAB, draft_vocab_size=draft_vocab, target_hidden_size=TH,
                        aux_layer_ids=list(ids), target_model_type=model_type,
                        target_num_layers=DEPTH[model_type], **{f: True for f in flags})
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)  # random norms: a swapped one shows
    if draft_vocab < VOCAB:
        d.set_vocab_mapping(torch.randperm(VOCAB)[:draft_vocab])
    return d.eval()


def facts(model_type):
    return TargetFacts(model_type=model_type, num_layers=DEPTH[model_type], hidden_size=TH, vocab_size=VOCAB)


def exported(tmp_path, drafter, fmt="eagle3", embeddings=True):
    return save_drafter(drafter, tmp_path / "out", fmt, target_name="org/target", dtype=torch.float32,
                        include_embeddings=embeddings)


# ---------------------------------------------------------------------------------------------
# Single rules, pinned to the engines' code


def test_vllm_reads_top_level_ids_sorted_once_else_guesses():
    # eagle3_utils.py 103-140 + interfaces.py 1630: tuple(sorted(set(layers))).
    assert vllm_fed_ids({"eagle_aux_hidden_state_layer_ids": [9, 2, 6, 6]}, 32)[0] == [2, 6, 9]
    # eagle_config's ids are not read for capture; without top-level ids: (2, L//2, L-3).
    ids, where, _ = vllm_fed_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}, 61)
    assert ids == [2, 30, 58] and "guessed" in where
    assert vllm_fed_ids({"eagle_config": {"layer_ids": [3, 4, 5]}}, 61)[0] == [3, 4, 5]
    # id L is the last layer's output (llama.py 437-441; deepseek_v2.py 1583-1584); past it nothing.
    assert vllm_fed_ids({"eagle_aux_hidden_state_layer_ids": [2, 16, 32]}, 32)[0] == [2, 16, 32]
    assert vllm_fed_ids({"eagle_aux_hidden_state_layer_ids": [2, 16, 33]}, 32)[2] == [33]


def test_sglang_reads_eagle_config_per_architecture_inputs_only():
    conf = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 6, 9]}}
    assert sglang_fed_ids(conf, "llama", 32)[0] == [4, 7, 10]  # llama.py 941: val + 1
    assert sglang_fed_ids(conf, "deepseek_v3", 61)[0] == [3, 6, 9]  # deepseek_v2.py 3472-3473
    kimi = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
    assert sglang_fed_ids(kimi, "deepseek_v3", 61)[0] == [2, 30, 58]
    # No eagle_config ids: [2, L//2, L-3] as capture indices (llama.py 933-936).
    assert sglang_fed_ids({}, "qwen3", 36)[0] == [2, 18, 33]
    # Layer i captures its input for i in range(start, end): L is never captured (llama.py 485-494).
    ids, _, lost = sglang_fed_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 31]}}, "llama", 32)
    assert ids == [2, 16] and lost == [32]
    assert sglang_fed_ids(conf, "gpt_oss", 24)[0] is None  # a rule not read: no guess


def test_speculators_reader_defaults_norm_before_residual_to_true():
    # vLLM transformers_utils/configs/speculators/algos.py 33-35; specdec reads it the same way.
    raw = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "draft_vocab_size": 96,
           "transformer_layer_config": {"hidden_size": H, "intermediate_size": 64, "num_attention_heads": 4,
                                        "vocab_size": VOCAB}, "eagle_aux_hidden_state_layer_ids": [2, 16, 29]}
    assert parse_config(raw).norm_before_residual is True
    assert read_config("vllm", raw, {}, facts("llama")).flags["norm_before_residual"] is True
    assert parse_config({**raw, "norm_before_residual": False}).norm_before_residual is False


def test_vllm_short_form_needs_a_hub_verifier(tmp_path):
    # transformers_utils/config.py 904-918: validate_repo_id, and not an existing path.
    assert vllm_short_form_ok("meta-llama/Llama-3.1-8B-Instruct")
    assert not vllm_short_form_ok(str(tmp_path))
    assert not vllm_short_form_ok("/models/llama 8b")
    assert not vllm_short_form_ok(None)


# ---------------------------------------------------------------------------------------------
# The matrix: every architecture, both formats, ids, vocab, flags, embeddings


def _ids(kind, L):
    return {"default": [2, L // 2, L - 3], "shifted": [3, L // 2 + 1, L - 2], "unsorted": [L - 3, 2, L // 2],
            "last": [1, L // 2, L]}[kind]


CASES = [(arch, fmt, kind) for arch in DEPTH for fmt in ("eagle3", "speculators")
         for kind in ("default", "shifted", "unsorted", "last")]


@pytest.mark.parametrize("arch,fmt,kind", CASES)
def test_engines_run_exports_as_trained(arch, fmt, kind, tmp_path):
    i = CASES.index((arch, fmt, kind))
    L = DEPTH[arch]
    flags = [(), ("norm_before_residual",), ("norm_before_fc",), ("fc_norm",), ("norm_output",)][i % 5]
    draft_vocab = VOCAB if i % 3 == 0 else DRAFT_VOCAB
    embeddings = i % 2 == 0
    drafter = make_drafter(arch, _ids(kind, L), draft_vocab=draft_vocab, flags=flags, seed=i)
    if draft_vocab == VOCAB and i % 2:
        drafter.set_vocab_mapping(torch.arange(VOCAB))  # identity at full vocab ...
        drafter.d2t.copy_(torch.roll(torch.arange(VOCAB), 7) - torch.arange(VOCAB))  # ... or a permutation
    out = exported(tmp_path, drafter, fmt, embeddings)
    names = set(load_file(str(out / "model.safetensors")))
    assert ("d2t" in names) == (draft_vocab != VOCAB)  # vLLM raises on d2t at full vocab
    readings = check_folder(out, drafter, facts(arch), drafter.embed_tokens.weight.detach())
    trained = sorted(_ids(kind, L))

    vllm = readings["vllm"]
    assert vllm.ok, vllm.problems
    assert vllm.fed_ids == trained
    assert vllm.max_abs_logit_diff <= 1e-5
    expected = {"fc.weight", "norm.weight", "lm_head.weight"} | {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    assert expected <= set(vllm.params)
    assert ("embed_tokens.weight" in vllm.params) == embeddings

    sglang = readings["sglang"]
    sglang_runs = fmt == "eagle3" and kind != "last" and "norm_before_residual" not in flags
    assert sglang.ok == sglang_runs, sglang.problems
    if sglang_runs:
        assert sglang.fed_ids == trained and sglang.max_abs_logit_diff <= 1e-5
        assert sglang.embedding == "target"
    elif fmt == "speculators":
        assert not sglang.loads and "Eagle3Speculator" in sglang.problems[0]
    elif kind == "last":
        assert any("never fed" in p for p in sglang.problems), sglang.problems
    else:
        assert any("norm_before_residual" in p and "never reads" in p for p in sglang.problems)
    # specdec reads the export back to the same drafter.
    back = load_drafter(out, None if embeddings else _Shape(drafter))
    assert back.cfg.aux_layer_ids == trained


class _Shape:
    """A target as load_drafter sees it, sharing the drafter's embedding."""

    def __init__(self, drafter):
        self.name, self.num_layers = "t", max(drafter.cfg.aux_layer_ids)
        self.hidden_size, self.vocab_size = TH, VOCAB
        self.device = torch.device("cpu")
        self._e = drafter.embed_tokens

    def embed_tokens(self):
        return self._e


@pytest.mark.parametrize("arch", list(DEPTH))
def test_sglang_ids_written_per_architecture(arch, tmp_path):
    L = DEPTH[arch]
    out = exported(tmp_path, make_drafter(arch, [3, L // 2, L - 3]))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [3, L // 2, L - 3]
    written = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert written == ([3, L // 2, L - 3] if arch == "deepseek_v3" else [2, L // 2 - 1, L - 4])
    assert cfg["specdec"]["target_model_type"] == arch


def test_unsorted_ids_export_reorders_fc_exactly(tmp_path):
    drafter = make_drafter("llama", [29, 2, 16])
    out = exported(tmp_path, drafter)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    fc = load_file(str(out / "model.safetensors"))["fc.weight"]
    w = drafter.fc.weight.detach()
    assert torch.equal(fc, torch.cat([w[:, TH:2 * TH], w[:, 2 * TH:], w[:, :TH]], 1))


def test_duplicate_ids_are_refused(tmp_path):
    from specdec.errors import IncompatibleDrafter

    with pytest.raises(IncompatibleDrafter, match="repeat a layer"):
        exported(tmp_path, make_drafter("llama", [2, 2, 29]))


# ---------------------------------------------------------------------------------------------
# Faults of earlier exports, caught


def _rewrite(folder, config_update=None, config_drop=(), tensors_update=None):
    cfg = json.loads((folder / "config.json").read_text())
    for k in config_drop:
        cfg.pop(k, None)
    for k, v in (config_update or {}).items():
        cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))
    if tensors_update is not None:
        t = load_file(str(folder / "model.safetensors"))
        t.update(tensors_update)
        save_file(t, str(folder / "model.safetensors"))


def test_caught_d2t_at_full_vocab(tmp_path):
    drafter = make_drafter("llama", [2, 16, 29], draft_vocab=VOCAB)
    out = exported(tmp_path, drafter)
    _rewrite(out, tensors_update={"d2t": torch.zeros(VOCAB, dtype=torch.long)})
    r = check_folder(out, drafter, facts("llama"), drafter.embed_tokens.weight.detach())
    assert not r["vllm"].loads and "draft_id_to_target_id" in r["vllm"].problems[0]
    assert r["sglang"].ok  # SGLang turns it into hot_token_id = arange


def test_caught_llama_ids_written_with_the_deepseek_rule(tmp_path):
    drafter = make_drafter("llama", [3, 6, 9])
    out = exported(tmp_path, drafter)
    _rewrite(out, config_update={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 6, 9]}})
    r = check_folder(out, drafter, facts("llama"), drafter.embed_tokens.weight.detach())
    assert r["vllm"].ok
    assert r["sglang"].fed_ids == [4, 7, 10] and not r["sglang"].ok
    assert r["sglang"].max_abs_logit_diff > 1e-2  # fed other states, the logits move


def test_caught_speculators_without_norm_flag(tmp_path):
    drafter = make_drafter("llama", [2, 16, 29])
    out = exported(tmp_path, drafter, "speculators")
    _rewrite(out, config_drop=("norm_before_residual",))
    r = check_folder(out, drafter, facts("llama"), drafter.embed_tokens.weight.detach())
    assert not r["vllm"].ok and "norm_before_residual=True" in r["vllm"].problems[0]


def test_caught_missing_top_level_ids_and_lost_d2t(tmp_path):
    drafter = make_drafter("deepseek_v3", [3, 31, 59])
    out = exported(tmp_path, drafter)
    t = load_file(str(out / "model.safetensors"))
    del t["d2t"]
    save_file(t, str(out / "model.safetensors"))
    _rewrite(out, config_drop=("eagle_aux_hidden_state_layer_ids",))
    r = check_folder(out, drafter, facts("deepseek_v3"), drafter.embed_tokens.weight.detach())
    assert r["vllm"].fed_ids == [2, 30, 58] and "guessed" in r["vllm"].ids_from
    assert any("no d2t" in p for p in r["vllm"].problems) and any("no d2t" in p for p in r["sglang"].problems)


def test_caught_unknown_tensor_vllm_raises_sglang_skips(tmp_path):
    drafter = make_drafter("qwen3", [2, 18, 33])
    out = exported(tmp_path, drafter)
    _rewrite(out, tensors_update={"verifier_lm_head.weight": torch.zeros(4, H)})
    r = read_folder(out, facts("qwen3"))
    assert not r["vllm"].loads and "verifier_lm_head.weight" in r["vllm"].problems[0]
    assert r["sglang"].ok and any("skipped" in n for n in r["sglang"].notes)


# ---------------------------------------------------------------------------------------------
# Imports at the shapes of public drafters (depth and layout kept, widths scaled down)


def target_folder(path, model_type, layers, *, tied=False):
    """A target as `convert --target` reads it: config.json and the embedding (and head) only."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, num_hidden_layers=layers, hidden_size=TH, vocab_size=VOCAB,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         tie_word_embeddings=tied).save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    tensors = {"model.embed_tokens.weight": torch.randn(VOCAB, TH, generator=g)}
    if not tied:
        tensors["lm_head.weight"] = torch.randn(VOCAB, TH, generator=g)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def foreign_drafter(path, model_type, layers, *, eagle_config_ids=None, top_level_ids=None, fmt="eagle3",
                    config_update=None):
    """A drafter as SpecForge (ids only in eagle_config, no embedding) or speculators wrote it."""
    d = make_drafter(model_type, [2, layers // 2, layers - 3], seed=3, hidden=TH)  # embedding shared with the target
    save_drafter(d, path, fmt, dtype=torch.float32, include_embeddings=False)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("specdec")
    raw.pop("eagle_aux_hidden_state_layer_ids")
    raw.pop("eagle_config", None)
    if eagle_config_ids is not None:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": eagle_config_ids, "use_aux_hidden_state": True}
    if top_level_ids is not None:
        raw["eagle_aux_hidden_state_layer_ids"] = top_level_ids
    raw.update(config_update or {})
    (path / "config.json").write_text(json.dumps(raw))
    return path, d


def convert(argv, capsys):
    from specdec.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_import_kimi_k25_specforge_layout(tmp_path, capsys):
    # 61 MLA/MoE layers, ids only in eagle_config [2, 30, 58]: both engines feed hidden_states[2, 30, 58]
    # (vLLM's guess (2, L//2, L-3); SGLang's deepseek rule keeps ids whose first is not 1).
    src, _ = foreign_drafter(tmp_path / "kimi", "deepseek_v3", 61, eagle_config_ids=[2, 30, 58])
    rc, _, err = convert(["convert", src, tmp_path / "o0"], capsys)
    assert rc == 2 and "pass --target" in err and "[3, 31, 59]" in err and "[2, 30, 58]" in err
    target = target_folder(tmp_path / "kimi-target", "deepseek_v3", 61)
    for how in (["--target", target], ["--target-type", "deepseek_v3", "--target", target]):
        out = tmp_path / f"o{len(how)}"
        rc, stdout, err = convert(["convert", src, out, *how, "--for", "both", "--json"], capsys)
        assert rc == 0, err
        info = json.loads(stdout)
        assert info["aux_layer_ids"]["canonical"] == [2, 30, 58]
        assert "SGLang's rule for deepseek_v3" in info["aux_layer_ids_how"]
        assert any("no top-level" in n and "[2, 30, 58] for this 61-layer target, by luck" in n for n in info["notes"])
        for engine in ("vllm", "sglang"):
            assert info["engines"][engine]["ok"] and info["engines"][engine]["fed_ids"] == [2, 30, 58]
        written = json.loads((out / "config.json").read_text())
        assert written["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
        assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]


def test_import_deepseek_v3_layer_outputs_and_speculators(tmp_path, capsys):
    target = target_folder(tmp_path / "dsv3", "deepseek_v3", 61)
    src, _ = foreign_drafter(tmp_path / "sf", "deepseek_v3", 61, eagle_config_ids=[1, 29, 57])
    rc, stdout, err = convert(["convert", src, tmp_path / "a", "--target", target, "--json"], capsys)
    assert rc == 0, err
    assert json.loads(stdout)["aux_layer_ids"]["canonical"] == [2, 30, 58]
    src, _ = foreign_drafter(tmp_path / "sp", "deepseek_v3", 61, top_level_ids=[2, 30, 58], fmt="speculators")
    rc, stdout, err = convert(["convert", src, tmp_path / "b", "--target", target, "--for", "both", "--json"],
                              capsys)
    assert rc == 0, err
    info = json.loads(stdout)
    assert info["source_format"] == "speculators" and info["aux_layer_ids"]["canonical"] == [2, 30, 58]


def test_import_qwen3_4b_tied_target(tmp_path, capsys):
    # Qwen3-4B: 36 layers, tied embeddings (no lm_head.weight); the drafter config copied the target's
    # tie_word_embeddings, which would make SGLang use the embedding as lm_head (llama_eagle3.py 303-304).
    target = target_folder(tmp_path / "q3", "qwen3", 36, tied=True)
    src, _ = foreign_drafter(tmp_path / "sf", "qwen3", 36, eagle_config_ids=[1, 17, 32],
                             config_update={"tie_word_embeddings": True})
    out = tmp_path / "o"
    rc, stdout, err = convert(["convert", src, out, "--target", target, "--for", "sglang", "--json"], capsys)
    assert rc == 0, err
    info = json.loads(stdout)
    assert info["aux_layer_ids"]["canonical"] == [2, 18, 33]
    written = json.loads((out / "config.json").read_text())
    assert written["tie_word_embeddings"] is False
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 17, 32]
    assert info["engines"]["sglang"]["fed_ids"] == [2, 18, 33]
    # The source folder itself, served as it is, is caught.
    r = read_folder(src, TargetFacts(model_type="qwen3", num_layers=36, hidden_size=TH, vocab_size=VOCAB))
    assert any("tie_word_embeddings" in p for p in r["sglang"].problems)
