"""Step timing: events on the compute stream (never a device-wide sync), prefill synced before step one."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, LimitsConfig, ModelConfig, SpeculationConfig
from engine.offload import device as device_ops
from engine.offload.device import PhaseClock, synchronize_stream
from engine.runtime import Engine
from engine.types import Request, SamplingParams
from tests.helpers.tiny_models import make_tiny_pair

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=6)
    return str(target), str(draft)


def load(pair: tuple[str, str], device: str = "auto") -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1], device=device),
        speculation=SpeculationConfig(budget=16, max_depth=6),
        limits=LimitsConfig(max_context=256),
    ))


def assert_stats_add_up(engine: Engine) -> None:
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)
    deltas = list(engine.generate(Request("r", [5, 6, 7, 8, 9], params)))
    steps = [d.stats for d in deltas if d.stats is not None]
    assert len(steps) >= 2
    for stats in steps:
        assert stats.draft_seconds >= 0 and stats.target_seconds >= 0
        assert stats.draft_seconds + stats.target_seconds <= stats.step_seconds
    totals = deltas[-1].totals
    assert totals is not None and totals.draft_seconds + totals.target_seconds <= totals.decode_seconds


def test_step_stats_add_up_on_cpu(pair) -> None:
    assert_stats_add_up(load(pair))


def test_draft_forwards_count_the_draft_passes_before_the_target_pass(pair) -> None:
    """PassStats.draft_forwards: every draft pass of the step's lockstep growth (two requests' trees share
    each one), counted at the draft runner (in steps that write no prompt: the draft's prefill is not growth)."""
    engine = load(pair)
    calls: list[int] = []
    forward_groups = engine.pair.draft.forward_groups
    engine.pair.draft.forward_groups = lambda groups: (calls.append(1), forward_groups(groups))[1]
    for i, prompt in enumerate(([5, 6, 7, 8], [40, 41, 42])):
        engine.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    counted = 0
    while engine.num_running:
        calls.clear()
        output = engine.step()
        if output.stats is not None and output.stats.num_prefill_tokens == 0:
            assert output.stats.draft_forwards == len(calls)
            counted += len(calls) > 0
    assert counted >= 2


def test_the_first_step_prefills_the_prompt_in_its_target_pass(pair) -> None:
    """A joining request's prompt is written by the first step's one target pass (no pass of its
    own); the time to that first step's end is the request's prefill time."""
    engine = load(pair)
    prompt = list(range(5, 25))
    deltas = list(engine.generate(Request("r", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))))
    steps = [d.stats for d in deltas if d.stats is not None]
    assert steps[0].pass_tokens == len(prompt) - 1 + steps[0].tree_size
    assert all(s.pass_tokens == s.tree_size for s in steps[1:])
    totals = deltas[-1].totals
    assert totals is not None and totals.prefill_seconds >= steps[0].step_seconds
    assert totals.target_passes == len(steps)


# -- the CUDA branch with fake events: no torch.cuda.synchronize anywhere -------------------


class FakeEvent:
    recorded: list[FakeEvent] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.stream = None
        self.synchronized = False

    def record(self, stream) -> None:
        self.stream = stream
        self.at = len(FakeEvent.recorded) * 7.0  # ms: 0, 7, 14, ...
        FakeEvent.recorded.append(self)

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at - self.at


class FakeStream:
    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeStream:
    stream = FakeStream()
    FakeEvent.recorded = []

    def no_device_sync(*args, **kwargs):
        raise AssertionError("device-wide torch.cuda.synchronize")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", no_device_sync)
    return stream


def test_phase_clock_uses_compute_stream_events(fake_cuda: FakeStream) -> None:
    clock = PhaseClock(CUDA)
    clock.mark()
    clock.mark()
    assert clock.seconds() == [0.007, 0.007]
    assert [event.stream for event in FakeEvent.recorded] == [fake_cuda] * 3
    assert [event.synchronized for event in FakeEvent.recorded] == [False, False, True]  # the last only


def test_synchronize_stream_waits_on_the_compute_stream_only(fake_cuda: FakeStream) -> None:
    synchronize_stream(CUDA)
    assert fake_cuda.synchronized == 1
    synchronize_stream(torch.device("cpu"))  # a no-op
    assert fake_cuda.synchronized == 1


def test_device_wide_synchronize_is_left_to_benchmarks(fake_cuda: FakeStream) -> None:
    with pytest.raises(AssertionError, match="device-wide"):
        device_ops.synchronize(CUDA)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_time_without_device_wide_syncs(pair, monkeypatch) -> None:
    engine = load(pair, device="cuda")

    def no_device_sync(*args, **kwargs):
        raise AssertionError("device-wide torch.cuda.synchronize")

    monkeypatch.setattr(torch.cuda, "synchronize", no_device_sync)
    assert_stats_add_up(engine)
