"""`poot serve -m MODEL` (also installed as `poot-serve`): the OpenAI-compatible HTTP server
(poot_core/server) over the batched engine.

The flags are checked, and the key file read, before the server starts; the server then listens at once and
loads the model in the background (/health is 503 until it is ready). SIGTERM or Ctrl-C stops accepting,
lets what runs finish for --drain seconds, gives the rest an error event, then exits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poot_core.cli import placed, runtime
from poot_core.cli.args import Parser
from poot_core.errors import RequestError

DEFAULT_CTX = 4096


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat, completions, embeddings, metrics)",
                       description="Serve a model over OpenAI's HTTP API with the batched engine.")
    add_flags(p)


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="a safetensors checkpoint directory or a .gguf file "
                   "(required)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    runtime.add_device_flags(p, DEFAULT_CTX)
    placed.add_flags(p)
    p.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model's name in the API (default: the checkpoint's file or directory name)")
    p.add_argument("--api-keys", metavar="FILE", default=None,
                   help="keys and tenants, one `KEY TENANT [rpm=N] [tpm=N] [running=N] [priority=N]` a line "
                        "(default: none, no key needed)")
    p.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="sequences one engine step may hold (default: the backend's, 32 on the CPU, 256 on a GPU)")
    p.add_argument("--max-queued", type=int, default=64, metavar="N",
                   help="requests accepted beyond --max-running; more are answered 429")
    p.add_argument("--step-tokens", type=int, default=None, metavar="N",
                   help="token budget of one engine step (decode tokens and prefill chunks; default: the "
                        "backend's, 256 on the CPU, 2048 on a GPU)")
    p.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="KV-pool blocks of 16 positions (default: what a quarter of free memory holds, at most "
                        "--max-running full windows)")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse KV blocks of equal prompt prefixes")
    p.add_argument("--embedding-model", metavar="DIR", default=None,
                   help="a sentence-transformers checkpoint served at /v1/embeddings")
    p.add_argument("--rerank-model", metavar="DIR", default=None,
                   help="a cross-encoder (or an embedding model, by cosine) served at /v1/rerank")
    p.add_argument("--embedding-rows", type=int, default=8, metavar="N", help="texts per encoder call")
    p.add_argument("--drain", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may take to finish")
    p.add_argument("--tool-call-parser", default=None, choices=("hermes", "mistral", "llama3_json", "pythonic"),
                   help="how tool calls are read from a free reply (vLLM's names; default: the chat template's "
                        "format)")
    p.set_defaults(run=run)


def check_flags(args: argparse.Namespace, check_model: bool = True) -> None:
    runtime.check_device_flags(args)
    for flag, value in (("--max-running", args.max_running), ("--step-tokens", args.step_tokens),
                        ("--embedding-rows", args.embedding_rows)):
        if value is not None and value < 1:
            raise RequestError(f"{flag} must be at least 1, got {value}")
    if args.max_queued < 0 or args.drain < 0:
        raise RequestError("--max-queued and --drain must be >= 0")
    if not 0 <= args.port < 65536:
        raise RequestError(f"--port must be in 0..65535, got {args.port}")
    if check_model and not Path(args.model).exists():
        raise RequestError(f"no checkpoint at {args.model}")
    for flag, value in (("--embedding-model", args.embedding_model), ("--rerank-model", args.rerank_model)):
        if value is not None and not Path(value).is_dir():
            raise RequestError(f"{flag} {value} is not a directory")


def _name(path: str) -> str:
    p = Path(path)
    return p.stem if p.is_file() else (p.name or p.resolve().name)


def engine_options(args: argparse.Namespace, executor: Any, config: Any) -> Any:
    """The DriverOptions of the serving engine the flags ask for on `executor` (the backend's defaults where a
    flag is not given)."""
    from poot_core import DriverOptions

    ctx = runtime.choose_context(args, config.max_positions, DEFAULT_CTX)
    step_tokens = args.step_tokens or executor.capabilities().defaults.step_tokens
    return DriverOptions(capacity=ctx, prefill_chunk=min(runtime.batch_size(args, executor), ctx, step_tokens),
                         kv_blocks=args.kv_blocks, step_tokens=step_tokens, max_running=args.max_running,
                         prefix_cache=not args.no_prefix_cache)


ModelOpener = Callable[[argparse.Namespace, Any], Any]  # (flags, executor) -> the ModelHandle to serve


def _open_checkpoint(args: argparse.Namespace, executor: Any) -> Any:
    from poot_core import ModelHandle

    return ModelHandle.load(args.model, options=runtime.load_options(args))


def _engine(args: argparse.Namespace, open_model: ModelOpener) -> tuple[Any, Any, Any]:
    """(executor, handle, serving engine) as the flags ask; over --tp/--pp ranks every rank makes it this way."""
    from poot_core import Layout

    executor = runtime.open_device(args)
    runtime.Threads(args.threads, args.threads_batch).for_decode()
    handle = open_model(args, executor)
    config = handle.config()
    if config.kind == "encoder":
        raise RequestError(f"{args.model} is an encoder model: serve it with --embedding-model")
    options = engine_options(args, executor, config)
    return executor, handle, placed.driver(args, handle, executor, options).serve(Layout.PAGED)


def _follow(args: argparse.Namespace, open_model: ModelOpener) -> int:
    """A rank other than 0 of `--tp/--pp`: the same engine, stepped as rank 0 says (server/ranks.py)."""
    from poot_core.server.ranks import follow

    follow(_engine(args, open_model)[2], args.coordinator)
    return 0


def _image_prompts(handle: Any, executor: Any, engine: Any) -> Any:
    """The model's ImagePrompts, whose vision tower runs on this process's device (None: the model takes no
    images). Over --tp/--pp ranks the engine's weights are this rank's share of the text model, so the tower,
    which rank 0 runs for the whole group, gets the weights no text step reads, uploaded whole."""
    from poot_core.distributed.executor import PlacedExecutor

    placed_executor = engine.driver.executor
    if not isinstance(placed_executor, PlacedExecutor):
        return handle.family.image_prompts(handle, executor, engine.driver.weights)
    if not handle.family.prompt_embeddings(handle.config()):
        return None
    return handle.family.image_prompts(handle, executor, placed_executor.upload_outside_steps(handle.store()))


def _loader(args: argparse.Namespace, open_model: ModelOpener) -> Any:
    def load(state: Any) -> Any:
        from poot_core import CrossEncoder, ModelHandle, SentenceEncoder
        from poot_core.server.bridge import EngineBridge
        from poot_core.server.encoders import EncoderWorker
        from poot_core.server.ranks import Lead
        from poot_core.server.state import Loaded

        executor, handle, engine = _engine(args, open_model)
        state.settings.max_running = engine.limits.max_running  # admission counts the backend's default too
        encoder = reranker = None
        if args.embedding_model is not None:  # encoders get executors of their own: they run in other threads
            encoder = EncoderWorker(SentenceEncoder.load(args.embedding_model, runtime.open_device(args),
                                                         rows=args.embedding_rows), _name(args.embedding_model))
        if args.rerank_model is not None:
            scorer = ModelHandle.load(args.rerank_model)
            kind = CrossEncoder if CrossEncoder.serves(scorer) else SentenceEncoder
            reranker = EncoderWorker(kind.from_handle(scorer, runtime.open_device(args), rows=args.embedding_rows),
                                     _name(args.rerank_model))
        images = _image_prompts(handle, executor, engine)  # None: text only
        coordinator = getattr(args, "coordinator", None)
        lead = Lead(coordinator) if coordinator is not None else None  # rank 0 of --tp/--pp
        bridge = EngineBridge(engine, images=images, lead=lead)  # type: ignore[arg-type]
        bridge.start()
        runtime.log(args, f"engine: window {engine.capacity}, {engine.pool.blocks} KV blocks of "
                          f"{engine.block_size}, backend {executor.name}")
        return Loaded(handle.text(), bridge, engine.capacity, encoder, reranker, images)

    return load


def run(args: argparse.Namespace, open_model: ModelOpener | None = None) -> int:
    """Serve until stopped. `open_model` gives the model instead of loading the checkpoint args.model names
    (the benchmarks serve random weights made on the device this way; args.model is then only its name)."""
    check_flags(args, check_model=open_model is None)
    spawned = placed.launch(args)  # --tp/--pp: N ranks run this command; rank 0 serves
    if spawned is not None:
        return spawned
    if getattr(args, "coordinator", None) is not None and not args.coordinator.first:
        return _follow(args, open_model or _open_checkpoint)
    try:
        import uvicorn

        from poot_core.server.app import create_app
        from poot_core.server.state import ServerState, Settings
        from poot_core.server.tenants import KeyRing
    except ImportError as exc:
        raise RequestError(f"the server needs {exc.name}: pip install 'poot-core[serve]'") from exc

    keys = KeyRing.load(args.api_keys) if args.api_keys else None
    # max_running is set from the engine once the model is loaded (the backend chooses it without --max-running)
    settings = Settings(args.served_model_name or _name(args.model), args.max_queued, args.max_running or 0, args.drain)
    settings.tool_call_parser = args.tool_call_parser
    state = ServerState(settings, keys)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="poot serve: %(message)s")
    failure: list[str] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if state.loaded is not None:  # stop taking requests; those running get --drain seconds
                state.loaded.bridge.begin_stop(args.drain)
            super().handle_exit(sig, frame)

    def on_load_failure(message: str) -> None:
        failure.append(message)
        server.should_exit = True

    app = create_app(state, _loader(args, open_model or _open_checkpoint), on_load_failure)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                            timeout_graceful_shutdown=int(args.drain) + 5, access_log=args.verbose)
    server = Server(config)
    if getattr(args, "coordinator", None) is not None:
        # uvicorn drains on SIGTERM, then raises it again under the handler it found; as rank 0 of --tp/--pp that
        # handler does nothing, so the rank returns and its parent sees a clean end instead of a killed rank
        signal.signal(signal.SIGTERM, lambda *_: None)
    print(f"poot serve: {settings.model} on http://{args.host}:{args.port}/v1 (loading)", file=sys.stderr,
          flush=True)
    server.run()
    if failure:
        print(f"poot serve: {failure[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`poot-serve`: the same as `poot serve`."""
    from poot_core.cli.main import _run

    parser = Parser(prog="poot-serve", description="Serve a model over OpenAI's HTTP API with the batched engine.")
    add_flags(parser)
    args = parser.parse_args(argv)
    args.command = "serve"
    return _run(args)


if __name__ == "__main__":
    raise SystemExit(main())
