"""The one place that decides which target hidden states EAGLE-3 reads, and how tools name them.

specdec's canonical convention is the EAGLE/vLLM/speculators one: aux id k means "the input of
decoder layer k", which is `output_hidden_states[k]` in Hugging Face (index 0 = embeddings,
k = L the last layer's output before the final norm). Other tools count differently:

    tool                       | id meaning                                | default ids (L layers)
    eagle, vllm, speculators   | input of layer k = HF hidden_states[k]    | [2, L//2, L-3]
    specforge, modelopt        | output of layer k = HF hidden_states[k+1] | [1, L//2-1, L-4]
    sglang (eagle_config ids)  | per target architecture, see below        | [2, L//2, L-3]

SGLang 0.5.23 adds 1 to `eagle_config.eagle_aux_hidden_state_layer_ids` in each target model's
`set_eagle3_layers_to_capture`: always for llama / mistral / qwen2 / qwen3
(`srt/models/llama.py` 929-941, `qwen2.py` 781-794, `qwen3.py` 778-791; mistral subclasses
llama), only when the first id is 1 for deepseek_v2/v3 (and the Kimi models built on it) and
glm4_moe_lite (`srt/models/deepseek_v2.py` 3458-3473, `glm4_moe_lite.py` 805-820).

Off-by-one here is the most common cause of collapsed acceptance, so every conversion goes
through `to_canonical` / `from_canonical` and a test pins them against `output_hidden_states`.
"""

from __future__ import annotations

from .errors import SpecdecError

CONVENTIONS = ("eagle", "vllm", "speculators", "specforge", "modelopt", "sglang")
CANONICAL = "eagle"

# SGLang's +1 on eagle_config ids, by the target's model_type (see the module docstring).
SGLANG_ALWAYS_PLUS_ONE = ("llama", "mistral", "qwen2", "qwen3")
SGLANG_PLUS_ONE_IF_FIRST_IS_ONE = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "glm4_moe_lite")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Canonical (HF hidden_states index) ids of the three states EAGLE-3 reads by default."""
    if num_layers >= 8:
        return [2, num_layers // 2, num_layers - 3]
    # Small test models: three distinct taps spread over 1..L (0 = embeddings only if needed).
    ids = sorted({max(1, round(1 + (num_layers - 1) * f)) for f in (0.0, 0.5, 1.0)})
    for extra in range(num_layers + 1):
        if len(ids) >= 3:
            break
        if extra not in ids:
            ids = sorted(ids + [extra])
    return ids


def _check(convention: str) -> str:
    c = convention.lower()
    if c not in CONVENTIONS:
        raise SpecdecError(
            f"unknown layer-id convention {convention!r}; expected one of {', '.join(CONVENTIONS)}"
        )
    return c


def sglang_rule(model_type: str | None) -> str | None:
    """'always' or 'first_is_one': how SGLang adds 1 for this target; None when not known."""
    if model_type in SGLANG_ALWAYS_PLUS_ONE:
        return "always"
    if model_type in SGLANG_PLUS_ONE_IF_FIRST_IS_ONE:
        return "first_is_one"
    return None


def _sglang_unknown(ids: list[int], model_type: str | None) -> SpecdecError:
    arch = f"target model_type {model_type!r}" if model_type else "an unknown target architecture"
    return SpecdecError(
        f"SGLang reads eagle_config ids {ids} by the target's architecture ({arch} given): "
        f"{'/'.join(SGLANG_ALWAYS_PLUS_ONE)} add 1 ({[i + 1 for i in ids]}), deepseek_v2/v3, Kimi and "
        f"glm4_moe_lite add 1 only when the first id is 1 ({list(ids)}); pass --target (or --target-type) "
        f"or --layer-convention"
    )


def to_canonical(ids: list[int], convention: str, model_type: str | None = None) -> list[int]:
    """Convert ids written in `convention` to HF `hidden_states` indices. `model_type` (the
    target's) decides SGLang's reading; without it only ids that every rule reads alike convert."""
    c = _check(convention)
    ids = list(ids)
    if c in ("specforge", "modelopt"):
        return [i + 1 for i in ids]
    if c == "sglang":
        rule = sglang_rule(model_type)
        if rule == "always" or (ids and ids[0] == 1):
            return [i + 1 for i in ids]
        if rule == "first_is_one":
            return ids
        raise _sglang_unknown(ids, model_type)
    return ids


def from_canonical(ids: list[int], convention: str, model_type: str | None = None) -> list[int]:
    """Write canonical ids in `convention`'s terms; raises when SGLang cannot be told them for
    this target (deepseek-style targets cannot be given canonical ids starting at 1)."""
    c = _check(convention)
    ids = list(ids)
    if c in ("specforge", "modelopt"):
        return [i - 1 for i in ids]
    if c == "sglang":
        rule = sglang_rule(model_type)
        if rule == "always" or (ids and ids[0] == 2):
            return [i - 1 for i in ids]  # for deepseek-style targets: written as [1, ...], read +1
        if rule == "first_is_one" and not (ids and ids[0] == 1):
            return ids
        if rule == "first_is_one":
            raise SpecdecError(
                f"SGLang cannot be told canonical aux ids {ids} for a {model_type} target: written as-is "
                f"they read +1, written -1 they start at 0 and read as-is; retrain with a first id other than 1"
            )
        raise _sglang_unknown([i - 1 for i in ids], model_type)
    return ids


def require_layer_order(ids: list[int], where: str) -> list[int]:
    """vLLM and SGLang capture each aux layer once, in layer order, whatever order a config lists
    them in; a drafter trained on another order would have its fc read the wrong columns."""
    if list(ids) != sorted(set(ids)):
        raise SpecdecError(
            f"{where} {list(ids)}: expected ascending, distinct layer ids, because vLLM and SGLang feed "
            f"the drafter each layer once in layer order; pass {','.join(map(str, sorted(set(ids))))}"
        )
    return list(ids)


def resolve_aux_layer_ids(
    num_layers: int, ids: list[int] | None = None, convention: str = CANONICAL, shift: int = 0,
    model_type: str | None = None,
) -> list[int]:
    """Canonical aux ids for a target with `num_layers` decoder layers.

    `shift` moves every id by that many layers; `doctor` uses it to test the off-by-one
    hypotheses (a drafter trained at ids k served at k+1).
    """
    canon = (default_aux_layer_ids(num_layers) if ids is None
             else to_canonical(list(ids), convention, model_type))
    canon = [i + shift for i in canon]
    bad = [i for i in canon if not 0 <= i <= num_layers]
    if bad:
        raise SpecdecError(
            f"aux layer ids {canon} (canonical, HF hidden_states index) out of range for a target "
            f"with {num_layers} layers: expected 0..{num_layers}; check the id convention "
            f"(--layer-convention) of the drafter"
        )
    return canon
