"""A user's mistakes in `specexec serve` are found before the model loads and answered in one line that
names what the user typed and says what to do, exit status 2; never a traceback after a full start.

`main` runs in-process with the server's start (`run_server`: listen, then load in a thread) replaced by a
recorder: every mistake here must stop `serve` before it. The typo under [server] runs in a subprocess to
show it is reported before torch is even imported."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from specexec.__main__ import main
from tests.helpers.tiny_models import make_tiny_pair

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), draft="random")
    return str(target), str(draft)


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> Iterator:
    """serve(*argv) -> (exit status, stderr lines); `started` lists the configs that reached run_server."""
    import server.serve

    started: list = []
    monkeypatch.setattr(server.serve, "run_server", lambda config, server_config: started.append(config))
    monkeypatch.setattr("engine.cli.apply_threads", lambda config: 1, raising=False)
    monkeypatch.setattr("specexec.__main__.apply_threads", lambda config: 1)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}

    def run(*argv: str) -> tuple[int, list[str]]:
        try:
            status = main(["serve", *argv])
        finally:
            for signum, handler in handlers.items():  # serve installs its own
                signal.signal(signum, handler)
        return status, capsys.readouterr().err.strip().splitlines()

    run.started = started  # type: ignore[attr-defined]
    yield run


def refused(serve, *argv: str) -> str:
    """The one line `serve ARGV` answered with, having stopped before run_server."""
    status, lines = serve(*argv)
    assert status == 2 and len(lines) == 1 and lines[0].startswith("specexec: error: "), lines
    assert serve.started == [], "the server started"
    return lines[0].removeprefix("specexec: error: ")


def test_the_pair_itself_is_served(serve, pair) -> None:
    """The recorder: a correct pair reaches run_server (so the refusals below are of the mistakes alone)."""
    status, _ = serve("--target", pair[0], "--draft", pair[1], "--port", "0")
    assert status == 0 and len(serve.started) == 1


def test_a_missing_draft_folder(serve, pair, tmp_path: Path) -> None:
    line = refused(serve, "--target", pair[0], "--draft", str(tmp_path / "no-such-draft"), "--port", "0")
    assert line.startswith(f"--draft {tmp_path / 'no-such-draft'}: no such model folder")


def test_a_folder_holding_no_model(serve, pair, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refused(serve, "--target", str(empty), "--draft", pair[1], "--port", "0")
    assert line.startswith(f"--target {empty}: no config.json there") and "point --target at" in line
    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    shutil.copy(Path(pair[1]) / "config.json", no_weights)
    line = refused(serve, "--target", pair[0], "--draft", str(no_weights), "--port", "0")
    assert line.startswith(f"--draft {no_weights}: config.json but no weights") and "hf download" in line


def test_a_draft_whose_vocabulary_differs(serve, pair, tmp_path: Path) -> None:
    other = tmp_path / "other-draft"
    shutil.copytree(pair[1], other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]  # two tokens' ids swapped: the same tokens, other ids
    first, second = (token for token, index in vocab.items() if index in (300, 301))
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(data))
    line = refused(serve, "--target", pair[0], "--draft", str(other), "--port", "0")
    assert "incompatible vocabularies" in line and str(other) in line and "must share the target's token ids" in line


def test_device_cuda_on_a_torch_without_cuda(serve, pair, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)  # as a CPU-only build of torch (this machine's, or not)
    line = refused(serve, "--target", pair[0], "--draft", pair[1], "--device", "cuda", "--port", "0")
    assert line.startswith("--device cuda: this torch") and "--device cpu" in line
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a CUDA build on a machine without a usable GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = refused(serve, "--target", pair[0], "--draft", pair[1], "--device", "cuda:0", "--port", "0")
    assert line.startswith("--device cuda:0: no CUDA device is usable")


def test_a_port_in_use_is_said_before_loading(serve, pair) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused(serve, "--target", pair[0], "--draft", pair[1], "--port", str(port))
    assert line.startswith(f"--port {port}: 127.0.0.1:{port} is already in use") and "--port (0" in line


@pytest.mark.parametrize(("argv", "toml", "expected"), [
    (["--method", "fast"], "", "--method: must be one of 'specexec', 'specinfer', 'rrs' or 'autoregressive', got 'fast'"),
    (["--budget", "lots"], "", "--budget: must be an integer >= 1 or 'auto', got 'lots'"),
    (["--extension-factor", "big"], "", "--extension-factor: must be an integer >= 1 or 'auto', got 'big'"),
    ([], "[speculation]\nextension_factor = 0\n", "speculation.extension_factor: must be an integer >= 1 or 'auto', "
                                                  "got 0"),
    (["--overlap", "maybe"], "", "--overlap: must be true or false or 'auto', got 'maybe'"),
    (["--device", "gpu"], "", "--device: must be auto, cpu or cuda[:N], got 'gpu'"),
    (["--port", "70000"], "", "--port: must be an integer in [0, 65535], got 70000"),
    ([], "[speculation]\nmethod = 5\n", "speculation.method: must be one of 'specexec', 'specinfer', 'rrs' or "
                                        "'autoregressive', got 5"),
    ([], "[offload]\nring_size = \"two\"\n", "offload.ring_size: must be an integer, got 'two'"),
    ([], "[server]\ncors_origins = 5\n", "server.cors_origins: must be a list of strings, got 5"),
])
def test_errors_name_what_was_typed_not_python_types(serve, pair, tmp_path: Path, argv: list[str], toml: str,
                                                     expected: str) -> None:
    config = []
    if toml:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
        config, expected = ["--config", str(path)], f"{path}: {expected}"
    assert refused(serve, "--target", pair[0], "--draft", pair[1], *config, *argv) == expected


def test_a_typo_under_server_is_reported_before_anything_loads(pair, tmp_path: Path) -> None:
    """Before torch is imported or a model is looked at (it took 18 s on a busy machine: torch first)."""
    path = tmp_path / "typo.toml"
    path.write_text(f'[model]\ntarget = "{pair[0]}"\ndraft = "{pair[1]}"\n\n[server]\nprot = 8001\n')
    code = ("import sys\nfrom specexec.__main__ import main\nstatus = main(['serve', '--config', sys.argv[1]])\n"
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\nsys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 2 and done.stdout.strip() == "torch not imported", (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == [f"specexec: error: {path}: server.prot: unknown field (known: "
                                                "allowed_hosts, api_key, chat_template, chat_template_kwargs, cors_origins, generation_config, "
                                                "grammar_timeout, host, json_whitespace, log_level, max_body_bytes, "
                                                "max_connections, ping_seconds, port, read_timeout, reasoning_format, served_model_name, "
                                                "shutdown_timeout, tool_parser, webui)"]
