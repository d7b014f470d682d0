"""Batched decoding for regenerate: many prompts at once over a static KV cache, every decode
step one CUDA graph on CUDA; greedy, or sampled (temperature and top-p, for `--prompts self` and
sampled answers).

HF `generate` spends a SmolLM2-sized step on Python and kernel launches whatever the batch, so
regenerating thousands of answers takes minutes where the GPU's work is milliseconds. Here a step
is the same math on a left-padded batch, replayed from a CUDA graph that also advances the step's
state on the device (next token, rope position, cache slot, finished rows), so the host only
replays and, every `check_every` steps, asks whether every row has finished.

Layout: the prompts are left-padded to one length P, so every row writes cache slot P + i at step
i; row b's tokens start at slot pad[b], its rope position is slot - pad[b], and its queries attend
slots pad[b]..current. Keys and values live in one tensor per layer [2, B, kv heads, S, head].

The math is HF's Llama decoder layer (fast.py's weights, layer_math's norm and rope), so in fp32
every row's greedy tokens equal its prompt decoded alone through the HF model
(tests/test_batch_decode.py); in bf16 they agree until two logits tie within rounding, as any two
kernels' do. Sampling draws from the engine's own target distribution (sampling.target_probs) by
the Gumbel-max trick on the default generator, which a CUDA graph replays with fresh noise.

Examples:
    from specdec.engine.batch import BatchDecoder
    dec = BatchDecoder(target.model)
    for new, reason in dec.generate(prompt_id_lists, max_new_tokens=256, eos=target.eos_token_ids):
        ...
    dec.generate(prompt_id_lists, 64, eos, sampling=SamplingParams(temperature=1.0, top_p=0.99))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SpecdecError
from .api import SamplingParams
from .layer_math import rms_norm
from .sampling import gumbel_topk, target_probs
from .static_layers import (Shapes, check_supported, decoder_layer, layer_weights, rope, rope_tables, round_up,
                            split_heads)


@dataclass
class _State:
    """The device tensors a decode step reads and advances (the CUDA graph's inputs)."""

    ids: torch.Tensor  # [B] the token each row feeds next
    slot: torch.Tensor  # [1] the cache slot this step writes
    pos: torch.Tensor  # [B] its rope position per row
    pad: torch.Tensor  # [B] the first slot of each row's tokens
    done: torch.Tensor  # [B] bool: the row has produced an end token
    step: torch.Tensor  # [1] index into `out`
    out: torch.Tensor  # [B, max_new] tokens produced


@dataclass
class _Shape:
    """What a batch shape needs: state, cache, the end tokens the step compares against, and the
    step's CUDA graph once captured (it reads all three by address, so they live as long as it)."""

    key: tuple  # (rows, cache slots, max new tokens, end tokens, filler, temperature, top-p)
    st: _State
    kv: list[torch.Tensor]
    eos: torch.Tensor
    sampling: SamplingParams | None  # None: greedy
    graph: torch.cuda.CUDAGraph | None = None


class BatchDecoder:
    """Greedy or sampled decoding of a batch of prompts over a Llama-family HF model's weights."""

    def __init__(self, model, *, check_every: int = 16, cuda_graphs: bool | None = None):
        cfg = model.config
        check_supported(cfg)
        self.model = model
        self.s = Shapes.from_config(cfg)
        p0 = next(model.parameters())
        self.device, self.dtype = p0.device, p0.dtype
        with torch.no_grad():
            self.layers = layer_weights(model, share=True)
            self.embed = model.get_input_embeddings().weight.data
            self.norm_w = model.model.norm.weight.data
            self.lm_w = model.get_output_embeddings().weight.data
        self.check_every = check_every
        self.use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._rope_len = 0
        self._shape: _Shape | None = None  # the last batch's, reused by the next of the same shape

    def fits(self, length: int) -> bool:
        """Whether sequences of `length` tokens decode exactly here: a sliding-window target's
        window must cover them (this decoder attends to every slot)."""
        try:
            check_supported(self.model.config, length)
        except SpecdecError:
            return False
        return True

    # -- the math -------------------------------------------------------------------------------
    def _rope(self, n: int):
        if n > self._rope_len:
            self._rope_len = round_up(n, 1024)
            self.cos, self.sin = rope_tables(self.model, self._rope_len, self.device, self.dtype)
        return self.cos, self.sin

    def _forward(self, ids, pos, slots, allowed, kv, sampling: SamplingParams | None):
        """Hidden states -> each row's next token after ids [B, T] at rope positions pos [B, T]
        (argmax, or drawn under `sampling`), writing cache slots `slots` [T]; allowed [B, T, S]
        says which slots each query attends."""
        s = self.s
        B, T = ids.shape
        g, hd = s.groups, s.head_dim
        cos_t, sin_t = self._rope(int(kv[0].shape[3]))
        c, sn = cos_t[pos][:, :, None], sin_t[pos][:, :, None]  # shape: [B, T, 1, hd]
        # GQA without repeating the cache: a kv head's g query heads become g * T query rows.
        mask = allowed[:, None].repeat(1, 1, g, 1)  # shape: [B, 1, g T, S]
        x = F.embedding(ids, self.embed)

        def norm_linear(x, ln, w, b):
            return F.linear(rms_norm(x, ln, s.eps), w, b)

        def add_linear(residual, x, w, b):
            return residual + F.linear(x, w, b)

        for w, cache in zip(self.layers, kv):
            def attention(qkv, qn, kn):
                q, k, v = split_heads(qkv, s, qn, kn)  # shapes: [B, T, heads, hd]
                q, k = rope(q, c, sn).transpose(1, 2), rope(k, c, sn).transpose(1, 2)
                cache[0].index_copy_(2, slots, k)
                cache[1].index_copy_(2, slots, v.transpose(1, 2))
                qg = q.reshape(B, s.kv_heads, g * T, hd)  # heads are kv-major: head h reads kv head h // g
                o = F.scaled_dot_product_attention(qg, cache[0], cache[1], attn_mask=mask, scale=hd**-0.5)
                return o.reshape(B, s.heads, T, hd).transpose(1, 2).reshape(B, T, s.heads * hd)

            x = decoder_layer(x, w.args(), attention, norm_linear, add_linear)
        logits = F.linear(rms_norm(x[:, -1], self.norm_w, s.eps), self.lm_w)
        if sampling is None:
            return logits.argmax(dim=-1)
        return gumbel_topk(target_probs(logits, sampling).log(), 1, None)[:, 0]

    def _step(self, st: _State, kv, eos: torch.Tensor, filler: int, sampling: SamplingParams | None) -> None:
        """One decode step of every row, advancing `st` in place (graph-capturable: no host reads)."""
        S = kv[0].shape[3]
        slots = torch.arange(S, device=self.device)
        allowed = (slots >= st.pad[:, None]) & (slots <= st.slot)  # shape: [B, S]
        top = self._forward(st.ids[:, None], st.pos[:, None], st.slot, allowed[:, None], kv, sampling)
        top = torch.where(st.done, filler, top)
        st.out.index_copy_(1, st.step, top[:, None])
        st.done |= (top[:, None] == eos).any(dim=-1)
        st.ids.copy_(top)
        st.slot += 1
        st.pos += 1
        st.step += 1

    # -- generation -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos, pad_id: int = 0,
                 sampling: SamplingParams | None = None) -> list[tuple[list[int], str]]:
        """Per prompt: (new tokens up to and including the first end token, "stop"), or (the
        `max_new_tokens` tokens, "length") when none came. Greedy unless `sampling` has a
        temperature > 0 (its temperature and top_p are used; seed with torch.manual_seed)."""
        if sampling is not None and sampling.temperature <= 0:
            sampling = None
        s, dev = self.s, self.device
        B, P = len(prompts), max(len(p) for p in prompts)
        # Slots past P + max_new_tokens: the step after the last writes there; 128 keeps the
        # attention's mask rows aligned and lets graphs be reused across batches of nearby lengths.
        S = round_up(P + max_new_tokens + 1, 128)
        pad = torch.tensor([P - len(p) for p in prompts], device=dev)
        ids = torch.full((B, P), pad_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(dev)
        shape = self._prepare(B, S, max_new_tokens, eos, pad_id, sampling)
        st, kv = shape.st, shape.kv
        for c in kv:
            c.zero_()  # masked slots get a zero weight, and 0 * a stale NaN would still be NaN
        first = torch.cat([self._prefill(ids[r], pad[r], [c[:, r] for c in kv], sampling)
                           for r in _row_chunks(B, P, S, s.groups)])
        st.ids.copy_(first)
        st.out.zero_()
        st.out[:, 0] = first
        st.done.copy_((first[:, None] == shape.eos).any(dim=-1))
        st.slot.fill_(P)
        st.pos.copy_(P - pad)
        st.step.fill_(1)
        st.pad.copy_(pad)
        run = self._replayer(shape)
        for i in range(1, max_new_tokens):
            if i % self.check_every == 0 and bool(st.done.all()):
                break
            run()
        out = st.out.tolist()
        stops = set(eos)
        results = []
        for row in out:
            cut = next((i for i, tok in enumerate(row) if tok in stops), None)
            results.append((row, "length") if cut is None else (row[: cut + 1], "stop"))
        return results

    def _prefill(self, ids, pad, kv, sampling: SamplingParams | None):
        """The prompts' pass: row b's query t attends slots pad[b]..t (a pad query, which has no
        such slot, attends itself, so no row of the softmax is empty)."""
        P, S, dev = ids.shape[1], kv[0].shape[3], self.device
        t = torch.arange(P, device=dev)
        slots = torch.arange(S, device=dev)
        causal = (slots[None, None] >= pad[:, None, None]) & (slots[None, None] <= t[None, :, None])
        allowed = causal | (slots[None, None] == t[None, :, None])  # shape: [B, P, S]
        pos = (t[None] - pad[:, None]).clamp(min=0)
        return self._forward(ids, pos, t, allowed, kv, sampling)

    def _prepare(self, B: int, S: int, max_new: int, eos, filler: int, sampling: SamplingParams | None) -> _Shape:
        """State and cache for this batch shape: the last batch's (and its graph) when it matches."""
        ends = tuple(sorted(set(eos))) or (-1,)
        rule = (sampling.temperature, sampling.top_p) if sampling is not None else (0.0, 1.0)
        key = (B, S, max_new, ends, filler, *rule)
        if self._shape is not None and self._shape.key == key:
            return self._shape
        self._shape = None  # free the last shape's cache and graph before allocating this one
        dev, s = self.device, self.s
        long = dict(dtype=torch.long, device=dev)
        st = _State(ids=torch.zeros(B, **long), slot=torch.zeros(1, **long), pos=torch.zeros(B, **long),
                    pad=torch.zeros(B, **long), done=torch.zeros(B, dtype=torch.bool, device=dev),
                    step=torch.zeros(1, **long), out=torch.zeros(B, max_new, **long))
        kv = [torch.zeros(2, B, s.kv_heads, S, s.head_dim, dtype=self.dtype, device=dev) for _ in self.layers]
        self._shape = _Shape(key, st, kv, torch.tensor(ends, device=dev), sampling)
        return self._shape

    def _replayer(self, shape: _Shape):
        """A function running one step: eager, or the shape's CUDA graph (captured on first use)."""
        st, filler = shape.st, shape.key[4]
        step = (shape.kv, shape.eos, filler, shape.sampling)
        if not self.use_graphs:
            return lambda: self._step(st, *step)
        if shape.graph is None:
            # Capture writes the cache and advances the state: save the state, capture, restore
            # (the cache slot written is the one the first real step rewrites).
            live = (st.ids, st.slot, st.pos, st.done, st.step, st.out)
            saved = [t.clone() for t in live]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step(st, *step)  # warm-up outside the graph (lazy allocations)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._step(st, *step)
            for t, v in zip(live, saved):
                t.copy_(v)
            shape.graph = g
        return shape.graph.replay


def _row_chunks(B: int, P: int, S: int, groups: int, budget: int = 1 << 28) -> list[slice]:
    """Rows per prefill pass so that its attention mask (rows x groups x P x S) stays under
    `budget` elements: a batch of 256 long prompts would otherwise need gigabytes for it."""
    n = max(1, budget // max(1, groups * P * S))
    return [slice(i, min(B, i + n)) for i in range(0, B, n)]
