"""The GPU check (scripts/gpu-check.sh) on CPU: its refusal without CUDA, and every section's logic at
tiny shapes (`--allow-cpu --tiny`: CUDA-only probes stubbed). What it measures on a GPU is in its
report, never asserted here."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench.gpu_check import equality, links
from bench.gpu_check.__main__ import SECTIONS, main
from bench.gpu_check.build import build_checkpoints
from bench.gpu_check.context import CheckContext
from bench.gpu_check.plan import TINY, DraftVariant
from bench.gpu_check.probes import attention_backends, site_summary, sync_sites
from bench.gpu_check.report import Report
from bench.offload import streamed_runner

REPO = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("server", "fastapi", "uvicorn", "pydantic_settings", "sse_starlette", "openai")


def table(text: str, *header: str) -> list[list[str]]:
    """Body rows of the first markdown table whose header starts with the cells `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| " + " | ".join(header) + " |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_without_cuda_it_says_so_in_one_line_and_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--out", str(tmp_path / "gpu.md")]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device" in out
    assert not (tmp_path / "gpu.md").exists()


def test_the_script_runs_the_module_with_python3_and_exits_2_without_cuda():
    code = [
        line
        for line in (REPO / "scripts" / "gpu-check.sh").read_text().splitlines()
        if not line.startswith("#")
    ]
    assert any("python3 -m bench.gpu_check" in line for line in code)
    assert not any("pip " in line or "venv" in line for line in code)  # no installs, no virtual environment
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "CUDA_VISIBLE_DEVICES": "",
    }
    done = subprocess.run(["bash", "scripts/gpu-check.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stdout.count("\n") == 1 and "no CUDA device" in done.stdout


@pytest.mark.slow
def test_it_imports_engine_code_only():
    """The GPU machine has torch and transformers, not the server's packages."""
    modules = ", ".join(
        f"bench.gpu_check.{name}"
        for name in ("__main__", "build", "links", "equality", "overlap", "steps", "serving", "bench_row", "header",
                     "fullshape")
    )
    code = f"import sys, {modules}; print(sorted({{m.split('.')[0] for m in sys.modules}}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = set(eval(done.stdout))  # a printed list of module names
    assert not loaded & set(SERVER_ONLY)


@pytest.mark.slow
def test_tiny_run_on_cpu_reports_every_section(tmp_path, capsys):
    out = tmp_path / "report" / "gpu.md"
    args = ["--allow-cpu", "--tiny", "--work-dir", str(tmp_path / "work"), "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert out.read_text() == text
    for title, _ in SECTIONS.values():
        assert f"## {title}" in text
    summary = text.splitlines()[-1]
    assert summary.startswith(f"summary: {len(SECTIONS)} sections") and "; 0 FAILED; 0 MISMATCH;" in summary
    equal = table(text, "ring")
    assert [(r[0], r[1]) for r in equal] == [
        (s, c) for s in ("2", "3") for c in ("as is", "slowed below copy")
    ]
    assert all(r[2:5] == ["exact"] * 3 and r[-1] == "exact" for r in equal)
    assert [r[0] for r in table(text, "tokens")] == [str(n) for n in TINY.overlap_tokens]
    steps = table(text, "budget", "tree nodes")
    assert [(r[0], r[1]) for r in steps] == [
        (str(b), str(b + 1)) for b in TINY.budgets
    ]  # tree = budget + root
    assert all(r[4] == "n/a (CPU)" and r[6].endswith("GB") for r in steps)  # no peak on CPU; the plan's total
    kernels = table(text, "budget", "SDPA backend (tree pass, profiled)")
    assert [r[0] for r in kernels] == [str(b) for b in TINY.budgets]
    assert all(r[1] != "no SDPA op seen" and r[4] == r[5] == "n/a (CPU)" for r in kernels)
    assert len(table(text, "disk source read")) == 1
    assert [r[0] for r in table(text, "method")] == ["Autoregressive", "SpecExec"]
    draft_rows = table(text, "forward", "segments")
    assert [(r[0], r[1]) for r in draft_rows] == [(k, s) for k in ("eager", "graphs", "graphs per segment", "compiled",
                                                                   "compiled graphs")
                                                  for s in ("1", "1", "4", "4")]
    assert all(int(r[6]) > 0 for r in draft_rows[:12])  # aten ops a forward, counted eagerly (the static pass too)
    assert all(r[8] == r[9] == "-" for r in draft_rows)  # device memory: CUDA only
    assert "4 graphs captured a layout" in text and "compiled graphs 4 captured" in text  # a static pass per shape
    profiled = table(text, "forward", "segments x rows", "kernel")
    assert {(r[0], r[1]) for r in profiled} == {("graphs", "1 x 16"), ("graphs", "4 x 64"), ("graphs per segment", "4 x 64")}
    assert all(float(r[4]) > 0 for r in profiled)


def test_tiny_full_shape_section_runs_every_table(tmp_path, capsys):
    """The full-shape section rehearsed at tiny shapes: int4 layers packed for the compute device and
    streamed, a draft beside them, every table filled; on a GPU it only has to be run."""
    args = ["--allow-cpu", "--tiny", "--work-dir", str(tmp_path), "--sections", "fullshape"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "; 0 FAILED; 0 MISMATCH;" in text.splitlines()[-1]
    assert [r[0] for r in table(text, "rows per call")] == [str(n) for n in TINY.full.kernel_tokens]
    assert [r[0] for r in table(text, "tokens", "compute ms")] == ["1", *(str(b + 1) for b in TINY.full.budgets)]
    steps = table(text, "budget", "overlap", "streams")
    assert [(r[0], r[1], r[2], r[-1]) for r in steps] == [(str(b), o, str(s), v.name) for v in TINY.full.variants
                                                           for b in TINY.full.budgets
                                                           for o in ("off", "on") for s in TINY.full.streams]
    assert all(float(r[11]) >= 1 for r in steps)  # tokens per pass
    assert all(int(r[4]) > 0 for r in steps)  # draft forwards before the pass
    assert all(r[9] == "0" for r in steps if r[1] == "off") and any(int(r[9]) > 0 for r in steps if r[1] == "on")
    assert len(table(text, "budget", "overlap", "streams", "draft", "tokens/s / eager's")) == 8
    verdicts = table(text, "draft", "versus", "rows", "tokens/s ratio: geometric mean")
    assert [(r[0], r[1], r[2]) for r in verdicts] == [("graphs, 8x extension, host trees", "eager", "8")]
    assert verdicts[0][-1] in ("pays", "does not pay")
    assert len(table(text, "median step before ms")) == 1
    users = table(text, "acceptance (tokens per pass)")
    assert users[-1][0] == "autoregressive (same run)" and len(users) == 4


def test_a_run_short_of_time_skips_the_later_draft_variants_and_still_prints_every_table(tmp_path, capsys, monkeypatch):
    """--seconds: past the deadline no further draft variant starts; the baseline's rows, the join and the
    user table still print, and each measured row went to the log as it was measured."""
    import bench.gpu_check.__main__ as entry

    variants = (DraftVariant("eager", graphs=False), DraftVariant("graphs"), DraftVariant("graphs, fresh 8", fresh_forwards=8))
    monkeypatch.setattr(entry, "TINY", dataclasses.replace(TINY, full=dataclasses.replace(TINY.full, variants=variants)))
    args = ["--allow-cpu", "--tiny", "--work-dir", str(tmp_path), "--sections", "fullshape", "--seconds", "0"]
    assert main(args) == 0
    text, log = capsys.readouterr()
    assert "Not run: draft variants graphs, graphs, fresh 8 (the run's --seconds left" in text
    steps = table(text, "budget", "overlap", "streams")
    assert {r[-1] for r in steps} == {"eager"} and len(steps) == 2 * 2 * len(TINY.full.streams)
    assert sum(line.startswith("row: eager, budget") for line in log.splitlines()) == len(steps)
    assert len(table(text, "median step before ms")) == 1
    assert table(text, "acceptance (tokens per pass)")[-1][0] == "autoregressive (same run)"


def test_a_row_out_of_memory_is_reported_with_the_allocator_and_the_next_rows_run(tmp_path, capsys, monkeypatch):
    """--variants/--budgets/--streams narrow the full shape; a row whose step runs out of memory is a failed row
    (its error and the allocator's state, flagged: the plan accepted it) and the section goes on."""
    from bench.gpu_check import fullshape
    from engine.types import OutOfMemory

    step_row = fullshape.step_row

    def failing(ctx, base, budget, overlap, streams, draft):
        if overlap and streams == 2:
            failure = OutOfMemory("out of device memory on cuda:0 during a step of 2 request(s)")
            raise RuntimeError(f"a request failed: {failure}") from failure  # as run_steps raises it
        return step_row(ctx, base, budget, overlap, streams, draft)

    monkeypatch.setattr(fullshape, "step_row", failing)
    args = ["--allow-cpu", "--tiny", "--work-dir", str(tmp_path), "--sections", "fullshape", "--variants", "1",
            "--budgets", "16", "--streams", "1,2"]
    assert main(args) == 0
    text, log = capsys.readouterr()
    name = TINY.full.variants[1].name
    steps = table(text, "budget", "overlap", "streams")
    assert [(r[0], r[1], r[2], r[-1]) for r in steps] == [("16", "off", "1", name), ("16", "off", "2", name),
                                                           ("16", "on", "1", name)]
    assert f"Row failed: {name}, budget 16, overlap on, 2 stream(s): a request failed: out of device memory" in text
    assert "allocator: n/a (CPU)" in text and "out of memory under the cap the plan accepted" in text
    assert sum(line.startswith("row: ") for line in log.splitlines()) == 4


def test_the_built_weights_are_non_zero_and_differ_between_layers(tmp_path):
    checkpoints = build_checkpoints(TINY, tmp_path, torch.device("cpu"), torch.float32)
    with safe_open(checkpoints.target / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert all(bool(t.ne(0).all()) for t in tensors.values())
    for name in ("input_layernorm.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert not torch.equal(tensors[f"model.layers.0.{name}"], tensors[f"model.layers.1.{name}"])
    again = build_checkpoints(TINY, tmp_path, torch.device("cpu"), torch.float32)
    assert again.reused and again.target == checkpoints.target


def test_a_layer_streamed_from_another_layers_bytes_is_a_mismatch(tmp_path, monkeypatch):
    """What the equality section exists to catch: swap two layers' bytes in the RAM store, so the ring
    hands each layer the other's weights."""

    def mixed_up_runner(*args, **kwargs):
        runner = streamed_runner(*args, **kwargs)
        buffers = runner.layers.store.buffers
        buffers[0], buffers[1] = buffers[1], buffers[0]
        return runner

    monkeypatch.setattr(equality, "streamed_runner", mixed_up_runner)
    plan = dataclasses.replace(TINY, prefill_len=40, tree_nodes=17, max_stall_s=0.001)
    report = Report(None)
    ctx = CheckContext(plan, torch.device("cpu"), torch.float32, tmp_path, report)
    ctx.checkpoints = build_checkpoints(plan, tmp_path, ctx.device, ctx.dtype)
    equality.equality_section(ctx)
    assert report.mismatches == [f"ring {r}, {c}" for r in (2, 3) for c in ("as is", "slowed below copy")]
    assert not report.passed


def test_a_failing_section_is_a_failed_row_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    def broken(ctx):
        raise RuntimeError("copy exploded")

    monkeypatch.setattr(links, "copy_section", broken)
    args = ["--allow-cpu", "--tiny", "--work-dir", str(tmp_path), "--sections", "copy,disk"]
    assert main(args) == 1
    text = capsys.readouterr().out
    assert "| FAILED | RuntimeError: copy exploded" in text
    assert len(table(text, "disk source read")) == 1
    assert "1 FAILED (Plain copy bandwidth of one layer)" in text.splitlines()[-1]


@pytest.mark.parametrize(
    ("ops", "backends"),
    [
        (
            ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_efficient_attention"],
            ["memory-efficient"],
        ),
        (["aten::_efficient_attention_forward"], ["memory-efficient"]),
        (["aten::_scaled_dot_product_flash_attention"], ["flash"]),
        (["aten::_scaled_dot_product_flash_attention_for_cpu"], ["flash (CPU)"]),
        (["aten::_scaled_dot_product_cudnn_attention"], ["cudnn"]),
        (["aten::_scaled_dot_product_attention_math", "aten::bmm", "aten::softmax"], ["math"]),
        (["aten::bmm", "aten::softmax"], []),
    ],
)
def test_attention_backend_from_profiled_op_names(ops, backends):
    assert attention_backends(ops) == backends


def test_sync_sites_count_only_sync_warnings():
    def warning(message: str, filename: str, lineno: int) -> warnings.WarningMessage:
        return warnings.WarningMessage(UserWarning(message), UserWarning, filename, lineno)

    caught = [
        warning("called a synchronizing CUDA operation", "/x/engine/speculation/verify.py", 40),
        warning("something else", "/x/engine/speculation/step.py", 1),
        warning("called a synchronizing CUDA operation", "/x/engine/speculation/verify.py", 40),
        warning("called a synchronizing CUDA operation", "/x/engine/speculation/step.py", 130),
    ]
    sites = sync_sites(caught)
    assert sites == ["verify.py:40", "verify.py:40", "step.py:130"]
    assert site_summary(sites) == "verify.py:40 x2, step.py:130"


def test_host_syncs_are_attributed_to_the_thread_and_the_pass_that_made_them():
    """The overlapped pass runs in its own thread while the engine's thread grows the draft: a sync made
    in the pass counts for the pass (in whichever thread), the engine thread's own for the step."""
    import threading
    from types import SimpleNamespace

    from bench.gpu_check.probes import counted_syncs, marking_passes

    def sync() -> None:
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)

    runner = SimpleNamespace(forward_groups=lambda groups: sync())
    with counted_syncs(torch.device("cpu")) as caught, marking_passes(runner):
        thread = threading.Thread(target=runner.forward_groups, args=([],), name="target-pass")
        thread.start()
        thread.join()
        sync()  # the engine thread, outside the pass
        runner.forward_groups([])  # a pass in the engine thread (overlap off)
    assert [(s.thread, s.in_pass) for s in caught] == [("target-pass", True), ("MainThread", False),
                                                        ("MainThread", True)]


def test_the_allocator_by_stream_sums_segments_by_role_and_keeps_graph_pools_apart(monkeypatch):
    """allocator_by_stream on a made-up snapshot (no CUDA here): segments summed by the stream they were made for
    (device.stream_role), a CUDA graph's private pool apart, other devices left out."""
    from bench.gpu_check import probes
    from engine.offload import device as streams

    monkeypatch.setattr(streams, "_worker_streams", {11})
    monkeypatch.setattr(streams, "_main_thread_streams", {22})
    gb = 10**9
    segments = [
        {"device": 0, "stream": 0, "segment_pool_id": (0, 0), "total_size": 4 * gb, "allocated_size": 3 * gb},
        {"device": 0, "stream": 11, "segment_pool_id": (0, 0), "total_size": 2 * gb, "allocated_size": gb},
        {"device": 0, "stream": 11, "segment_pool_id": (0, 0), "total_size": gb, "allocated_size": 0},
        {"device": 0, "stream": 22, "segment_pool_id": (0, 0), "total_size": gb, "allocated_size": gb // 2},
        {"device": 0, "stream": 22, "segment_pool_id": (1, 0), "total_size": gb, "allocated_size": gb},
        {"device": 1, "stream": 0, "segment_pool_id": (0, 0), "total_size": 9 * gb, "allocated_size": 9 * gb},
    ]
    monkeypatch.setattr(probes.torch.cuda, "memory_snapshot", lambda: segments)
    text = probes.allocator_by_stream(torch.device("cuda", 0))
    assert text == ("default 4.00 GB / 3.00 GB, graph private pools 1.00 GB / 1.00 GB, "
                    "main-thread side 1.00 GB / 0.50 GB, worker 3.00 GB / 1.00 GB")


def test_steps_only_measures_the_step_rows_alone(tmp_path, capsys):
    """--steps-only (the next run's diagnosis of one row): the warm-up and the step rows, no kernel, pass, join or
    users table."""
    args = ["--allow-cpu", "--tiny", "--work-dir", str(tmp_path), "--sections", "fullshape", "--variants", "0",
            "--budgets", "16", "--streams", "2", "--steps-only"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert [(r[0], r[1], r[2]) for r in table(text, "budget", "overlap", "streams")] == [("16", "off", "2"),
                                                                                        ("16", "on", "2")]
    assert "Warm-up before the rows" in text
    for header in ("| rows per call |", "| tokens | compute ms |", "| median step before ms |",
                   "| acceptance (tokens per pass) |"):
        assert header not in text, header
