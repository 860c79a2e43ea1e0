"""What a multi-turn campaign knows a cache could reuse: the token ids vLLM streams back (`return_token_ids`), and
each turn's leading tokens that the session's previous turn computed."""

from __future__ import annotations

import json

from loadtests.sse_timing import StreamOutput, StreamRow, record_stream
from loadtests.workloads import Conversation


def _lines(*events: dict[str, object]) -> list[tuple[float, str]]:
    return [(0.1 * (i + 1), f"data: {json.dumps(event)}") for i, event in enumerate(events)] + [(1.0, "data: [DONE]")]


def test_a_stream_with_token_ids_returns_the_prompts_and_the_answers_ids() -> None:
    row = StreamRow("multi_turn", "s", 0.0, 0.0)
    output = record_stream(
        row,
        200,
        {},
        0.05,
        _lines(
            {"prompt_token_ids": [1, 2, 3], "choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": " ka"}, "token_ids": [7]}]},
            {"choices": [{"delta": {"content": " lo mi"}, "token_ids": [8, 9]}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
        ),
    )
    assert output == StreamOutput(" ka lo mi", [1, 2, 3], [7, 8, 9])
    assert (row.chunks, row.prompt_tokens, row.output_tokens) == (2, 3, 3)


def test_a_turn_reuses_its_previous_turns_prompt_and_answer_up_to_the_first_differing_token() -> None:
    conversation = Conversation("s", 3)
    assert conversation.answered(StreamOutput(" a", [1, 2, 3], [7, 8])) == 0, "a first turn reuses nothing"
    # The answer [7, 8] re-rendered as [7, 5]: the turn reuses the prompt and the answer's first token.
    assert conversation.answered(StreamOutput(" b", [1, 2, 3, 7, 5, 4], [9, 9])) == 4
    assert conversation.messages == [{"role": "assistant", "content": " a"}, {"role": "assistant", "content": " b"}]
    # The last answer token was sampled and never computed: a prompt holding all of it still reuses one less.
    assert conversation.answered(StreamOutput("", [1, 2, 3, 7, 5, 4, 9, 9, 6], [])) == 7
    assert conversation.answered(StreamOutput("", [], [])) == 0, "a server that sends no ids: nothing known"
