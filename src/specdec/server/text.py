"""Generated token ids -> text deltas for streaming, with stop strings.

Each push decodes ALL generated ids and emits the new suffix, so a multi-byte UTF-8 character
whose bytes span two tokens is never split: while its bytes are incomplete the decode ends in
U+FFFD, which is held back until the next token completes it (or the stream ends). Text that
could be the beginning of a stop string is held back too; once a stop string appears, the text
before it is final and the stop string itself is never emitted (OpenAI semantics).
"""

from __future__ import annotations

import threading

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None, *, lock: threading.Lock | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already handed out
        self.stopped = False  # a stop string was found; the text is final
        self._text = ""
        self._lock = lock or threading.Lock()

    def _decode(self) -> str:
        with self._lock:
            return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_ids: list[int]) -> str:
        """Add newly generated ids; returns the text that is safe to emit now."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        text = self._decode()
        self._text = text
        for s in self.stop:
            # Search from just before what was emitted: a stop string may straddle the boundary,
            # but never lies wholly inside emitted text (that would have stopped earlier).
            idx = text.find(s, max(0, self.emitted - len(s) + 1))
            if idx >= 0 and (not self.stopped or idx < self._stop_at):
                self.stopped, self._stop_at = True, idx
        if self.stopped:
            return self._take(self._stop_at)
        end = len(text)
        while end > self.emitted and text[end - 1] == REPLACEMENT:
            end -= 1
        end -= self._partial_stop_len(text[:end])
        return self._take(end)

    def finish(self) -> str:
        """The rest of the text once generation has ended (an incomplete character included)."""
        if self.stopped:
            return ""
        return self._take(len(self._text))

    @property
    def text(self) -> str:
        return self._text[: self.emitted]

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self._text[self.emitted : end]
        self.emitted = end
        return out

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` (past what was emitted) that begins a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text) - self.emitted), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
