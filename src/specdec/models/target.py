"""The target model: any Hugging Face causal LM, plus forward hooks that capture exactly the
hidden states EAGLE-3 reads.

Which states are read is decided in `specdec.conventions` (canonical id k = input of decoder
layer k = HF `hidden_states[k]`); this module only places hooks there. For k = L (the last
layer's output) the state is taken before the final norm unless `last_state="post_norm"`, a
switch `doctor` flips to test that hypothesis. Hooking the decoder layers means every
architecture HF implements works without copying its code; for DeepSeek-V3/Kimi (MLA + MoE) the
layer input is the full residual stream, which is what training must see.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..conventions import resolve_aux_layer_ids
from ..errors import SpecdecError


@dataclass
class TargetOutput:
    logits: torch.Tensor  # shape: [B, T, vocab]
    aux_hidden: torch.Tensor | None  # shape: [B, T, 3 * H], canonical order of aux ids
    last_hidden: torch.Tensor | None  # shape: [B, T, H], final pre-norm state (for losses)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers, wherever the architecture keeps it."""
    n = model.config.num_hidden_layers
    for name in ("model.layers", "model.decoder.layers", "transformer.h", "model.language_model.layers"):
        obj = model
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, nn.ModuleList) and len(obj) == n:
            return obj
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise SpecdecError(f"could not find the {n} decoder layers of {type(model).__name__}")


class Target:
    """A loaded target model with aux-hidden-state capture."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        *,
        name: str = "target",
        aux_layer_ids: list[int] | None = None,
        layer_convention: str = "eagle",
        last_state: str = "pre_norm",
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.num_layers = model.config.num_hidden_layers
        self.hidden_size = model.config.hidden_size
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.layers = decoder_layers(model)
        self.last_state = last_state
        self.set_aux_layer_ids(aux_layer_ids, layer_convention)
        # What the hooks capture, per thread: online training captures on the prefetch thread and
        # for its held-out evaluation on the main thread at the same time.
        self._local = threading.local()
        self._install_hooks()
        import inspect

        # transformers >= 5.2x renames past_key_values to cache; 5.17 (vLLM images) has only the old name.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # -- configuration -------------------------------------------------------------------
    def set_aux_layer_ids(self, ids: list[int] | None, convention: str = "eagle", shift: int = 0):
        self.aux_layer_ids = resolve_aux_layer_ids(self.num_layers, ids, convention, shift,
                                                   model_type=getattr(self.config, "model_type", None))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def final_norm(self) -> nn.Module | None:
        inner = getattr(self.model, "model", None)
        return getattr(inner, "norm", None)

    def fingerprint(self) -> str:
        """A short hash of the config and a sample of the weights: identifies the exact target.

        The same weights loaded in fp32 or bf16 hash alike (config without its dtype, weights
        rounded to bf16): a capture made with `--model-dtype bf16` trains with the target loaded
        in fp32, while different weights still differ. Nor do where the folder lies and which
        transformers wrote the config count: a capture made on a GPU machine trains elsewhere."""
        skip = ("dtype", "torch_dtype", "_name_or_path", "transformers_version")
        cfg = {k: v for k, v in self.config.to_dict().items() if k not in skip}
        h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
        with torch.no_grad():
            for _, p in list(self.model.named_parameters())[:: max(1, len(list(self.model.parameters())) // 16)]:
                flat = p.detach().flatten()
                h.update(flat[: min(4096, flat.numel())].to(torch.bfloat16).float().cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    # -- hooks -----------------------------------------------------------------------------
    def _install_hooks(self):
        def pre_hook(idx):
            def fn(module, args, kwargs):
                captured = getattr(self._local, "captured", None)
                if captured is not None and idx in self.aux_layer_ids:
                    captured[idx] = args[0] if args else kwargs["hidden_states"]
            return fn

        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True)

        def last_hook(module, args, output):
            captured = getattr(self._local, "captured", None)
            if captured is not None:
                captured[self.num_layers] = output[0] if isinstance(output, tuple) else output

        self.layers[-1].register_forward_hook(last_hook)

    def aux_state(self, i: int, captured: torch.Tensor) -> torch.Tensor:
        """What the drafter reads for id `i` from the state the hooks captured there: the last
        layer's output goes through the final norm first when `last_state` is post_norm."""
        if i == self.num_layers and self.last_state == "post_norm" and self.final_norm() is not None:
            return self.final_norm()(captured)
        return captured

    # -- forward ---------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        past_key_values=None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        capture: bool = True,
        logits_to_keep: int | None = None,
    ) -> TargetOutput:
        captured = self._local.captured = {} if capture else None
        try:
            kwargs = {self._cache_kw: past_key_values}
            if logits_to_keep is not None:
                kwargs["logits_to_keep"] = logits_to_keep
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=past_key_values is not None,
                **kwargs,
            )
        finally:
            self._local.captured = None
        aux = last = None
        if capture:
            last = captured.get(self.num_layers)
            aux = torch.cat([self.aux_state(i, captured[i]) for i in self.aux_layer_ids], dim=-1)
        return TargetOutput(logits=out.logits, aux_hidden=aux, last_hidden=last)


def _friendly_load_error(source: str, err: Exception) -> SpecdecError:
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    low = msg.lower()
    if "safetensor" in low or "header" in low or "incomplete" in low or "deserializ" in low:
        return SpecdecError(
            f"could not read the weights of {source}: {msg}; the file looks truncated or corrupt, "
            f"download or convert it again"
        )
    return SpecdecError(f"could not load target {source}: {msg}")


def load_target(
    source: str,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    device_map: str | None = None,
    aux_layer_ids: list[int] | None = None,
    layer_convention: str = "eagle",
) -> Target:
    """Load a target from a registry name, a local HF folder, a .gguf file, or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..precision import parse_dtype
    from .cpu_products import route_few_row_products
    from .registry import resolve_model_path

    folder, gguf_file = resolve_model_path(source)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:  # "auto" also picks bf16 on CPUs with native bf16 (see specdec.precision)
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    dtype = parse_dtype(dtype, device)
    kwargs = {"dtype": dtype}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    elif Path(str(folder)).is_dir():
        from .formats import refuse_pickle_only

        refuse_pickle_only(Path(str(folder)))
        kwargs["use_safetensors"] = True  # never a pickle, whatever else the folder holds
    if device_map:
        kwargs["device_map"] = device_map
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
        tok_kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **tok_kwargs)
    except SpecdecError:
        raise
    except Exception as e:  # transformers raises many types; the user needs one line
        raise _friendly_load_error(str(source), e) from e
    if not device_map:
        model.to(device)
        if torch.device(device).type == "cpu" and dtype == torch.float32:
            route_few_row_products(model)  # decode and verify steps at memory speed (see the module)
    name = source if not Path(str(source)).exists() else Path(str(source)).name
    return Target(model, tokenizer, name=name, aux_layer_ids=aux_layer_ids, layer_convention=layer_convention)
