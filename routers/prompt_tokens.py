"""The prompt tokens vLLM will compute for a forwarded OpenAI body, from the served model's own files.

Chat bodies are rendered with the model's chat template and tokenized without special tokens, as vLLM's chat path
does (`safe_apply_chat_template`: the template, the body's `tools`, `add_generation_prompt`,
`continue_final_message` and `chat_template_kwargs`); text parts of a message's content are joined with newlines,
as vLLM does for templates that take string content. Completion bodies are tokenized with special tokens, as
vLLM's completion path does; a token-id prompt is taken as it is. Anything else (a batch of prompts, images or
audio, a body that does not parse) has no prompt here: the policy routes it by load. The tokenizer and template load
once per router (`transformers`, imported on first use).

Tokenizing is most of a decision's cost (about 1 µs a token here). A rendered chat splits at the tokenizer's added
tokens (`<|im_start|>`, ...), and the text between them is tokenized on its own by the tokenizer anyway, so the
pieces are cached: a shared system prompt or a conversation's earlier turns are tokenized once per router. Only for
tokenizers whose added tokens strip no neighbouring spaces, where the split is exact; others encode the whole text.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

# Pieces of rendered chats kept per router: a few hundred system prompts and live conversations' turns.
PIECE_CACHE_SIZE = 4096


class PromptTokens:
    """`tokens(body)`: the prompt's token ids, or None."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.model_path = model_path
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._backend = self._tokenizer.backend_tokenizer
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        added = self._tokenizer.added_tokens_decoder.values()
        self._added_ids = {token.content: self._tokenizer.convert_tokens_to_ids(token.content) for token in added}
        exact = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added)
        ordered = sorted(self._added_ids, key=len, reverse=True)
        self._splitter = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if exact and ordered else None

    def __call__(self, body: bytes) -> list[int] | None:
        return self.tokens(body)

    def tokens(self, body: bytes) -> list[int] | None:
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(parsed, dict):
            return None
        try:
            if "messages" in parsed:
                return self._chat(parsed)
            return self._completion(parsed.get("prompt"))
        except Exception:  # a template that refuses these messages: vLLM answers 400; route by load here
            return None

    def _completion(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, str):
            return self._tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        return None

    def _chat(self, body: dict[str, Any]) -> list[int] | None:
        messages = body["messages"]
        if not isinstance(messages, list):
            return None
        conversation = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            content = _text(message.get("content"))
            if content is _NOT_TEXT:
                return None
            conversation.append({**message, "content": content})
        kwargs = body.get("chat_template_kwargs")
        text = self._tokenizer.apply_chat_template(
            conversation,
            tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            tokenize=False,
            **(kwargs if isinstance(kwargs, dict) else {}),
        )
        if self._splitter is None:
            return self._backend.encode(text, add_special_tokens=False).ids
        tokens: list[int] = []
        for piece in self._splitter.split(text):
            added = self._added_ids.get(piece)
            tokens.extend([added] if added is not None else self._piece(piece))
        return tokens

    def _piece(self, text: str) -> list[int]:
        ids = self._pieces.get(text)
        if ids is None:
            ids = self._pieces[text] = self._backend.encode(text, add_special_tokens=False).ids
            if len(self._pieces) > PIECE_CACHE_SIZE:
                self._pieces.popitem(last=False)
        else:
            self._pieces.move_to_end(text)
        return ids


_NOT_TEXT = object()


def _text(content: Any) -> Any:
    """A message's content as the template sees it: a string, None, or text parts joined; `_NOT_TEXT` for media."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return _NOT_TEXT
            parts.append(part["text"])
        return "\n".join(parts)
    return _NOT_TEXT
