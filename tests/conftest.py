import os
import warnings

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton's interpreter runs the fast path's kernels on CPU tensors
# (tests/test_triton_kernels.py); set before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Local HF folders of tiny random targets, one per supported architecture."""
    from specdec.models.tiny import make_tiny_target

    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_target(a, root / a) for a in ARCHS}


@pytest.fixture(scope="session")
def tiny_targets(tiny_dirs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models.target import Target

    out = {}
    for a, d in tiny_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        out[a] = Target(model, AutoTokenizer.from_pretrained(d), name=f"tiny-{a}")
    return out


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread; two spin-waiting threads crawl on a busy 2-core box."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
