"""The `specexec` command: generate, serve, plan, models, bench, build-default.

Parsing needs no torch: `specexec --help`, `specexec serve --help` and a mistyped flag answer before
any model library is imported. `plan`, `models`, `bench` and `build-default` are programs of their own
(engine/plan_cli.py, engine/models_cli.py, bench/, builder/); their modules are imported only when named.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from types import FrameType

from engine.cli import CliError, add_engine_arguments, apply_threads, engine_config_from_args, resolve_models
from engine.generate_cli import add_generate_arguments
from engine.types import CheckpointError, ConfigError, ContextLengthError, OffloadError
from server.serve import add_server_arguments

PROGRAMS = {  # `specexec NAME`: module (with add_arguments and run), description
    "bench": ("bench.decode", "benchmark autoregressive vs SpecInfer vs SpecExec (more: `specexec bench NAME --help`)"),
    "build-default": ("builder.build_default", "train the built-in default model pair"),
    "plan": ("engine.plan_cli", "device memory plan of a pair for a GPU size, without the GPU or the weights"),
    "models": ("engine.models_cli", "the models in the local Hugging Face cache, and the pairs they make on a GPU"),
}
BENCH_TOOLS = {  # `specexec bench NAME`: module, description
    "offload": ("bench.offload", "pass time resident vs streamed (ram, disk) and GB/s"),
    "quant": ("bench.quant", "bytes per pass and pass time: fp32 vs fp16 vs GPTQ 4-bit"),
    "load": ("bench.load_memory", "peak host memory (RSS) while loading an offloaded target"),
    "structured": ("bench.structured", "tokens per pass and step overhead with and without a JSON schema"),
    "scoring": ("bench.scoring", "SpecExec trees' expected tokens per pass by draft scoring temperature"),
    "serve": ("bench.serve", "concurrent streams through the HTTP server: tok/s, TTFT, tokens per pass"),
    "hardening": ("bench.hardening", "issue 29: small-request latency beside slow ones, /infill CPU, stream gaps, schemas, RSS"),
    "overlap": ("bench.overlap", "overlap off and on: draft, pass and step ms by budget, streams, a long prompt joining"),
    "self-draft": ("bench.self_draft", "tokens per pass: --draft self vs the pair's draft, by temperature and budget"),
    "hybrid": ("bench.hybrid", "a Gated DeltaNet hybrid pair against a standard one: tokens per pass, pass ms, state memory"),
}


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.generate_cli import run_generate
    from engine.model.preflight import check_pair

    config, _ = engine_config_from_args(args)
    check_pair(config)
    apply_threads(config)
    return run_generate(config, args)


def cmd_serve(args: argparse.Namespace) -> int:
    """Every mistake found before the load where it can be: the config file and flags (both sections, at
    once), the port, then the models (downloads, folders, device, vocabularies); then the server listens
    and loads the pair in a thread."""
    for signum in (signal.SIGTERM, signal.SIGINT):  # the server takes them over once it listens
        signal.signal(signum, stop_before_serving)
    from server.serve import check_port, run_server, server_config_from

    config, server_section = engine_config_from_args(args, require_folders=False)
    server_config = server_config_from(args, server_section, args.config)
    check_port(server_config.host, server_config.port)
    config = resolve_models(config)
    from engine.model.preflight import check_pair

    check_pair(config)
    apply_threads(config)
    run_server(config, server_config)
    return 0


def stop_before_serving(signum: int, frame: FrameType | None) -> None:
    """SIGTERM or Ctrl+C while `serve` imports, configures or downloads, before uvicorn handles signals
    (and again after it gave them back): a clean exit, 0 for SIGTERM as after a drain (rather than death
    by the signal, 143), 130 for Ctrl+C. Nothing is open yet (no port, no request), and an exception
    raised here would land inside whatever import is running (transformers' lazy modules turn it into a
    broken import that fails the load), or inside torch at the interpreter's exit, so the process ends
    at once."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(130 if signum == signal.SIGINT else 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specexec", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    add_engine_arguments(gen)
    add_generate_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_arguments(serve)
    add_server_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    for name, (_module, help_text) in PROGRAMS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # parsed by the program's own parser (main)
    return parser


def program_parser(prog: str, module_name: str, description: str) -> argparse.ArgumentParser:
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The arguments of `argv`; a program's module is imported only when its command is given."""
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCH_TOOLS:
        module, description = BENCH_TOOLS[argv[1]]
        return program_parser(f"specexec bench {argv[1]}", module, description).parse_args(argv[2:])
    if argv[:1] and argv[0] in PROGRAMS:
        module, description = PROGRAMS[argv[0]]
        if argv[0] == "bench":
            description += "; " + "; ".join(f"`bench {name}`: {text}" for name, (_, text) in BENCH_TOOLS.items())
        return program_parser(f"specexec {argv[0]}", module, description).parse_args(argv[1:])
    return build_parser().parse_args(argv)


def quiet_optional_imports() -> None:
    """torchao (pulled in by the gptq extra) logs import-time notices to stderr."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    quiet_optional_imports()
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ConfigError, CheckpointError, ContextLengthError, OffloadError) as exc:
        print(f"specexec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C in `generate` (`serve` installs its own handlers: stop_before_serving)
        return 130  # 128 + SIGINT
    except BrokenPipeError:  # `specexec generate ... | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail again
        return 141  # 128 + SIGPIPE, as shell tools report it


if __name__ == "__main__":
    sys.exit(main())
