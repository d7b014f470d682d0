"""`specdec serve --drafter` with a tree: an EAGLE-3 drafter (random weights, exported in the eagle3
format) loaded by the server process; output stays lossless and /metrics reports tree depth."""

import openai
import pytest
import torch

from specdec.server.launch import ServerProcess

MODEL = "tiny-eagle"


@pytest.fixture(scope="module")
def drafter_dir(tiny_targets, tmp_path_factory):
    from specdec.models.drafter import DrafterConfig, Eagle3Drafter
    from specdec.models.formats import save_drafter

    target = tiny_targets["llama"]
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.config, draft_vocab_size=200, aux_layer_ids=target.aux_layer_ids)
    drafter = Eagle3Drafter(cfg)
    drafter.embed_tokens.weight.data.copy_(target.embed_tokens().weight)
    drafter.set_vocab_mapping(torch.randperm(target.vocab_size)[:200])
    return save_drafter(drafter.eval(), tmp_path_factory.mktemp("drafter"), "eagle3", target_name="tiny-llama")


@pytest.fixture(scope="module")
def server(tiny_dirs, drafter_dir):
    args = ["--target", str(tiny_dirs["llama"]), "--drafter", str(drafter_dir), "--tree-depth", "3",
            "--tree-top-k", "2", "--tree-tokens", "6", "--served-model-name", MODEL]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc


def test_tree_drafter_server_is_lossless_and_counts_drafts(server, tiny_targets):
    import httpx

    from specdec.engine.api import SamplingParams
    from specdec.engine.engine import SpeculativeEngine

    assert "eagle3-tree, k=3" in server.output
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = "abc abc abc abc"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    target = tiny_targets["llama"]
    ids = target.tokenizer(prompt)["input_ids"]
    plain = SpeculativeEngine(target).generate(ids, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    assert r.choices[0].text == target.tokenizer.decode(plain.token_ids, skip_special_tokens=True)

    text = httpx.get(server.url + "/metrics").text
    assert 'specdec:build_info{k="3",mode="eagle3-tree"' in text
    drafted = next(line for line in text.splitlines()
                   if line.startswith("vllm:spec_decode_num_draft_tokens_total{"))
    assert float(drafted.rsplit(" ", 1)[1]) > 0
    for pos in range(3):
        assert f'position="{pos}"' in text
