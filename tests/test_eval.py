"""specdec eval / specdec.evaluate: the JSON `specdec report` reads, and numbers that agree with
the engine's own GenerationResult counters."""

import json

import pytest
import torch

from specdec.cli import main
from specdec.data.chat import prompt_ids
from specdec.engine.api import SamplingParams
from specdec.engine.engine import SpeculativeEngine
from specdec.evaluate import evaluate, first_turn, summarize

PROMPTS = [
    {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "abc abc abc abc"},
                             {"role": "assistant", "content": "ignored"}, {"role": "user", "content": "later turn"}]},
    {"id": "b", "prompt": "hello hello hello"},
    {"id": "c", "conversations": [{"from": "human", "value": "the cat sat on the mat, the cat"}]},
]
KEYS = ("per_position_acceptance", "mean_acceptance_length", "acceptance_rate", "num_drafts", "k", "tokens_per_s")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return p


def run_cli(argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_first_turn_keeps_system_and_first_user():
    msgs = PROMPTS[0]["messages"]
    assert first_turn(msgs) == msgs[:2]


def test_eval_ngram_json_matches_engine(prompts_file, tiny_dirs, tiny_targets, capsys):
    rc, out, err = run_cli(["eval", "--target", tiny_dirs["llama"], "--ngram", "2", "--k", "3", "--prompts",
                            prompts_file, "--max-new-tokens", "16", "--device", "cpu", "--json"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    for key in KEYS:
        assert key in result, key
    assert result["k"] == 3 and result["num_prompts"] == 3 and result["skipped_prompts"] == 0
    assert len(result["per_position_acceptance"]) == 3
    assert result["versions"]["torch"] == torch.__version__ and result["device"] == "cpu"
    assert result["engine"] == "reference"  # a tiny fp32 target on a CPU

    # The same prompts through the engine directly: the summed counters must agree exactly.
    target = tiny_targets["llama"]
    engine = SpeculativeEngine(target, ngram=2, k=3)
    from specdec.data.datasets import load_conversations

    convs = load_conversations(str(prompts_file))
    results = [engine.generate(prompt_ids(target.tokenizer, first_turn(c.messages)), SamplingParams(max_new_tokens=16))
               for c in convs]
    drafts = sum(r.num_drafts for r in results)
    per_pos = [sum(r.accepted_per_position[i] if i < len(r.accepted_per_position) else 0 for r in results)
               for i in range(3)]
    assert result["num_drafts"] == drafts > 0
    assert result["accepted_per_position"] == per_pos
    assert result["per_position_acceptance"] == pytest.approx([n / drafts for n in per_pos])
    accepted = sum(r.accepted for r in results)
    assert result["num_accepted_tokens"] == accepted
    assert result["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert result["acceptance_rate"] == pytest.approx(accepted / sum(r.drafted for r in results))
    assert result["new_tokens"] == sum(r.new_tokens for r in results)
    # per-position acceptance is P(at least i+1 accepted): non-increasing
    pp = result["per_position_acceptance"]
    assert all(a >= b for a, b in zip(pp, pp[1:]))

    from specdec.diagnose.report import acceptance_blocks, curve_of

    blocks = acceptance_blocks(result)
    assert len(blocks) == 1  # per_prompt rows are not mistaken for acceptance summaries
    assert curve_of(blocks[0][1]) == (pp, "measured")


def test_evaluate_with_drafter_compare_plain_is_lossless(prompts_file, tiny_targets, monkeypatch):
    from specdec.data.datasets import load_conversations
    from specdec.models.drafter import DrafterConfig, Eagle3Drafter

    target = tiny_targets["llama"]
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.config, draft_vocab_size=64, aux_layer_ids=[2, 3, 4])
    d = Eagle3Drafter(cfg)
    d.embed_tokens.weight.data.copy_(target.embed_tokens().weight.data)
    d.set_vocab_mapping(torch.randperm(target.vocab_size)[:64])
    engine = SpeculativeEngine(target, drafter=d.eval(), k=4)
    calls, generate = [], SpeculativeEngine.generate

    def recorded(self, ids, params):
        calls.append(("spec" if self.proposer is not None else "plain", tuple(ids)))
        return generate(self, ids, params)

    monkeypatch.setattr(SpeculativeEngine, "generate", recorded)
    result = evaluate(engine, target.tokenizer, load_conversations(str(prompts_file)), max_new_tokens=16,
                      compare_plain=True, progress=False)
    # After one warm-up each, every prompt runs speculative then plain, back to back.
    timed = calls[2:]
    assert [kind for kind, _ in timed] == ["spec", "plain"] * result["num_prompts"]
    assert all(a[1] == b[1] for a, b in zip(timed[::2], timed[1::2]))
    target.set_aux_layer_ids(None)  # the session fixture is shared
    assert result["mode"] == "eagle3-chain" and result["k"] == 4
    assert result["plain_output_mismatches"] == 0  # greedy speculative == plain
    assert result["plain_tokens_per_s"] > 0 and result["speedup"] == pytest.approx(
        result["tokens_per_s"] / result["plain_tokens_per_s"])
    assert result["num_drafts"] > 0 and len(result["per_position_acceptance"]) == 4
    # Plain decoding per prompt too (greedy: the same tokens), adding up to its totals.
    rows = result["per_prompt"]
    assert [r["plain_new_tokens"] for r in rows] == [r["new_tokens"] for r in rows]
    assert sum(r["plain_seconds"] for r in rows) == pytest.approx(result["plain_seconds"])


def test_summarize_pads_to_k_and_handles_no_drafts():
    s = summarize([], k=5)
    assert s["per_position_acceptance"] == [0.0] * 5 and s["mean_acceptance_length"] == 1.0
    assert s["acceptance_rate"] == 0.0 and s["tokens_per_s"] == 0.0


def test_eval_skips_prompts_longer_than_context(tmp_path, tiny_dirs, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "x" * 600}) + "\n" + json.dumps({"prompt": "hi hi hi"}) + "\n")
    rc, out, err = run_cli(["eval", "--target", tiny_dirs["llama"], "--ngram", "2", "--prompts", p,
                            "--max-new-tokens", "8", "--device", "cpu", "--json"], capsys)
    assert rc == 0, err
    r = json.loads(out)
    assert r["num_prompts"] == 1 and r["skipped_prompts"] == 1


def test_eval_table_and_refusals(prompts_file, tiny_dirs, capsys):
    rc, out, err = run_cli(["eval", "--target", tiny_dirs["llama"], "--ngram", "2", "--prompts", prompts_file,
                            "--limit", "1", "--max-new-tokens", "8", "--device", "cpu", "--compare-plain",
                            "--no-progress"], capsys)
    assert rc == 0, err
    assert "mean acceptance length" in out and "speedup" in out
    rc, _, err = run_cli(["eval", "--target", tiny_dirs["llama"], "--prompts", prompts_file], capsys)
    assert rc == 2 and "needs a drafter" in err and err.count("\n") == 1
    rc, _, err = run_cli(["eval", "--target", tiny_dirs["llama"], "--ngram", "2", "--prompts", prompts_file,
                          "--max-new-tokens", "0"], capsys)
    assert rc == 2 and "--max-new-tokens" in err


def test_eval_and_serve_build_the_fast_path_where_it_applies(tiny_dirs, monkeypatch):
    """eval and serve build their engine with make_engine (the fast path where it applies, sized by
    serve's --max-model-len), --reference opts out, and generate stays on the reference engine."""
    import specdec.engine.choice as choice
    import specdec.engine.fast as fast_mod
    from specdec.cli import build_parser
    from specdec.commands._engine_args import build_engine

    monkeypatch.setattr(choice, "CPU_FAST_MIN_PARAMS", 0)  # the tiny target counts as large
    monkeypatch.setattr(fast_mod.FastEngine, "warmup", lambda self: 0.0)  # no compile in this test
    parser = build_parser()
    common = ["--target", str(tiny_dirs["llama"]), "--device", "cpu", "--dtype", "bf16", "--ngram", "2"]

    def engine(*argv):
        args = parser.parse_args(list(argv) + common)
        return build_engine(args, max_len=getattr(args, "max_model_len", None))[1]

    e = engine("eval")
    assert type(e) is fast_mod.FastEngine and e.fast.compiled
    assert e.max_len == min(2048, e.target.config.max_position_embeddings)
    assert type(engine("serve", "--max-model-len", "96")) is fast_mod.FastEngine
    assert engine("serve", "--max-model-len", "96").max_len == 96
    assert type(engine("eval", "--reference")) is SpeculativeEngine
    assert type(engine("serve", "--reference")) is SpeculativeEngine
    assert type(engine("generate", "--prompt", "hi")) is SpeculativeEngine
    # --pack-weights reaches the decoder's kernel settings (it packs where the CUDA kernels run);
    # off unless given.
    assert engine("eval", "--pack-weights").fast.kernel_config.pack_weights
    assert not engine("serve", "--max-model-len", "96").fast.kernel_config.pack_weights


def test_eval_per_category_rows_add_up_to_the_whole(tmp_path, tiny_dirs, capsys):
    """Prompts of two categories give two rows (sorted), whose counters sum to the overall ones and
    whose acceptance lengths, weighted by drafts, give the overall mean; the table shows them."""
    p = tmp_path / "p.jsonl"
    recs = [{"id": "w1", "prompt": "abc abc abc abc", "category": "writing"},
            {"id": "m1", "prompt": "1 2 3 1 2 3 1 2 3", "category": "math"},
            {"id": "w2", "prompt": "the cat sat on the mat, the cat", "category": "writing"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    argv = ["eval", "--target", tiny_dirs["llama"], "--ngram", "2", "--k", "3", "--prompts", p,
            "--max-new-tokens", "16", "--device", "cpu"]
    rc, out, err = run_cli(argv + ["--json"], capsys)
    assert rc == 0, err
    r = json.loads(out)
    rows = r["per_category"]
    assert [(row["category"], row["num_prompts"]) for row in rows] == [("math", 1), ("writing", 2)]
    for key in ("num_drafts", "num_accepted_tokens", "num_draft_tokens", "new_tokens"):
        assert sum(row[key] for row in rows) == r[key], key
    assert [sum(col) for col in zip(*(row["accepted_per_position"] for row in rows))] == r["accepted_per_position"]
    assert all(len(row["per_position_acceptance"]) == 3 for row in rows)
    drafts = r["num_drafts"]
    assert drafts > 0 and all(row["num_drafts"] > 0 for row in rows)
    assert sum(row["num_drafts"] * row["mean_acceptance_length"] for row in rows) / drafts == pytest.approx(
        r["mean_acceptance_length"])
    for i, a in enumerate(r["per_position_acceptance"]):
        assert sum(row["num_drafts"] * row["per_position_acceptance"][i] for row in rows) / drafts == pytest.approx(a)
    # the per-prompt rows of each category are that category's prompts
    by_id = {row["id"]: row for row in r["per_prompt"]}
    assert rows[1]["num_drafts"] == by_id["w1"]["num_drafts"] + by_id["w2"]["num_drafts"]

    from specdec.diagnose.report import acceptance_blocks

    assert [n for n, _ in acceptance_blocks(r)] == ["measured", "category math", "category writing"]

    rc, out, err = run_cli(argv + ["--no-progress"], capsys)
    assert rc == 0, err
    assert "by category" in out and "math" in out and "writing" in out
    assert f"{rows[0]['mean_acceptance_length']:.2f}" in out.split("by category", 1)[1]


def test_by_category_is_empty_without_categories_and_keeps_the_uncategorized():
    from types import SimpleNamespace

    from specdec.evaluate import UNCATEGORIZED, by_category

    res = SimpleNamespace(num_drafts=2, drafted=6, accepted=3, accepted_per_position=[2, 1, 0], new_tokens=8,
                          seconds=1.0, num_steps=3)
    plain = SimpleNamespace(meta={})
    assert by_category([plain, [{"role": "user", "content": "x"}]], [res, res], k=3) == []
    rows = by_category([SimpleNamespace(meta={"category": "code"}), plain], [res, res], k=3)
    assert [row["category"] for row in rows] == [UNCATEGORIZED, "code"]
    assert rows[1]["mean_acceptance_length"] == pytest.approx(2.5) and rows[1]["num_prompts"] == 1
