"""The `specexec` command: generate, serve, bench, build-default."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.cli import CliError, add_engine_arguments, engine_config_from_args
from engine.types import CheckpointError, ConfigError, ContextLengthError, OffloadError


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.generate_cli import run_generate

    config, _ = engine_config_from_args(args)
    return run_generate(config, args)


def cmd_serve(args: argparse.Namespace) -> int:
    from server.serve import run_server, server_config_from

    config, server_section = engine_config_from_args(args)
    run_server(config, server_config_from(args, server_section, args.config))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specexec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    add_engine_arguments(gen)
    from engine.generate_cli import add_generate_arguments

    add_generate_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_arguments(serve)
    from server.serve import add_server_arguments

    add_server_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    add_optional_commands(sub)
    return parser


BENCH_TOOLS = {  # `specexec bench NAME`: module, description
    "offload": ("engine.tools.bench_offload", "pass time resident vs streamed (ram, disk) and GB/s"),
    "quant": ("engine.tools.bench_quant", "bytes per pass and pass time: fp32 vs fp16 vs GPTQ 4-bit"),
    "structured": ("engine.tools.bench_structured", "tokens per pass and step overhead with and without a JSON schema"),
    "scoring": ("engine.tools.bench_scoring", "SpecExec trees' expected tokens per pass by draft scoring temperature"),
    "serve": ("engine.tools.bench_serve", "concurrent streams through the HTTP server: tok/s, TTFT, tokens per pass"),
}


def add_optional_commands(sub: argparse._SubParsersAction) -> None:
    """Commands whose modules may be absent from a minimal install."""
    import importlib

    for name, module, help_text in (
        ("build-default", "engine.tools.build_default", "train the built-in default model pair"),
        (
            "bench",
            "engine.tools.bench",
            "benchmark autoregressive vs SpecInfer vs SpecExec; "
            + "; ".join(f"`bench {name}`: {text}" for name, (_, text) in BENCH_TOOLS.items()),
        ),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        cmd = sub.add_parser(name, help=help_text)
        mod.add_arguments(cmd)
        cmd.set_defaults(func=mod.run)


def bench_tool_parser(name: str) -> argparse.ArgumentParser:
    import importlib

    module_name, description = BENCH_TOOLS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"specexec bench {name}", description=description)
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)
    return parser


def quiet_optional_imports() -> None:
    """torchao (pulled in by the gptq extra) logs import-time notices to stderr."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    quiet_optional_imports()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in BENCH_TOOLS:
        args = bench_tool_parser(argv[1]).parse_args(argv[2:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ConfigError, CheckpointError, ContextLengthError, OffloadError) as exc:
        print(f"specexec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C before the server took over the signal (loading, imports)
        return 130  # 128 + SIGINT
    except BrokenPipeError:  # `specexec generate ... | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail again
        return 141  # 128 + SIGPIPE, as shell tools report it


if __name__ == "__main__":
    sys.exit(main())
