"""The prompt tokens vLLM will compute for a forwarded OpenAI body, from the served model's own files.

Chat bodies are rendered with the model's chat template and tokenized without special tokens, as vLLM's chat path
does (`safe_apply_chat_template`: the template, the body's `tools`, `add_generation_prompt`,
`continue_final_message` and `chat_template_kwargs`); text parts of a message's content are joined with newlines,
as vLLM does for templates that take string content. Completion bodies are tokenized with special tokens, as
vLLM's completion path does; a token-id prompt is taken as it is. Anything else (a batch of prompts, images or
audio, a body that does not parse) has no prompt here: the policy routes it by load. The tokenizer and template load
once per router (`transformers`, imported on first use).

Tokenizing is most of a decision's cost (about 1-2 µs a token here). A rendered chat splits at the tokenizer's added
tokens (`<|im_start|>`, ...), and the text between them is tokenized on its own by the tokenizer anyway, so the
pieces are cached: a shared system prompt or a conversation's earlier turns are tokenized once per router. Only for
tokenizers whose added tokens strip no neighbouring spaces, where the split is exact; others encode the whole text.

The body is a client's: `chat_template_kwargs` naming `chat_template` or `tokenize` are refused as vLLM refuses them
(it answers 400; the router routes such a request by load and renders nothing: a client's template is a program),
and only the kwargs that are variables of the model's own template reach it, as in vLLM. The piece cache is bounded
by characters (`PIECE_CACHE_CHARS`), a piece longer than `PIECE_MAX_CHARS` is never kept, and only the prompt's first
`MAX_PROMPT_CHARS` characters are tokenized.

A caller that only needs the prompt as far as it can change its decision passes `read_on(tokens)`: before a new
piece is tokenized, and after the first `HEAD_CHARS` of a long new piece, a leading part it has no use beyond ends the
work (for kv_aware: one no replica holds, or only one does), so a new 1k-token prompt costs its first few blocks, not
its whole length (and when it reads on, the rest is encoded from the cut: no token twice). The head is cut before a
space that follows a non-space, where a tokenizer that splits words at spaces first (byte-level BPE, Metaspace,
whitespace) gives exactly the leading tokens of the whole piece; for any other tokenizer every piece is encoded whole.
The pieces a decision left unread are read and cached by `read_left_pieces`, which the router calls once the
decision's answer is out: the next prompt that needs them (the second request of a new system prompt, which one
replica now holds) finds them cached instead of paying their whole length inside its decision (measured here: 5.7 ms
for a new 1,536-token piece, 0.1 ms cached).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

# Rendered chats' pieces kept per router, by their characters in all (about 2M tokens' worth of text, with their ids
# some tens of MiB): a few hundred system prompts and live conversations' turns.
PIECE_CACHE_CHARS = 8 * 1024 * 1024
# A piece longer than this is tokenized each time it comes: a few such pieces would fill the cache alone.
PIECE_MAX_CHARS = 64 * 1024
# The prompt text tokenized at most (a completion's prompt, a rendered chat): about 16k tokens of English, hundreds
# of KV blocks of any size (enough to tell apart the prefixes requests share), at ~1.5 µs a token ~25 ms at worst on
# the router's loop; past it a prompt's blocks are not scored (`routing.body_buffer_bytes` may reach 64 MiB).
MAX_PROMPT_CHARS = 64 * 1024
# Chat template kwargs vLLM refuses from a request (`resolve_chat_template_kwargs`).
REFUSED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})
# Pieces left unread by decisions, kept to be read after them: a burst of new prompts' pieces.
UNREAD_PIECES = 64
# The head of a long new piece tokenized first: about 200 tokens of English, more than one KV block of any common
# size (16-128 tokens), so `read_on` can answer after it. Only pieces over twice this long are cut.
HEAD_CHARS = 1024
# Pre-tokenizers that split words at spaces before the model merges anything: a cut before " word" is exact.
_SPLIT_AT_SPACES = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}

# Whether the prompt past these leading tokens can still change a decision (some cache may match further).
ReadOn = Callable[[Sequence[int]], bool]
# The prompt tokens of a forwarded body, or None when it holds no prompt the router can render; given `ReadOn`,
# possibly only their leading part (`PromptTokens.tokens`).
Tokenize = Callable[[bytes, ReadOn | None], list[int] | None]


def _splits_at_spaces(pre_tokenizer: dict[str, Any] | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_splits_at_spaces(step) for step in pre_tokenizer.get("pretokenizers", []))
    if pre_tokenizer.get("type") == "ByteLevel":
        return bool(pre_tokenizer.get("use_regex", True))
    if pre_tokenizer.get("type") == "Metaspace":
        return pre_tokenizer.get("split", True) is not False
    return pre_tokenizer.get("type") in _SPLIT_AT_SPACES


def head_cut(text: str) -> int | None:
    """Where to cut a long text's head: the last space within `HEAD_CHARS` that follows a non-space; None for a text
    too short to cut, or one without such a space."""
    if len(text) <= 2 * HEAD_CHARS:
        return None
    cut = text.rfind(" ", 1, HEAD_CHARS)
    while cut > 0 and text[cut - 1].isspace():
        cut = text.rfind(" ", 1, cut - 1)
    return cut if cut > 0 else None


class PromptTokens:
    """`tokens(body)`: the prompt's token ids, or None."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.model_path = model_path
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._backend = self._tokenizer.backend_tokenizer
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._unread: deque[str] = deque(maxlen=UNREAD_PIECES)
        self._pieces_chars = 0
        self._template_variables = _template_variables(self._tokenizer.chat_template)
        added = self._tokenizer.added_tokens_decoder.values()
        self._added_ids = {token.content: self._tokenizer.convert_tokens_to_ids(token.content) for token in added}
        exact = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added)
        ordered = sorted(self._added_ids, key=len, reverse=True)
        self._splitter = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if exact and ordered else None
        self._cuts_heads = _splits_at_spaces(json.loads(self._backend.to_str()).get("pre_tokenizer"))
        # A completion's special tokens all lead (BOS): its head, encoded with them, begins the whole prompt's tokens.
        self._specials_lead = self._encode("x ka", specials=True)[-2:] == self._encode("x ka")[-2:]

    @property
    def cached_chars(self) -> int:
        """Characters of the pieces the cache holds."""
        return self._pieces_chars

    def text_tokens(self, text: str) -> list[int]:
        """A text's token ids, without special tokens."""
        return self._encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids))

    def __call__(self, body: bytes, read_on: ReadOn | None = None) -> list[int] | None:
        return self.tokens(body, read_on)

    def tokens(self, body: bytes, read_on: ReadOn | None = None) -> list[int] | None:
        """The prompt's token ids, or None; given `read_on`, possibly only their leading part: up to where
        `read_on` said no more."""
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(parsed, dict):
            return None
        try:
            if "messages" in parsed:
                return self._chat(parsed, read_on)
            return self._completion(parsed.get("prompt"), read_on)
        except Exception:  # a template that refuses these messages: vLLM answers 400; route by load here
            return None

    def _completion(self, prompt: Any, read_on: ReadOn | None) -> list[int] | None:
        if isinstance(prompt, str):
            prompt = prompt[:MAX_PROMPT_CHARS]
            cut = head_cut(prompt) if read_on is not None and self._cuts_heads and self._specials_lead else None
            if cut is not None:
                head = self._encode(prompt[:cut], specials=True)
                if not read_on(head):
                    return head
                return head + self._encode(prompt[cut:])
            return self._encode(prompt, specials=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        return None

    def _chat(self, body: dict[str, Any], read_on: ReadOn | None) -> list[int] | None:
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
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or REFUSED_TEMPLATE_KWARGS & kwargs.keys():
            return None
        text = self._tokenizer.apply_chat_template(
            conversation,
            tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            tokenize=False,
            **{name: value for name, value in kwargs.items() if self._reads(name)},
        )[:MAX_PROMPT_CHARS]
        if self._splitter is None:
            return self._encode(text)
        tokens: list[int] = []
        pieces = self._splitter.split(text)
        for index, piece in enumerate(pieces):
            added = self._added_ids.get(piece)
            if added is not None:
                tokens.append(added)
                continue
            if read_on is not None and piece not in self._pieces:
                if not read_on(tokens):
                    self._left_unread(pieces[index:])
                    return tokens
                cut = head_cut(piece) if self._cuts_heads else None
                if cut is not None:
                    head = self._encode(piece[:cut])
                    if not read_on(tokens + head):
                        self._left_unread(pieces[index:])
                        return tokens + head
                    tokens.extend(self._remember(piece, head + self._encode(piece[cut:])))
                    continue
            tokens.extend(self._piece(piece))
        return tokens

    def _left_unread(self, pieces: list[str]) -> None:
        """Pieces a decision did not need: read later (`read_left_pieces`), so the next prompt that needs them finds
        them cached."""
        for piece in pieces:
            if piece not in self._added_ids and piece not in self._pieces and len(piece) <= PIECE_MAX_CHARS:
                self._unread.append(piece)

    def read_left_pieces(self) -> None:
        """Tokenize and cache the pieces decisions left unread (off a decision's path: after its answer is out)."""
        while self._unread:
            piece = self._unread.popleft()
            if piece not in self._pieces:
                self._remember(piece, self._encode(piece))

    def _reads(self, kwarg: str) -> bool:
        return self._template_variables is None or kwarg in self._template_variables

    def _encode(self, text: str, specials: bool = False) -> list[int]:
        # The batch call without offsets: the same ids, in about 60 % of `encode`'s time.
        return self._backend.encode_batch_fast([text], add_special_tokens=specials)[0].ids

    def _remember(self, text: str, ids: list[int]) -> list[int]:
        if len(text) > PIECE_MAX_CHARS or text in self._pieces:
            return ids
        self._pieces[text] = ids
        self._pieces_chars += len(text)
        while self._pieces_chars > PIECE_CACHE_CHARS:
            evicted, _ = self._pieces.popitem(last=False)
            self._pieces_chars -= len(evicted)
        return ids

    def _piece(self, text: str) -> list[int]:
        ids = self._pieces.get(text)
        if ids is None:
            return self._remember(text, self._encode(text))
        self._pieces.move_to_end(text)
        return ids


_NOT_TEXT = object()


def _template_variables(template: str | dict[str, str] | None) -> frozenset[str] | None:
    """The names a chat template reads from its context (every named template's, for a tokenizer with several); None
    for a template this parser cannot read (a tag of transformers' own): then every kwarg vLLM does not refuse goes."""
    from jinja2 import TemplateSyntaxError, meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    sources = template.values() if isinstance(template, dict) else [template] if template else []
    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(
            name for source in sources for name in meta.find_undeclared_variables(environment.parse(source))
        )
    except TemplateSyntaxError:
        return None


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
