"""The EAGLE-3 drafter: fc over three target states, one decoder layer that reads
[embedding, hidden] (2H), a final norm and an lm_head over a reduced draft vocabulary.

Normalisation switches (names as in vLLM/speculators), all read at run time:
  norm_before_residual  residual = hidden_norm(fc output) instead of the raw fc output
  norm_before_fc        one RMSNorm over the concatenated 3 target states before fc (gpt-oss style)
  fc_norm               one RMSNorm per target state before concatenation
  norm_output           recycle the post-norm state as the next step's hidden (EAGLE 3.1)

The building blocks (RMSNorm, MLP, rotary embedding) are Hugging Face's Llama ones, so the math is
the same that vLLM and SGLang run for `LlamaForCausalLMEagle3`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from .drafter_layer import DrafterLayerOps, drafter_layer


# SDPA's backends but cuDNN's, which plans each new shape on the host: for calls whose shapes keep
# changing (drafting, a padded batch's forward) that planning, not the kernel, sets the pace.
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # canonical (HF hidden_states index), see specdec.conventions
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # The target's model_type and depth: which SGLang id rule applies (specdec.conventions), and
    # what `export` checks the engines against when no target is given.
    target_model_type: str | None = None
    target_num_layers: int | None = None
    # What `train` knew of the run (target and tokenizer fingerprints, the capture, weight norms,
    # held-out acceptance): `doctor` checks the target and weights served now against it.
    provenance: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # unknown config keys, kept for round trips

    @classmethod
    def for_target(cls, target_config, *, draft_vocab_size: int, aux_layer_ids: list[int], **overrides):
        """A drafter sized like the target's decoder layers (the EAGLE-3 default)."""
        heads = target_config.num_attention_heads
        head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // heads
        rope = getattr(target_config, "rope_parameters", None) or {}
        kw = dict(
            hidden_size=target_config.hidden_size,
            intermediate_size=getattr(target_config, "intermediate_size", 4 * target_config.hidden_size),
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", heads) or heads,
            head_dim=head_dim,
            vocab_size=target_config.vocab_size,
            draft_vocab_size=min(draft_vocab_size, target_config.vocab_size),
            target_hidden_size=target_config.hidden_size,
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
            max_position_embeddings=getattr(target_config, "max_position_embeddings", 4096),
            target_model_type=getattr(target_config, "model_type", None),
            target_num_layers=getattr(target_config, "num_hidden_layers", None),
        )
        if getattr(target_config, "model_type", "") == "deepseek_v3":
            # MLA heads do not transfer; give the drafter a plain GQA layer of the same width.
            kw.update(head_dim=64 if target_config.hidden_size % 64 == 0 else 16,
                      num_key_value_heads=max(1, heads // 4) if heads % 4 == 0 else heads)
            kw["num_attention_heads"] = target_config.hidden_size // kw["head_dim"]
            if kw["num_attention_heads"] % kw["num_key_value_heads"]:
                kw["num_key_value_heads"] = kw["num_attention_heads"]
        kw.update(overrides)
        return cls(**kw)

    def llama_config(self) -> LlamaConfig:
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            num_hidden_layers=1,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class DraftKVCache:
    """A preallocated KV cache for the single drafter layer; rollback is a pointer move."""

    def __init__(self, batch: int, heads: int, head_dim: int, max_len: int, device, dtype):
        self.k = torch.zeros(batch, heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[2]
        end = self.length + n
        if end > self.k.shape[2]:
            grow = max(end, 2 * self.k.shape[2])
            self.k = torch.cat(
                [self.k, self.k.new_zeros(*self.k.shape[:2], grow - self.k.shape[2], self.k.shape[3])], 2)
            self.v = torch.cat(
                [self.v, self.v.new_zeros(*self.v.shape[:2], grow - self.v.shape[2], self.v.shape[3])], 2)
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, nh, kvh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, kvh * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, kvh * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def project(self, x, cos, sin):
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, hd).transpose(1, 2)  # shape: [B, nh, T, hd]
        k = self.k_proj(x).view(b, t, -1, hd).transpose(1, 2)  # shape: [B, kvh, T, hd]
        v = self.v_proj(x).view(b, t, -1, hd).transpose(1, 2)  # shape: [B, kvh, T, hd]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v



def small_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Drafting attention: q [B, nh, T, hd] (a few rows) against the cache k, v [B, kvh, S, hd];
    mask bool [T, S], True = may attend.

    cuDNN attention is excluded: it builds an execution plan for every new key length, and while
    drafting each call has a new one, which makes a drafting round many times slower
    (benchmarks/drafter_step.py)."""
    with sdpa_kernel(NO_CUDNN):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Eagle3Layer(nn.Module):
    """The "midlayer": reads [input_layernorm(embedding), hidden_norm(hidden)]. Its math is
    `drafter_layer`'s (drafter_layer.py), run by `Eagle3Drafter.layer` on these modules."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        lc = cfg.llama_config()
        self.cfg = cfg
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = LlamaMLP(lc)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def gate_up(self, h):
        """(gate, up) of post_attention_layernorm(h), as LlamaMLP computes them."""
        x = self.post_attention_layernorm(h)
        return self.mlp.gate_proj(x), self.mlp.up_proj(x)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        n_aux = len(cfg.aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.input_norm = (
            LlamaRMSNorm(n_aux * cfg.target_hidden_size, eps=cfg.rms_norm_eps) if cfg.norm_before_fc else None
        )
        self.fc_norm = (
            nn.ModuleList(LlamaRMSNorm(cfg.target_hidden_size, eps=cfg.rms_norm_eps) for _ in range(n_aux))
            if cfg.fc_norm
            else None
        )
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg.llama_config())
        # target_id = i + d2t[i]; identity until a vocab mapping is built or loaded.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # -- vocabulary ------------------------------------------------------------------------
    def set_vocab_mapping(self, draft_to_target_ids: torch.Tensor) -> None:
        """Install the mapping from an ascending list of the target ids the draft vocab keeps."""
        ids = torch.as_tensor(draft_to_target_ids, dtype=torch.long).sort().values
        assert ids.numel() == self.cfg.draft_vocab_size
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def weight_norms(self) -> dict[str, float]:
        """L2 norm of each trained tensor: a scale error after training shows against them."""
        return {n: round(float(p.detach().float().norm()), 6) for n, p in self.named_parameters()
                if n != "embed_tokens.weight"}

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    # -- forward pieces ----------------------------------------------------------------------
    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, T, 3 * target_H] target states -> [B, T, H] drafter hidden."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(aux)

    def head(self, h: torch.Tensor, logits_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer output [B, T, H] -> (recycled hidden for the next step, draft-vocab logits of
        positions logits_from.. only: the lm_head is most of the cost where few rows are read)."""
        normed = self.norm(h)
        return (normed if self.cfg.norm_output else h), self.lm_head(normed[:, logits_from:])

    def forward(
        self,
        input_ids: torch.Tensor,  # shape: [B, T] token following each hidden state
        hidden: torch.Tensor,  # shape: [B, T, 3*tH] target states, or [B, T, H] recycled
        position_ids: torch.Tensor,  # shape: [B, T]
        cache: DraftKVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference: the layer over a KV cache (`mask` bool [T, cached + T], True = may attend;
        None = causal), then the head."""
        T = input_ids.shape[1]

        def attend(q, k, v):
            past = cache.length if cache is not None else 0
            if cache is not None:
                k, v = cache.append(k, v)
            m = mask if mask is not None else torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(past)
            return small_query_attention(q, k, v, m)

        return self.head(self.layer(input_ids, hidden, position_ids, attend))

    def layer(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, attend) -> torch.Tensor:
        """The drafter's one layer on its modules (`drafter_layer`, the recipe the kernels run too):
        [input_layernorm(embedding), hidden_norm(hidden)] -> attention -> MLP; returns the layer's
        output before the final norm [B, T, H]. Its callers differ only in `attend(q, k, v)` (q
        [B, nh, T, hd], k and v [B, kvh, T, hd] of these rows, roped; returns [B, nh, T, hd]):
        inference over a KV cache (`forward`), a static drafter's cache slots (`eagle_graph.py`),
        training-time test's unrolled attention (`train/ttt.py`).
        `hidden`: target states [B, T, 3*tH] (projected by fc) or a recycled hidden [B, T, H]."""
        if hidden.shape[-1] != self.cfg.hidden_size:  # target states, not a recycled hidden
            hidden = self.project_aux(hidden)
        m, attn = self.midlayer, self.midlayer.self_attn
        B, T = input_ids.shape
        ops = DrafterLayerOps(
            embed=self.embed_tokens,
            input_layernorm=m.input_layernorm,
            hidden_norm=m.hidden_norm,
            # q and k roped here: HF's rotary embedding casts its tables to the dtype of x, the
            # attention input (fp32 under autocast, where q and k are bf16)
            qkv_proj=lambda x: attn.project(x, *self.rotary_emb(x, position_ids)),
            o_proj_add=lambda residual, o: residual + attn.o_proj(o),
            gate_up=m.gate_up,
            down_add=lambda residual, act: residual + m.mlp.down_proj(act),
            act=m.mlp.act_fn,
        )

        def attention(qkv):  # shape: [B, nh, T, hd] -> [B, T, nh * hd]
            return attend(*qkv).transpose(1, 2).reshape(B, T, -1)

        return drafter_layer(input_ids, hidden, ops, attention, norm_before_residual=self.cfg.norm_before_residual)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> DraftKVCache:
        p = self.lm_head.weight
        return DraftKVCache(batch, self.cfg.num_key_value_heads, self.cfg.head_dim, max_len,
                            device or p.device, dtype or p.dtype)


def ttt_attention(q, k0, v0, step_k: torch.Tensor | None = None, step_v: torch.Tensor | None = None,
                  live: torch.Tensor | None = None):
    """Training-time-test attention without materialising a [T, kT] matrix.

    Query t of step s sees the step-0 keys <= t (causal) plus, for each later step j <= s, the
    key that step j computed at the same position t: exactly what inference sees when the
    drafter extends its own draft. Those later keys come stacked, `step_k` / `step_v`
    [B, kvh, T, S, hd], with `live` bool [S] saying which of the S slots hold a step's key yet:
    a fixed number of slots keeps every step's shapes the same (train/ttt.py compiles one step
    and runs it for all), and a slot not yet live gets no weight. Grouped query heads are
    broadcast, never copied. The step keys and values enter as one small product per position
    ([rep, hd] x [hd, S]): a broadcast product and sum over [B, kvh, rep, T, S, hd] would move
    more bytes through more kernels, and the step is bound by its small kernels.
    """
    b, nh, t, hd = q.shape
    kvh = k0.shape[1]
    rep = nh // kvh
    qg = q.view(b, kvh, rep, t, hd) * (1.0 / math.sqrt(hd))  # shape: [B, kvh, rep, T, hd], scaled once
    scores = qg @ k0.unsqueeze(2).transpose(-1, -2)  # shape: [B, kvh, rep, T, T]
    causal = torch.full((t, t), float("-inf"), device=q.device, dtype=scores.dtype).triu(1)
    scores = scores + causal
    if step_k is None:
        return (torch.softmax(scores, -1) @ v0.unsqueeze(2)).reshape(b, nh, t, hd)
    diag = (qg.transpose(2, 3) @ step_k.transpose(-1, -2)).transpose(2, 3)  # shape: [B, kvh, rep, T, S]
    diag = diag.masked_fill(~live, float("-inf"))
    probs = torch.softmax(torch.cat([scores, diag], -1), -1)
    out = probs[..., :t] @ v0.unsqueeze(2)  # shape: [B, kvh, rep, T, hd]
    out = out + (probs[..., t:].transpose(2, 3) @ step_v).transpose(2, 3)
    return out.reshape(b, nh, t, hd)
