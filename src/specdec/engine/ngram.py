"""Prompt lookup (n-gram) drafting: no training, no weights. Finds the most recent earlier
occurrence of the context's last n tokens (n from `max_ngram` down to 1) and proposes what
followed it."""

from __future__ import annotations

from .tree import Draft


class NgramProposer:
    """Prompt lookup as an `engine.Proposer`: reads only the context."""

    needs_aux = False

    def __init__(self, max_ngram: int = 3, k: int = 5, min_ngram: int = 1):
        self.max_ngram, self.min_ngram, self.k = max_ngram, min_ngram, k

    def begin(self, prompt_ids, context, aux, max_len) -> None:
        pass

    def commit(self, aux, new_tokens) -> None:
        pass

    def propose(self, context: list[int], limit: int | None = None, params=None, gen=None) -> Draft:
        k = limit or self.k
        n_ctx = len(context)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = context[n_ctx - n :]
            # search backwards for the most recent match that is not the tail itself
            for start in range(n_ctx - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    follow = context[start + n : start + n + k]
                    if follow:
                        return Draft(tokens=follow, parents=list(range(-1, len(follow) - 1)))
        return Draft()
