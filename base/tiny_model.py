"""Deterministic tiny Llama model + byte-level BPE tokenizer, built locally with no downloads.

Recipe (docs/design.md §5): Llama, hidden 128, 2 layers, 4 heads, vocab 2,048 byte-level BPE trained with
`tokenizers` on text generated from a fixed seed, ChatML chat template, bf16. Every input is fixed (seeds, corpus,
single-threaded training), so two builds give byte-identical files.

The MoE variant (`moe=True`) is the same with Mixtral's sparse layers (4 experts, 2 per token): vLLM runs data
parallelism with one server per rank only for MoE models, so the `ranks` mode needs one to be tested.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
from pathlib import Path

CORPUS_SEED = 20261129
WEIGHTS_SEED = 1234
VOCAB_SIZE = 2048
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
INTERMEDIATE_SIZE = 256
NUM_EXPERTS = 4
EXPERTS_PER_TOKEN = 2
MAX_POSITION_EMBEDDINGS = 2048
# ChatML markers plus the Hermes tool-call tags (vLLM's `hermes` tool parser reads those).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
EOS_TOKEN = "<|im_end|>"
# The tool-call parser of those tags: a spec serving the tiny model has tool calling unless it says otherwise
# (`sluice check` asks a forced tool call).
TINY_TOOL_CALL_PARSER = "hermes"
SERVED_MODEL_NAME = "sluice-tiny"

CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}<|im_start|>assistant\n"
    "{% for call in message['tool_calls'] %}<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "te",
    "vo",
    "zi",
    "pa",
    "qu",
    "ex",
    "an",
    "or",
    "is",
    "stream",
    "token",
    "route",
    "replica",
    "serve",
    "queue",
    "hash",
    "ring",
    "data",
    "plane",
]
_PUNCTUATION = [".", ",", "!", "?", ":", ";", "{", "}", '"', "[", "]", "0", "1", "2", "7", "9"]


def _corpus(lines: int = 4000) -> list[str]:
    rng = random.Random(CORPUS_SEED)
    text = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 16)):
            word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.15:
                word += rng.choice(_PUNCTUATION)
            if rng.random() < 0.1:
                word = word.capitalize()
            words.append(word)
        text.append(" ".join(words))
    return text


def _build_tokenizer(out: Path) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))


def _build_weights(out: Path, eos_token_id: int, pad_token_id: int, moe: bool) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    config_class, model_class, extra = (
        (
            MixtralConfig,
            MixtralForCausalLM,
            {"num_local_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN},
        )
        if moe
        else (LlamaConfig, LlamaForCausalLM, {})
    )
    config = config_class(
        **extra,
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(WEIGHTS_SEED)
    model = model_class(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    model.save_pretrained(str(out), safe_serialization=True)


def build_tiny_model(out: Path, moe: bool = False) -> Path:
    """Write the tiny model (its MoE variant with `moe`) into `out` (created if missing) and return it."""
    out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    added = {t["content"]: t["id"] for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}
    token_ids = {**vocab, **added}
    _build_weights(out, eos_token_id=token_ids[EOS_TOKEN], pad_token_id=token_ids["<|endoftext|>"], moe=moe)
    return out


def is_built(path: Path) -> bool:
    return all((path / name).exists() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def ensure_built(path: Path, moe: bool = False) -> Path:
    """The tiny model (or its MoE variant) at `path`, built there first if it is not. A lock file beside the folder
    holds other processes (test workers, two deploys) until the build is whole, so none reads it half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_built(path):
            print(f"building the tiny {'MoE ' if moe else ''}model into {path}", flush=True)
            build_tiny_model(path, moe)
    return path
