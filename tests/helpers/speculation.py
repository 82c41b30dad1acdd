"""Speculation settings tests share."""

# speculation.specinfer_temperature above any request's temperature (the API's largest is 2): a
# specexec engine grows SpecExec trees at every temperature, so a test parametrized by method tests
# the trees it names
NAMED_TREES = 3.0


def config_from_flags(*flags: str):
    """The EngineConfig the CLI makes of `--target t --draft d` and `flags` (folders not checked)."""
    import argparse

    from engine.cli import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(["--target", "t", "--draft", "d", *flags]), require_folders=False)[0]
