"""How vLLM and SGLang read an EAGLE-3 drafter folder, rule by rule, as their released code does.

Every rule below names the engine file and lines it was read from: vLLM 0.34.0 and SGLang 0.5.23
(`pip download --no-deps vllm==0.34.0 sglang==0.5.23`, unzip; re-read them when the engines
move). `read_folder` applies them to a drafter folder and says, per engine, whether it loads,
which target hidden states the engine feeds it (canonical ids, see `specdec.conventions`, in the
order it concatenates them) and how the engine builds the drafter; `engine_view` builds that
drafter so `check_folder` can feed it those states and compare its logits with the drafter fed as
in training. `export`, `convert` and the contract tests (tests/test_engine_rules.py) use it.

vLLM (`vllm serve TARGET --speculative-config '{"method": "eagle3", "model": DIR, ...}'`)
  config   an eagle3 folder is its Llama config (transformers_utils/configs/eagle.py 55-88); a
           speculators folder is flattened by transformers_utils/configs/speculators/algos.py
           15-50: transformer_layer_config plus draft_vocab_size, target_hidden_size, the norm
           flags (norm_before_residual defaults to True there, 33-35) and the top-level ids only
           when they are set (47-50); no eagle_config.
  aux ids  the top-level `eagle_aux_hidden_state_layer_ids`, else `eagle_config.layer_ids`, else
           the guess (2, L//2, L-3) (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py 24-29 and
           103-140; model_executor/models/interfaces.py 1764-1777), sorted and de-duplicated
           (interfaces.py 1629-1630); the target appends each captured layer in layer order:
           id k = hidden + residual entering layer k, k = L after the last layer, 0..L
           (llama.py 427-441 for llama/mistral/qwen2/qwen3; deepseek_v2.py 1545-1587).
  fc       reads `num_aux_hidden_states`, else len(eagle_config ids), else 3 states
           (model_executor/models/llama_eagle3.py 209-221).
  flags    norm_before_residual (101-104), eagle_config's norm_before_fc before the top-level
           key (184-188), fc_norm (231-240), norm_output (252, 286).
  tensors  t2d skipped, d2t renamed draft_id_to_target_id (411-433), a parameter that exists
           only when draft_vocab_size differs from the target's vocab (338-345); midlayer. ->
           layers.0. (290-299); a name without a parameter raises (utils.py 446-459), except
           input_norm. without norm_before_fc, embed_tokens and d2t when absent (435-443);
           missing parameters keep their initial values silently; without embed_tokens the
           target's embedding is shared.
  serve    the short form `vllm serve DIR` of a speculators folder needs its verifier to be a
           hub repository id, not a local path (transformers_utils/config.py 904-918).

SGLang (`python -m sglang.launch_server ... --speculative-algorithm EAGLE3
         --speculative-draft-model-path DIR`)
  config   LlamaForCausalLMEagle3 only (srt/models/llama_eagle3.py 387): no speculators format.
  aux ids  only `eagle_config.eagle_aux_hidden_state_layer_ids`, else [2, L//2, L-3]
           (srt/model_executor/model_runner_components/spec_aux_hidden_state.py 186-196), plus
           1 by the target's architecture (`specdec.conventions`); layer i captures the stream
           entering it, for i in 0..L-1 only, once, in layer order (srt/models/llama.py
           485-494, deepseek_v2.py 3175-3196): id L is never fed.
  fc       like vLLM (llama_eagle3.py 156-167).
  flags    norm_before_residual is never read: the residual is the raw fc output (97-102);
           eagle_config's norm_before_fc before the top-level key (169-175), fc_norm or
           use_aux_norm (184-196), norm_output (207, 267-268); tie_word_embeddings makes the
           lm_head the embedding (303-304); without draft_vocab_size the target's lm_head is
           used (306-308).
  tensors  names containing midlayer / aux_norm_low|mid|high become layers.0 / fc_norm.0|1|2
           (337-348); d2t -> hot_token_id = d2t + arange (350-353); t2d and names without a
           parameter are skipped silently (355-378); the target's embedding always replaces the
           drafter's (srt/speculative/eagle_worker_v2.py 352-363).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .conventions import sglang_rule

ENGINES = {"vllm": "0.34.0", "sglang": "0.5.23"}
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
_SGLANG_LEGACY = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                  "aux_norm_high": "fc_norm.2"}


@dataclass(frozen=True, kw_only=True)
class TargetFacts:
    """What the rules need to know of the target: its architecture, depth and sizes."""

    model_type: str | None
    num_layers: int | None
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, target) -> "TargetFacts":
        """From a specdec Target, an export TargetShape, or anything with their attributes."""
        config = getattr(target, "config", None)
        return cls(model_type=getattr(config, "model_type", None) or getattr(target, "model_type", None),
                   num_layers=target.num_layers, hidden_size=target.hidden_size, vocab_size=target.vocab_size)

    @classmethod
    def recorded(cls, cfg) -> "TargetFacts":
        """From what a drafter's config records of the target it was trained for."""
        return cls(model_type=cfg.target_model_type, num_layers=cfg.target_num_layers,
                   hidden_size=cfg.target_hidden_size, vocab_size=cfg.vocab_size)


@dataclass(kw_only=True)
class EngineReading:
    """One engine's reading of one drafter folder."""

    engine: str
    version: str
    loads: bool = True  # loading raises (or the first forward crashes) when False
    fed_ids: list[int] | None = None  # canonical ids of the states fed to fc, in order
    ids_from: str = ""
    problems: list[str] = field(default_factory=list)  # each one: will not run as trained
    notes: list[str] = field(default_factory=list)
    flags: dict = field(default_factory=dict)  # norm switches as the engine applies them
    num_fc_states: int = 3
    params: dict[str, str] = field(default_factory=dict)  # engine parameter -> file tensor name
    d2t_from_file: bool = False
    embedding: str = "target"  # whose embedding the engine runs: "drafter" or "target"
    max_abs_logit_diff: float | None = None

    @property
    def name(self) -> str:
        return f"{ENGINE_NAMES[self.engine]} {self.version}"

    @property
    def ok(self) -> bool:
        return self.loads and not self.problems

    def refuse(self, reason: str) -> None:
        self.loads = False
        self.problems.append(reason)

    def verdict(self, trained_ids: list[int]) -> str:
        if self.ok:
            gap = self.max_abs_logit_diff
            diff = "" if gap is None else f"; logits as trained (max |diff| {gap:.1g})"
            return f"loads; feeds hidden_states{self.fed_ids} = trained on {list(trained_ids)}{diff}"
        return ("will not load: " if not self.loads else "loads but runs wrong: ") + "; ".join(self.problems)

    def to_json(self, trained_ids: list[int]) -> dict:
        return {"engine": self.engine, "version": self.version, "ok": self.ok, "loads": self.loads,
                "fed_ids": self.fed_ids, "trained_ids": list(trained_ids), "ids_from": self.ids_from,
                "problems": self.problems, "notes": self.notes, "flags": self.flags,
                "embedding": self.embedding, "max_abs_logit_diff": self.max_abs_logit_diff,
                "verdict": self.verdict(trained_ids)}


# ---------------------------------------------------------------------------------------------
# The config as each engine sees it


def _engine_config(engine: str, raw: dict) -> dict:
    """The attributes the engine's drafter config ends up with."""
    if "transformer_layer_config" not in raw:
        return dict(raw)
    # vLLM's speculators reader (algos.py 15-50); SGLang never gets here.
    conf = dict(raw.get("transformer_layer_config") or {})
    conf["draft_vocab_size"] = raw.get("draft_vocab_size")
    if raw.get("target_hidden_size") is not None:
        conf["target_hidden_size"] = raw["target_hidden_size"]
    conf["norm_before_residual"] = raw.get("norm_before_residual", True)
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        conf[flag] = raw.get(flag, False)
    conf.pop(IDS_KEY, None)
    if raw.get(IDS_KEY):
        conf[IDS_KEY] = raw[IDS_KEY]
    conf.pop("eagle_config", None)
    return conf


def _eagle_config(conf: dict) -> dict:
    ec = conf.get("eagle_config")
    return ec if isinstance(ec, dict) else {}


def _flags(engine: str, conf: dict) -> dict:
    ec = _eagle_config(conf)
    fc_norm = conf.get("fc_norm", False)
    if engine == "sglang":
        fc_norm = fc_norm or conf.get("use_aux_norm", False)
    return {
        "norm_before_residual": bool(conf.get("norm_before_residual", False)) if engine == "vllm" else False,
        "norm_before_fc": bool(ec.get("norm_before_fc", conf.get("norm_before_fc", False))),
        "fc_norm": bool(fc_norm),
        "norm_output": bool(conf.get("norm_output", False)),
    }


def _num_fc_states(conf: dict) -> int:
    ids = _eagle_config(conf).get(IDS_KEY)
    return conf.get("num_aux_hidden_states") or (len(ids) if ids else 3)


def vllm_fed_ids(conf: dict, num_layers: int | None) -> tuple[list[int] | None, str, list[int]]:
    """(canonical ids fed, where they came from, ids that cannot be captured)."""
    ids = conf.get(IDS_KEY)
    where = f"top-level {IDS_KEY}"
    if not ids:
        ids = _eagle_config(conf).get("layer_ids")
        where = "eagle_config.layer_ids (no top-level ids)"
    if not ids:
        if num_layers is None:
            return None, "guessed from the target's depth (no top-level ids)", []
        ids = [2, num_layers // 2, num_layers - 3]
        where = f"guessed (2, L//2, L-3) for L = {num_layers}: the config has no top-level {IDS_KEY}"
    fed = sorted(set(ids))
    lost = [i for i in fed if i < 0 or (num_layers is not None and i > num_layers)]
    return [i for i in fed if i not in lost], where, lost


def sglang_fed_ids(conf: dict, model_type: str | None,
                   num_layers: int | None) -> tuple[list[int] | None, str, list[int]]:
    """(canonical ids fed, how they were read, ids that cannot be captured); None when SGLang's
    rule for this architecture is not known."""
    written = _eagle_config(conf).get(IDS_KEY)
    if not written:
        if num_layers is None:
            return None, "SGLang's defaults for the target's depth (no eagle_config ids)", []
        capture = [2, num_layers // 2, num_layers - 3]
        how = f"defaults [2, L//2, L-3] for L = {num_layers}: the config has no eagle_config.{IDS_KEY}"
    else:
        rule = sglang_rule(model_type)
        if rule is None:
            return None, f"eagle_config ids {list(written)}: SGLang's rule for model_type {model_type!r} unknown", []
        plus = rule == "always" or written[0] == 1
        capture = [i + 1 for i in written] if plus else list(written)
        why = "always +1 for this architecture" if rule == "always" else (
            "+1 because the first id is 1" if plus else "as written: the first id is not 1")
        how = f"eagle_config ids {list(written)} -> {capture} ({model_type}: {why})"
    fed = sorted(set(capture))
    lost = [i for i in fed if i < 0 or (num_layers is not None and i >= num_layers)]
    return [i for i in fed if i not in lost], how, lost


def vllm_short_form_ok(verifier: str | None) -> bool:
    """`vllm serve DIR` reads the target from speculators_config.verifier, which must be a hub
    repository id and not a local path (transformers_utils/config.py 904-918)."""
    if not verifier:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(verifier)
    except HFValidationError:
        return False
    return not (Path(verifier).exists() or Path(verifier).is_symlink())


# ---------------------------------------------------------------------------------------------
# Tensors


def expected_params(conf: dict, flags: dict, n_states: int) -> dict[str, tuple[int, ...]]:
    """Engine parameters (unstacked q/k/v and gate/up names) and their shapes."""
    H = conf["hidden_size"]
    heads = conf["num_attention_heads"]
    kv = conf.get("num_key_value_heads") or heads
    hd = conf.get("head_dim") or H // heads
    inter = conf["intermediate_size"]
    tH = conf.get("target_hidden_size") or H
    vocab = conf["vocab_size"]
    draft = conf.get("draft_vocab_size") or vocab
    p = "layers.0."
    out = {
        "fc.weight": (H, n_states * tH),
        p + "self_attn.q_proj.weight": (heads * hd, 2 * H),
        p + "self_attn.k_proj.weight": (kv * hd, 2 * H),
        p + "self_attn.v_proj.weight": (kv * hd, 2 * H),
        p + "self_attn.o_proj.weight": (H, heads * hd),
        p + "mlp.gate_proj.weight": (inter, H),
        p + "mlp.up_proj.weight": (inter, H),
        p + "mlp.down_proj.weight": (H, inter),
        p + "input_layernorm.weight": (H,),
        p + "hidden_norm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (draft, H),
        "embed_tokens.weight": (vocab, H),
    }
    if flags["norm_before_fc"]:
        out["input_norm.weight"] = (n_states * tH,)
    if flags["fc_norm"]:
        out.update({f"fc_norm.{i}.weight": (tH,) for i in range(n_states)})
    return out


def _vllm_name(name: str, flags: dict) -> str | None:
    """The vLLM parameter a file tensor loads into; None when skipped. (llama_eagle3.py 411-448)"""
    if "t2d" in name or "mask_hidden" in name:
        return None
    if "d2t" in name:
        return "d2t"
    if name.startswith("input_norm.") and not flags["norm_before_fc"]:
        return None
    return name.replace("midlayer.", "layers.0.")


def _sglang_name(name: str) -> str:
    for legacy, new in _SGLANG_LEGACY.items():
        if legacy in name:
            name = name.replace(legacy, new)
    return name


def _check_tensors(r: EngineReading, conf: dict, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                   target: TargetFacts, trained_d2t: torch.Tensor | None) -> None:
    try:
        params = expected_params(conf, r.flags, r.num_fc_states)
    except KeyError as e:
        r.refuse(f"config.json lacks {e.args[0]!r}")
        return
    draft_vocab = conf.get("draft_vocab_size") or conf["vocab_size"]
    for name, (shape, dtype) in shapes.items():
        if r.engine == "vllm":
            param = _vllm_name(name, r.flags)
            if param == "d2t" and draft_vocab == target.vocab_size:
                r.refuse(f"d2t is saved but the draft vocab equals the target's ({draft_vocab}): vLLM has no "
                         "draft_id_to_target_id parameter then and raises; export without d2t")
                continue
        else:
            param = _sglang_name(name)
            if "d2t" in param:
                param = "d2t"
            elif "t2d" in param:
                param = None
            elif param not in params:
                r.notes.append(f"{name} skipped (no such parameter)")
                param = None
        if param is None:
            continue
        if param == "d2t":
            if dtype.is_floating_point or dtype == torch.bool:
                r.refuse(f"d2t has dtype {dtype}: expected integer offsets")
            elif shape != (draft_vocab,):
                r.refuse(f"d2t has shape {list(shape)}, expected [{draft_vocab}]")
            else:
                r.d2t_from_file = True
            continue
        if param not in params:
            if name.endswith(".bias"):
                continue  # vLLM ignores unexpected biases (utils.py 466)
            r.refuse(f"tensor {name} has no vLLM parameter (raises ValueError: There is no module or "
                     f"parameter named ...)")
            continue
        if tuple(shape) != tuple(params[param]):
            r.refuse(f"{name} has shape {list(shape)}, the engine's parameter {list(params[param])}")
            continue
        if not dtype.is_floating_point:
            r.refuse(f"{name} has dtype {dtype}: expected floating point weights")
            continue
        r.params[param] = name
    missing = [p for p in params if p not in r.params and p != "embed_tokens.weight"]
    if missing:
        r.problems.append(f"no tensor for {', '.join(missing[:4])}: the engine keeps its initial values")
    if r.engine == "vllm" and "embed_tokens.weight" in r.params:
        r.embedding = "drafter"
    if not r.d2t_from_file and draft_vocab != target.vocab_size:
        identity = trained_d2t is not None and not bool(trained_d2t.any())
        if not identity:
            r.problems.append(
                f"no d2t with a reduced draft vocab ({draft_vocab} of {target.vocab_size}): draft id i is "
                "taken as target id i, so every draft token is the wrong one")


# ---------------------------------------------------------------------------------------------
# One engine, one folder


def read_config(engine: str, raw: dict, shapes: dict, target: TargetFacts, trained=None) -> EngineReading:
    """`engine`'s reading of a drafter folder's config.json (`raw`) and tensor headers (`shapes`:
    name -> (shape, dtype)). `trained` (a DrafterConfig plus its d2t, as `(cfg, d2t)`) is what
    the drafter was trained with; without it only loading is judged."""
    r = EngineReading(engine=engine, version=ENGINES[engine])
    speculators = "transformer_layer_config" in raw or raw.get("speculators_model_type") is not None
    if engine == "sglang" and speculators:
        r.refuse("SGLang has no Eagle3Speculator architecture; export with --format eagle3")
        return r
    conf = _engine_config(engine, raw)
    r.flags = _flags(engine, conf)
    r.num_fc_states = _num_fc_states(conf)
    reader = vllm_fed_ids if engine == "vllm" else (lambda c, n: sglang_fed_ids(c, target.model_type, n))
    r.fed_ids, r.ids_from, lost = reader(conf, target.num_layers)
    if lost:
        where = ("0..L-1: the last layer's output (id L) is never fed" if engine == "sglang"
                 else "0..L")
        r.refuse(f"ids {lost} cannot be captured from a {target.num_layers}-layer target (it captures {where})")
    if r.fed_ids is None:
        r.problems.append(f"cannot tell which states are fed ({r.ids_from}); pass --target")
    elif len(r.fed_ids) != r.num_fc_states:
        r.refuse(f"feeds {len(r.fed_ids)} states {r.fed_ids} to an fc that reads {r.num_fc_states}")
    if engine == "sglang":
        if conf.get("tie_word_embeddings"):
            r.problems.append("tie_word_embeddings is true: SGLang makes the lm_head the embedding matrix")
        if conf.get("draft_vocab_size") is None:
            r.problems.append("no draft_vocab_size: SGLang uses the target's lm_head instead of the drafter's")
    trained_cfg, trained_d2t = trained if trained is not None else (None, None)
    _check_tensors(r, conf, shapes, target, trained_d2t)
    if trained_cfg is not None:
        if r.fed_ids is not None and r.fed_ids != sorted(trained_cfg.aux_layer_ids):
            r.problems.append(f"feeds hidden_states{r.fed_ids} ({r.ids_from}) but the drafter was trained on "
                              f"{list(trained_cfg.aux_layer_ids)}")
        for flag, value in r.flags.items():
            if value != getattr(trained_cfg, flag):
                why = (" (SGLang never reads it: the residual is always the raw fc output; vLLM honours it)"
                       if engine == "sglang" and flag == "norm_before_residual" else "")
                r.problems.append(f"runs {flag}={value}, trained with {getattr(trained_cfg, flag)}{why}")
    if not r.loads:
        r.problems = list(dict.fromkeys(r.problems))
    return r


def tensor_headers(folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor in the folder's safetensors files, without reading them."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                dtype = getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                                        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                                        "U8": "uint8", "BOOL": "bool"}.get(sl.get_dtype(), "float32"))
                out[name] = (tuple(sl.get_shape()), dtype)
    return out


def read_folder(folder: str | Path, target: TargetFacts, trained=None,
                engines: tuple[str, ...] = tuple(ENGINES)) -> dict[str, EngineReading]:
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    shapes = tensor_headers(folder)
    return {e: read_config(e, raw, shapes, target, trained) for e in engines}


# ---------------------------------------------------------------------------------------------
# The drafter as the engine runs it, and the functional check


def engine_view(reading: EngineReading, raw: dict, tensors: dict[str, torch.Tensor], target_embedding: torch.Tensor):
    """(drafter module, d2t) as `reading.engine` builds them from the folder: its ids, its
    flags, its tensors, its embedding and vocab mapping. Only for a reading that loads."""
    from .models.drafter import Eagle3Drafter
    from .models.formats import parse_config

    conf = _engine_config(reading.engine, raw)
    for key in ("specdec", "eagle_config"):
        conf.pop(key, None)
    conf.setdefault("draft_vocab_size", conf.get("vocab_size"))
    conf.update(architectures=["LlamaForCausalLMEagle3"], **{IDS_KEY: list(reading.fed_ids)})
    cfg = replace(parse_config(conf), **reading.flags)
    drafter = Eagle3Drafter(cfg)
    state = {param.replace("layers.0.", "midlayer."): tensors[name].float() for param, name in reading.params.items()
             if param != "embed_tokens.weight" or reading.embedding == "drafter"}
    if reading.embedding == "target":
        state["embed_tokens.weight"] = target_embedding.float()
    drafter.load_state_dict(state, strict=False)
    d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if reading.d2t_from_file:
        d2t = next(t for n, t in tensors.items() if "d2t" in n).long()
    return drafter.eval(), d2t


def random_states(top: int, hidden_size: int, tokens: int = 8, seed: int = 0) -> dict[int, torch.Tensor]:
    """Seeded random target states, one per hidden_states index 0..top: what the checks feed."""
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(1, tokens, hidden_size, generator=g) for i in range(top + 1)}


def target_space_logits(drafter, d2t: torch.Tensor, states: dict[int, torch.Tensor], ids: list[int],
                        vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Two drafting steps (target states, then the recycled hidden) fed `states[i] for i in ids`,
    with logits scattered to target token ids (-inf elsewhere), as an engine samples them."""
    c = drafter.cfg
    g = torch.Generator().manual_seed(seed)
    T = next(iter(states.values())).shape[1]
    tokens = torch.randint(0, c.vocab_size, (1, T), generator=g)
    pos = torch.arange(T)[None]
    aux = torch.cat([states[i] for i in ids], -1)
    with torch.no_grad():
        h, logits0 = drafter(tokens, aux, pos)
        _, logits1 = drafter(tokens.roll(-1, 1), h, pos + 1)
    logits = torch.cat([logits0, logits1], 1)
    out = torch.full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., torch.arange(d2t.numel()) + d2t] = logits
    return out


def logit_gap(want: torch.Tensor, got: torch.Tensor) -> float:
    """Max |difference| of two target-space logit tensors; inf when they cover other tokens."""
    if not torch.equal(torch.isinf(want), torch.isinf(got)):
        return float("inf")
    finite = ~torch.isinf(want)
    return float((want[finite] - got[finite]).abs().max()) if finite.any() else 0.0


def check_folder(folder: str | Path, trained, target: TargetFacts, target_embedding: torch.Tensor,
                 engines: tuple[str, ...] = tuple(ENGINES), tolerance: float = 1e-4) -> dict[str, EngineReading]:
    """Each engine's reading of `folder`, and, where it loads, its logits fed the states it
    would capture against `trained` (an Eagle3Drafter, rounded to the written dtype) fed as in
    training. States are random, one per hidden_states index."""
    from .models.formats import read_tensors

    folder = Path(folder)
    readings = read_folder(folder, target, (trained.cfg, trained.d2t.cpu()), engines)
    runnable = {e: r for e, r in readings.items() if r.loads and r.fed_ids is not None}
    if not runnable:
        return readings
    raw = json.loads((folder / "config.json").read_text())
    tensors = read_tensors(folder)
    top = max([*trained.cfg.aux_layer_ids, *(i for r in runnable.values() for i in r.fed_ids)])
    states = random_states(top, trained.cfg.target_hidden_size)
    want = {"drafter": target_space_logits(trained, trained.d2t.cpu(), states, list(trained.cfg.aux_layer_ids),
                                           target.vocab_size)}
    own = trained.embed_tokens.weight.detach().float().cpu()
    shared = target_embedding.detach().float().cpu()
    if shared.shape == own.shape and torch.allclose(shared, own, rtol=1e-2, atol=1e-3):
        # The same matrix up to the written dtype's rounding: the engine running the target's copy
        # runs the drafter as trained; the reference takes that copy so rounding is not flagged.
        import copy

        ref = copy.deepcopy(trained)
        with torch.no_grad():
            ref.embed_tokens.weight.copy_(shared)
        want["target"] = target_space_logits(ref, ref.d2t.cpu(), states, list(ref.cfg.aux_layer_ids),
                                             target.vocab_size)
    else:
        want["target"] = want["drafter"]
    for r in runnable.values():
        view, d2t = engine_view(r, raw, tensors, shared)
        expected = want[r.embedding]
        r.max_abs_logit_diff = logit_gap(expected, target_space_logits(view, d2t, states, r.fed_ids, target.vocab_size))
        scale = max(1.0, float(expected[~torch.isinf(expected)].abs().max()))
        if not r.max_abs_logit_diff <= tolerance * scale and not r.problems:
            r.problems.append(f"fed as the engine feeds it, its logits differ from training's by "
                              f"{r.max_abs_logit_diff:.3g}")
    return readings
