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


def fix_unseeded_entropy(monkeypatch, start: int = 0) -> None:
    """Unseeded requests' generators seeded start, start + 1, ... instead of from the OS: the unseeded
    sampling path is unchanged (params.seed stays None, each request its own generator), its draws are
    reproducible, so a chi-square test of it fails every run or none (not 0.2% of runs at random)."""
    import itertools

    import engine.runtime
    from engine.speculation.sampling import make_generator

    seeds = itertools.count(start)

    def fixed(seed, device):
        return make_generator(next(seeds) if seed is None else seed, device)

    monkeypatch.setattr(engine.runtime, "make_generator", fixed)
