"""The simulator engine inside one Serve replica: a team file's `engine: sim` (`LLMAppConfig.engine_stand_in`).

The replica then starts no vLLM: its app is the simulator's (`openai_app.py`, with its KV event publisher on the
node's address and its engine load), timed from the stated model (`SimModel`'s defaults), and sluice's middleware
wraps it as it wraps vLLM's app, so the frontend, the routers and the KV subscriber meet it as they meet a vLLM
replica. For routing experiments at scale on machines without accelerators; never a served model.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from base.route_wire import KVEventSource
from routers.prompt_tokens import PromptTokens
from services.replica.sim.engine import SimEngine
from services.replica.sim.kv_publisher import SimKVPublisher
from services.replica.sim.model import SimModel
from services.replica.sim.openai_app import SimOpenAIApp, answer_tokens


@dataclass
class SimServeEngine:
    app: FastAPI
    engine: SimEngine
    publisher: SimKVPublisher

    @classmethod
    async def start(cls, model_path: str, served_name: str, replica_id: str, host: str) -> SimServeEngine:
        """The simulator for the model at `model_path` (its tokenizer and chat template), publishing on `host`."""
        tokens = PromptTokens(model_path)
        token_text = answer_tokens(tokens)
        publisher = SimKVPublisher()
        await publisher.start(host)
        engine = SimEngine(SimModel(), output_token_ids=list(token_text), publish=publisher.publish)
        source = KVEventSource(
            endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint, topic=publisher.topic
        )
        app = SimOpenAIApp(engine, tokens, served_name, replica_id, source, token_text).app
        return cls(app, engine, publisher)

    def shutdown(self) -> None:
        self.publisher.close()
