"""The one place that decides which target hidden states EAGLE-3 reads, and how tools name them.

specdec's canonical convention is the EAGLE/vLLM/speculators one: aux id k means "the input of
decoder layer k", which is `output_hidden_states[k]` in Hugging Face (index 0 = embeddings).
Other tools count differently:

    tool                       | id meaning                          | default ids (L layers)
    eagle, vllm, speculators   | input of layer k = HF hidden_states[k] | [2, L//2, L-3]
    specforge, modelopt        | output of layer k = HF hidden_states[k+1] | [1, L//2-1, L-4]
    sglang                     | config ids + 1 when the first id is 1   | [2, L//2, L-3] (config [1, ...])

Off-by-one here is the most common cause of collapsed acceptance, so every conversion goes
through `to_canonical` / `from_canonical` and a test pins them against `output_hidden_states`.
"""

from __future__ import annotations

from .errors import SpecdecError

CONVENTIONS = ("eagle", "vllm", "speculators", "specforge", "modelopt", "sglang")
CANONICAL = "eagle"


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


def to_canonical(ids: list[int], convention: str) -> list[int]:
    """Convert ids written in `convention` to HF `hidden_states` indices."""
    c = _check(convention)
    if c in ("specforge", "modelopt"):
        return [i + 1 for i in ids]
    if c == "sglang":
        # SGLang adds 1 to configured ids when the first is 1 (i.e. written as layer outputs).
        return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)
    return list(ids)


def from_canonical(ids: list[int], convention: str) -> list[int]:
    """Write canonical ids in `convention`'s terms."""
    c = _check(convention)
    if c in ("specforge", "modelopt"):
        return [i - 1 for i in ids]
    if c == "sglang" and ids and ids[0] == 2:
        # Written as [1, ...] every SGLang version adds 1 back; other first ids are read as-is.
        return [i - 1 for i in ids]
    return list(ids)


def resolve_aux_layer_ids(
    num_layers: int, ids: list[int] | None = None, convention: str = CANONICAL, shift: int = 0
) -> list[int]:
    """Canonical aux ids for a target with `num_layers` decoder layers.

    `shift` moves every id by that many layers; `doctor` uses it to test the off-by-one
    hypotheses (a drafter trained at ids k served at k+1).
    """
    canon = default_aux_layer_ids(num_layers) if ids is None else to_canonical(list(ids), convention)
    canon = [i + shift for i in canon]
    bad = [i for i in canon if not 0 <= i <= num_layers]
    if bad:
        raise SpecdecError(
            f"aux layer ids {canon} (canonical, HF hidden_states index) out of range for a target "
            f"with {num_layers} layers: expected 0..{num_layers}; check the id convention "
            f"(--layer-convention) of the drafter"
        )
    return canon
