"""Targets as far as a drafter's checks need them, without loading the target's weights:
`TargetShape` reads a target folder's config and, on demand, its embedding from the safetensors
files (a 1T-parameter target is checked in a second); `SelfShape` stands in with the drafter's own
numbers when no target is given. Both have the attributes `load_drafter` and the engine rules read
from a loaded `Target`."""

from __future__ import annotations

from pathlib import Path

class TargetShape:
    """What `load_drafter`'s checks read from a target, without loading its weights: the numbers in
    its config and, on demand, its embedding matrix read from the safetensors files. A 1T-parameter
    target is checked in a second."""

    def __init__(self, name: str, folder: Path):
        import torch
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(folder))
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.name = name
        self.folder = folder
        self.config = text
        self.num_layers = text.num_hidden_layers
        self.hidden_size = text.hidden_size
        self.device = torch.device("cpu")
        self.files = sorted(folder.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(folder)
        rows = self._shape("lm_head.weight") or self._shape("embed_tokens.weight")
        self.vocab_size = rows[0] if rows else text.vocab_size

    def _find(self, suffix: str):
        from safetensors import safe_open

        for f in self.files:
            with safe_open(str(f), "pt") as h:
                keys = [k for k in h.keys() if k == suffix or k.endswith("." + suffix)]
                if keys:
                    return f, sorted(keys, key=len)[0]
        return None

    def _shape(self, suffix: str):
        from safetensors import safe_open

        hit = self._find(suffix)
        if hit is None:
            return None
        with safe_open(str(hit[0]), "pt") as h:
            return list(h.get_slice(hit[1]).get_shape())

    def embed_tokens(self):
        import torch
        from safetensors import safe_open

        hit = self._find("embed_tokens.weight")
        if hit is None:
            from ..errors import SpecdecError

            raise SpecdecError(f"no embed_tokens.weight in {self.folder}: "
                               "cannot give the drafter the target's embedding")
        with safe_open(str(hit[0]), "pt") as h:
            return torch.nn.Embedding.from_pretrained(h.get_tensor(hit[1]).float(), freeze=True)


class SelfShape:
    """Stands in for the target when none is given: the drafter's own numbers and embedding."""

    def __init__(self, drafter):
        import torch

        c = drafter.cfg
        self.name = "the drafter's own config"
        self.num_layers = max(c.aux_layer_ids)
        self.hidden_size = c.target_hidden_size
        self.vocab_size = c.vocab_size
        self.device = torch.device("cpu")
        self._embed = drafter.embed_tokens

    def embed_tokens(self):
        return self._embed


def target_for_checks(source: str):
    """(target-like object for load_drafter, the name serving engines should load)."""
    from .registry import resolve_model_path
    from .target import load_target

    folder, gguf = resolve_model_path(source)
    if not gguf and folder.is_dir():
        try:
            return TargetShape(source, folder), str(folder.resolve())
        except (FileNotFoundError, OSError, ValueError, KeyError, AttributeError):
            pass  # no safetensors or an unusual config: load the model itself
    target = load_target(source, device="cpu", dtype="fp32")
    serve = str(folder.resolve()) if folder.is_dir() else source
    return target, serve
