"""`sluice load --input-len N --output-len M --range-ratio R`: the lengths a campaign's requests ask for.

A length given replaces the workload's own wherever it draws one (a single request's prompt and decode, mixed's two
kinds alike, a multi-turn turn, a shared-prefix question and answer); a dataset's output length stands unless
`--output-len` is given (`vllm bench serve --sharegpt-output-len` overrides the same way). `range_ratio` r draws
every length uniformly from [n(1 - r), n(1 + r)], at least 1 token, as `vllm bench serve --random-range-ratio` draws
its random dataset's; 0 keeps every length exact.
"""

from __future__ import annotations

import math
import random

from pydantic import BaseModel, ConfigDict, Field


class Lengths(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    input_len: int | None = Field(None, ge=1)
    output_len: int | None = Field(None, ge=1)
    range_ratio: float = Field(0.0, ge=0, lt=1)

    def prompt_tokens(self, workload_tokens: int, chooser: random.Random) -> int:
        """A prompt's length: `input_len`, or the workload's, spread by the ratio."""
        return self.spread(self.input_len or workload_tokens, chooser)

    def output_tokens(self, workload_tokens: int, chooser: random.Random, dataset_tokens: int | None = None) -> int:
        """An answer's length: `output_len`, else the dataset's, else the workload's, spread by the ratio."""
        return self.spread(self.output_len or dataset_tokens or workload_tokens, chooser)

    def spread(self, tokens: int, chooser: random.Random) -> int:
        if not self.range_ratio:
            return tokens
        low = max(1, math.floor(tokens * (1 - self.range_ratio)))
        return chooser.randint(low, max(low, math.ceil(tokens * (1 + self.range_ratio))))
