"""Where `sluice load`'s prompts get their tokenizer: `--tokenizer` names a `tokenizer.json`, a model folder that holds
one, or a Hugging Face Hub id (its `tokenizer.json`, from the local cache or the Hub). Checked before any load is
sent: the file must load and make prompts of an exact token count (`workloads.PromptMaker`), so a wrong tokenizer
fails the command in a line, not every Locust user at its first request.
"""

from __future__ import annotations

import re
from pathlib import Path

from loadtests.workloads import PromptMaker

TOKENIZER_FILE = "tokenizer.json"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# A prompt length the check makes once: a tokenizer that makes it makes any.
CHECK_PROMPT_TOKENS = 16


class TokenizerError(ValueError):
    """A `--tokenizer` that cannot make the campaign's prompts; the message says why."""


def tokenizer_file(source: str) -> Path:
    """The `tokenizer.json` that `source` names; TokenizerError when there is none."""
    path = Path(source)
    if path.is_file():
        return path
    if path.is_dir():
        if (path / TOKENIZER_FILE).is_file():
            return path / TOKENIZER_FILE
        raise TokenizerError(f"--tokenizer {source}: the folder holds no {TOKENIZER_FILE}")
    if not HUB_ID.fullmatch(source):
        raise TokenizerError(f"--tokenizer {source}: no such file or folder, nor a Hub id (org/name)")
    import huggingface_hub

    try:
        return Path(huggingface_hub.hf_hub_download(source, TOKENIZER_FILE))
    except Exception as error:  # offline, gated, missing: the Hub's own reason
        raise TokenizerError(f"--tokenizer {source}: no {TOKENIZER_FILE} from the Hugging Face Hub ({error})") from None


def checked_tokenizer(source: str) -> Path:
    """`tokenizer_file(source)`, once it made a prompt of an exact token count."""
    path = tokenizer_file(source)
    try:
        PromptMaker(path).prompt(CHECK_PROMPT_TOKENS)
    except Exception as error:  # an unreadable file, a vocabulary without whole words
        raise TokenizerError(f"--tokenizer {source}: it cannot make the campaign's prompts ({error})") from None
    return path
