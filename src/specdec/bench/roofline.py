"""The two numbers before any timing: bytes a decode step must move and the measured bandwidth
that moves them; plus careful GPU timing and random-weight models of real shapes (no download).

A batch-1 decode step reads every weight once (the embedding table only one row) and the live
KV cache; nothing else is large. Its floor is those bytes over the device's measured copy
bandwidth (bytes read + bytes written per second), the ceiling METHOD.md asks for.

Examples:
    from specdec.bench.roofline import copy_bandwidth, llama31_8b_config, random_model
    bw = copy_bandwidth()                      # bytes/s, read + write
    model = random_model(llama31_8b_config())  # bf16 on the GPU, built on the meta device
"""

from __future__ import annotations

import datetime as _dt
import platform
import re
import statistics
from typing import Callable

import torch

from ..engine.config import STEPS, KernelConfig


def device_info() -> dict:
    """Where and with what a figure was measured."""
    import transformers

    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": "cpu",
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info


def card_name() -> str:
    """A short name for result files: the GPU's model ("h200", "h100", as benchmarks/gpu.sh names
    them), else "gpu" or "cpu"."""
    if not torch.cuda.is_available():
        return "cpu"
    m = re.search(r"\b([A-Z]\d{2,4})\b", torch.cuda.get_device_name(0))
    return m.group(1).lower() if m else "gpu"


def time_cuda(fn: Callable[[], object], *, iters: int = 50, repeats: int = 5, warmup: int = 3) -> dict:
    """Median over `repeats` of the mean time of `iters` back-to-back calls, by CUDA events
    (host clock without a GPU, so the scripts' CPU smoke runs take the same path)."""
    for _ in range(warmup):
        fn()
    per = []
    if not torch.cuda.is_available():
        import time

        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            per.append((time.perf_counter() - t0) * 1e3 / iters)
        return {"ms": statistics.median(per), "min_ms": min(per), "max_ms": max(per), "iters": iters,
                "repeats": repeats}
    torch.cuda.synchronize()
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / iters)
    return {"ms": statistics.median(per), "min_ms": min(per), "max_ms": max(per), "iters": iters, "repeats": repeats}


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), iters=iters, repeats=5)
    src = dst = None  # free the buffers; rebound, not `del`, since the lambda above captures them (F821)
    return 2 * nbytes / (t["ms"] / 1e3)


# -- shapes ---------------------------------------------------------------------------------------


def llama31_8b_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu",
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=128001,
    )


def smollm2_135m_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        bos_token_id=1, eos_token_id=2,
    )


def drafter_training_shapes(shapes: str):
    """(target config, aux layer ids, draft vocab) of a drafter training benchmark: "smollm2" (the
    GPU quickstart's drafter) or "8b" (a Llama-3.1-8B drafter). The 8B target keeps 4 layers: only
    its width, head and embedding enter the drafter's step."""
    if shapes == "8b":
        cfg = llama31_8b_config()
        cfg.num_hidden_layers = 4
        return cfg, [1, 2, 3], 32000
    if shapes == "smollm2":
        cfg = smollm2_135m_config()
        n = cfg.num_hidden_layers
        return cfg, [2, n // 2, n - 3], 16384
    raise ValueError(f"unknown shapes {shapes!r}: expected smollm2 or 8b")


def random_model(config, *, device: str = "cuda", dtype=torch.bfloat16, seed: int = 0):
    """An HF causal LM with random weights, built on the meta device and materialised directly
    on `device` in `dtype` (an 8B model never exists in fp32 or on the host)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights: around one, so activations keep their scale
                p.normal_(1.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        rot = model.model.rotary_emb  # its non-persistent buffers were left uninitialised
        model.model.rotary_emb = type(rot)(config=model.config).to(device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


# -- bytes ----------------------------------------------------------------------------------------


def weight_bytes(model) -> dict:
    """All parameter bytes, and the bytes a decode step reads (one row of an untied embedding)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    tied = emb.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    read = total if tied else total - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()
    return {"all": total, "read_per_step": read}


def kv_bytes_per_token(config, dtype=torch.bfloat16) -> int:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv * hd * torch.finfo(dtype).bits // 8


def floor_ms(nbytes: float, bandwidth: float) -> float:
    return nbytes / bandwidth * 1e3


# -- HF baselines ---------------------------------------------------------------------------------


@torch.no_grad()
def hf_decode_ms(model, *, prompt_len: int = 128, steps: int = 16, seed: int = 0) -> float:
    """Median ms per token of HF eager greedy decoding (DynamicCache), after two warm-up tokens."""
    import time

    from transformers import DynamicCache

    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=g).to(dev)
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    times = []
    for i in range(steps + 2):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        int(nxt)  # the host needs the token, as generate does
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def decoder_step_ms(dec, T: int, *, slot0: int, iters: int = 50, seed: int = 0) -> dict:
    """Replay time of a FastDecoder's captured step of T tokens (a chain) at cache slot `slot0`."""
    from ..engine.static_decoder import causal_mask

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, dec.shapes.vocab, (T,), generator=g).tolist()
    b = dec.stage(ids, list(range(slot0, slot0 + T)), slot0, causal_mask(T), T)
    if b.graph is not None:
        return time_cuda(b.graph.replay, iters=iters)
    return time_cuda(lambda: dec.run_eager(b), iters=max(1, iters // 10), repeats=3, warmup=1)


def randomize_cache(dec, seed: int = 0) -> None:
    """Random keys and values everywhere (never time attention over zeros)."""
    g = torch.Generator(device=dec.device).manual_seed(seed)
    for t in dec.kv:
        t.normal_(generator=g)


def kernel_step(step: str, kernels: KernelConfig, tags: dict) -> KernelConfig | None:
    """If `step` is a plan step NAME=VALUE that sets a kernel setting (engine.config.STEPS),
    `kernels` with it applied and its tag recorded in `tags` (empty at the shipped value), for
    the variants built after it; None for any other step."""
    changed = kernels.with_step(step)
    if changed is None:
        return None
    name, _, value = step.partition("=")
    field = STEPS[name][0]
    tags[name] = "" if getattr(changed, field) == getattr(KernelConfig(), field) else f"@{name}{value}"
    return changed
