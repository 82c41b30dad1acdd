"""engine.allocator: expandable segments chosen before CUDA starts, a user's own settings kept."""

from __future__ import annotations

import sys
import types

from engine.allocator import EXPANDABLE, prefer_expandable_segments


def fake_torch(initialized: bool) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_initialized=lambda: initialized)  # type: ignore[attr-defined]
    return torch


def test_set_when_nothing_is_configured_and_cuda_has_not_started(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", fake_torch(initialized=False))
    environ: dict[str, str] = {}
    assert prefer_expandable_segments(environ) is True
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}


def test_a_users_setting_is_kept() -> None:
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        environ = {name: "expandable_segments:False"}
        assert prefer_expandable_segments(environ) is False
        assert environ == {name: "expandable_segments:False"}


def test_not_set_once_cuda_has_started(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", fake_torch(initialized=True))
    environ: dict[str, str] = {}
    assert prefer_expandable_segments(environ) is False and environ == {}


def test_specexec_sets_it_before_its_command_runs(monkeypatch) -> None:
    import specexec.__main__ as cli

    monkeypatch.setitem(sys.modules, "torch", fake_torch(initialized=False))
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # recorded first, so the test leaves the environment as it found it
        monkeypatch.delenv(name)
    seen = {}
    monkeypatch.setattr(cli, "parse", lambda argv: types.SimpleNamespace(
        func=lambda args: seen.setdefault("conf", cli.os.environ.get("PYTORCH_CUDA_ALLOC_CONF")) and 0))
    assert cli.main(["generate"]) == 0
    assert seen["conf"] == EXPANDABLE
