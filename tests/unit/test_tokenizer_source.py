"""`sluice load --tokenizer`: a tokenizer.json, a folder holding one, or a Hub id, checked before any load is sent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest

from loadtests.tokenizer_source import TokenizerError, checked_tokenizer
from tests.support.known_timing_server import start

ROOT = Path(__file__).resolve().parents[2]


def test_a_file_or_a_model_folder_names_its_tokenizer(tiny_model_dir: Path) -> None:
    assert checked_tokenizer(str(tiny_model_dir)) == tiny_model_dir / "tokenizer.json"
    assert checked_tokenizer(str(tiny_model_dir / "tokenizer.json")) == tiny_model_dir / "tokenizer.json"


def test_a_hub_id_is_fetched_from_the_hub_and_its_failure_named(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetched = []

    def from_cache(repo_id: str, filename: str) -> str:
        fetched.append((repo_id, filename))
        return str(tiny_model_dir / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", from_cache)
    assert checked_tokenizer("org/model-7b") == tiny_model_dir / "tokenizer.json"
    assert fetched == [("org/model-7b", "tokenizer.json")]

    def offline(repo_id: str, filename: str) -> str:
        raise OSError("the Hub cannot be reached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(TokenizerError, match="no tokenizer.json from the Hugging Face Hub .the Hub cannot be reached"):
        checked_tokenizer("org/model-7b")


def test_what_cannot_make_prompts_is_refused_naming_why(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="the folder holds no tokenizer.json"):
        checked_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="no such file or folder, nor a Hub id"):
        checked_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="cannot make the campaign's prompts"):
        checked_tokenizer(str(tmp_path))


def test_the_load_command_refuses_a_bad_tokenizer_before_any_load(tmp_path: Path) -> None:
    server, url = start()
    try:
        load = [sys.executable, "-m", "sluice.cli.main", "load", "mixed", "--target", url, "--out", str(tmp_path / "o")]
        result = subprocess.run([*load, "--tokenizer", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert result.returncode == 2 and "the folder holds no tokenizer.json" in result.stderr, result.stderr
    assert not (tmp_path / "o").exists(), "nothing ran"
