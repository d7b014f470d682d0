"""Tiny random targets of every supported architecture, with a byte-level tokenizer and a chat
template, saved as ordinary Hugging Face folders. Tests use them everywhere; users can too:
`specdec generate --target tiny-llama --prompt hi` runs in a second on any CPU.
"""

from __future__ import annotations

from pathlib import Path

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "deepseek_v3")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer():
    """A 259-token byte-level tokenizer (256 bytes + 3 specials) built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int = 259, num_layers: int = 4):
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=258,
        pad_token_id=256,
        bos_token_id=None,
    )
    if vocab_size < 259:  # not the byte tokenizer: no special ids
        common.update(eos_token_id=None, pad_token_id=None)
    if arch == "deepseek_v3":
        common.update(
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            rope_scaling=None,
        )
    if arch == "qwen3":
        common.update(head_dim=16)
    return AutoConfig.for_model(arch, **common)


def make_tiny_target(arch: str, out_dir: str | Path, seed: int = 0, num_layers: int = 4) -> Path:
    """Build a random `arch` model with the byte tokenizer and save it as an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHS}")
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, num_layers=num_layers))
    model.generation_config.eos_token_id = 258
    # A test model is built on first use inside other commands; transformers' "Writing model
    # shards" bar would land in their stderr (one-line errors, --json output).
    hf_logging.disable_progress_bar()
    model.save_pretrained(out_dir)
    byte_tokenizer().save_pretrained(out_dir)
    return out_dir
