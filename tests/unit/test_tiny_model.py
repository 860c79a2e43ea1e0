import json
import subprocess
import sys
from pathlib import Path

import pytest

from base.tiny_model import EOS_TOKEN, EXPERTS_PER_TOKEN, HIDDEN_SIZE, NUM_EXPERTS, NUM_LAYERS, VOCAB_SIZE


def _build(outs: list[Path], *flags: str) -> None:
    """`sluice model build` into each folder, the builds at once (each is a process of its own)."""
    builds = [
        subprocess.Popen(
            [sys.executable, "-m", "sluice.cli.main", "model", "build", "--out", str(out), *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for out in outs
    ]
    for build in builds:
        _, stderr = build.communicate(timeout=300)
        assert build.returncode == 0, stderr.decode()[-2000:]


@pytest.mark.parametrize("flags", [(), ("--moe",)], ids=["dense", "moe"])
def test_two_builds_are_byte_identical(tmp_path: Path, flags: tuple[str, ...]) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    _build([first, second], *flags)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == (["MixtralForCausalLM"] if flags else ["LlamaForCausalLM"])
    if flags:
        assert (config["num_local_experts"], config["num_experts_per_tok"]) == (NUM_EXPERTS, EXPERTS_PER_TOKEN)


def test_transformers_loads_it_offline(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    assert model.config.hidden_size == HIDDEN_SIZE
    assert model.config.num_hidden_layers == NUM_LAYERS
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.eos_token == EOS_TOKEN
    assert next(model.parameters()).dtype == torch.bfloat16

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == prompt
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4


def test_a_build_under_way_holds_other_processes_until_the_folder_is_whole(tmp_path: Path) -> None:
    """Two processes asking for the same folder at once (test workers, two deploys): the second waits for the first's
    build and finds it whole, instead of reading a half-written folder or building over it."""
    out = tmp_path / "model"
    script = f"from pathlib import Path; from base.tiny_model import ensure_built; ensure_built(Path({str(out)!r}))"
    builds = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    printed = [build.communicate(timeout=300)[0] for build in builds]
    assert all(build.returncode == 0 for build in builds)
    assert sum("building" in text for text in printed) == 1, printed
    assert json.loads((out / "config.json").read_text())["hidden_size"] == HIDDEN_SIZE
