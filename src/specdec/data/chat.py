"""The one way specdec turns a conversation into tokens: regenerate, capture, train and eval all
call `render` / `prompt_ids`, so the drafter trains on exactly the token layout the target serves.

`render` uses the tokenizer's own chat template. The loss mask is 1 exactly on assistant content
and on the end-of-turn token that closes each assistant message (so the drafter learns to stop);
everything else (system, user turns, role headers, the newline after an end-of-turn) is 0.

How the mask is found, for any template: the conversation is rendered as text once; for assistant
message i, the text of `messages[:i]` with the generation prompt and the text of `messages[:i+1]`
are prefixes of it, and the characters between them are that message's span. The span is cut
right after its end-of-turn marker (eos and the usual end-of-turn specials). The full text is
tokenized once and a token is masked when its characters overlap a span; tokenizers without
offsets fall back to token counts of text prefixes. Templates that rewrite history (so a prefix is
not a prefix) fall back to locating the assistant content in the full text.

Tokenizers without a chat template use a plain, documented format:

    {system}\\n\\n                    (only if a system message is present)
    User: {content}\\n
    Assistant: {content}{eos}\\n
    ...
    Assistant:                      (the generation prompt)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import SpecdecError

FALLBACK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token or '' }}\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# End-of-turn markers of common templates; only those the tokenizer knows are used.
END_OF_TURN = (
    "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>",
    "<｜end▁of▁sentence｜>", "<|end_of_text|>", "[/ASSISTANT]", "<|return|>",
)  # fmt: skip


@dataclass(frozen=True)
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant content + its end-of-turn token, else 0

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def _template(tokenizer) -> str | None:
    return None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE


def render_text(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
    """The chat-template text of `messages` (fallback format when there is no template)."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            msgs,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=_template(tokenizer),
        )
    except Exception as e:  # jinja raises TemplateError for e.g. non-alternating roles
        roles = "/".join(m["role"] for m in msgs)
        raise SpecdecError(
            f"the chat template rejected a conversation with roles {roles}: {e}; expected roles "
            f"the template accepts (usually alternating user/assistant after an optional system)"
        ) from e
    if not isinstance(text, str):  # some versions return a list for batched input
        text = text[0]
    return text


def stop_strings(tokenizer) -> list[str]:
    """The eos token and the end-of-turn markers of common templates that this tokenizer knows."""
    out = []
    eos = getattr(tokenizer, "eos_token", None)
    if eos:
        out.append(str(eos))
    for s in END_OF_TURN:  # get_vocab() would copy a 150k-entry dict on every call
        if s in out:
            continue
        i = tokenizer.convert_tokens_to_ids(s)
        if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == s:
            out.append(s)
    return out


def _tokenize(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, KeyError, TypeError, ValueError):
        enc = tokenizer(text, add_special_tokens=False)
        offsets = None
    ids = enc["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return list(ids), offsets


def _assistant_spans(tokenizer, messages: Sequence[dict], full: str) -> list[tuple[int, int]]:
    stops = stop_strings(tokenizer)
    spans = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        content = m["content"]
        start = end = -1
        try:
            before = render_text(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
            through = render_text(tokenizer, messages[: i + 1])
        except SpecdecError:
            before = through = None
        if (
            before is not None
            and full.startswith(through)
            and through.startswith(before)
            and len(before) >= cursor
        ):
            start, end = len(before), len(through)
        else:  # the template rewrites earlier turns: find the content itself
            pos = full.find(content, cursor) if content else -1
            if pos < 0:
                raise SpecdecError(
                    f"could not locate assistant message {i} in the rendered chat template "
                    f"output; expected the template to reproduce assistant content verbatim"
                )
            start = pos
            end = pos + len(content)
            tail = full[end:]
            for s in stops:  # extend over an end-of-turn marker that directly follows
                stripped = tail.lstrip(" ")
                if stripped.startswith(s):
                    end += len(tail) - len(stripped) + len(s)
                    break
        # Cut the span right after the end-of-turn marker that closes the content.
        seg = full[start:end]
        after = seg.find(content) + len(content) if content and content in seg else 0
        cut = -1
        for s in stops:
            k = seg.find(s, after)
            if k >= 0 and (cut < 0 or k + len(s) < cut):
                cut = k + len(s)
        end = start + cut if cut >= 0 else start + len(seg.rstrip())
        if end > start:
            spans.append((start, end))
        cursor = end
    return spans


def render(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> Rendered:
    """Token ids of `messages` under the tokenizer's chat template, with the assistant loss mask."""
    if not messages and not add_generation_prompt:
        return Rendered([], [])
    full = render_text(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    ids, offsets = _tokenize(tokenizer, full)
    spans = _assistant_spans(tokenizer, messages, full)
    mask = [0] * len(ids)
    if offsets is not None:
        j = 0
        for t, (a, b) in enumerate(offsets):
            while j < len(spans) and spans[j][1] <= a:
                j += 1
            if j < len(spans) and a < spans[j][1] and b > spans[j][0]:
                mask[t] = 1
            elif j < len(spans) and a == b and spans[j][0] <= a < spans[j][1]:
                mask[t] = 1  # zero-width token inside a span
    else:
        for s, e in spans:
            lo = len(_tokenize(tokenizer, full[:s])[0])
            hi = len(_tokenize(tokenizer, full[:e])[0])
            for t in range(lo, min(hi, len(ids))):
                mask[t] = 1
    return Rendered(ids, mask)


def prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """The ids the target sees before answering: every message but a trailing assistant one,
    followed by the generation prompt."""
    msgs = list(messages)
    if msgs and msgs[-1]["role"] == "assistant":
        msgs = msgs[:-1]
    return render(tokenizer, msgs, add_generation_prompt=True).input_ids
