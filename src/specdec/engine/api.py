"""What callers (CLI, server, eval, bench) see of the engine: parameters in, per-step events out."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # the tokenizer's EOS ids are added by the engine
    ignore_eos: bool = False


@dataclass(kw_only=True)
class StepOutput:
    """One engine step: one target forward pass and the tokens it committed."""

    token_ids: list[int]  # newly committed tokens (>= 1 unless finished)
    drafted: int = 0  # draft tokens proposed this step (0 for plain decoding)
    accepted: int = 0  # of those, accepted
    accepted_positions: list[bool] = field(default_factory=list)  # per draft position 0..k-1
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS / stop id) or "length"


@dataclass(kw_only=True)
class GenerationResult:
    prompt_tokens: int
    token_ids: list[int]
    seconds: float
    num_steps: int
    num_drafts: int  # steps that proposed at least one draft token
    drafted: int
    accepted: int
    accepted_per_position: list[int]  # count of steps whose draft position i was accepted
    finish_reason: str

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per target pass that proposed drafts (1 + accepted / drafts)."""
        return 1.0 + self.accepted / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts for a in self.accepted_per_position] if self.num_drafts else []

    def stats(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds > 0 else 0.0,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "num_drafts": self.num_drafts,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "finish_reason": self.finish_reason,
        }
