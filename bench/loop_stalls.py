"""`python -m bench.loop_stalls`: how long /health waits while large bodies are prepared or a large reply
is built (issue 42, item 10), over the HTTP layer alone: the real app on the test suite's FakeEngine
(tests/helpers/fake_engine.py), in a subprocess, loaded as `specexec serve` loads (so gc.freeze runs).

For each case, twice: /health polled every 10 ms from another process, its longest answer printed
with the case's statuses. Cases: a non-streamed n=8, top_logprobs=20, 600-token reply; four 3.6 MB
bodies of 87k chat messages at once; four 3.3 MB bodies with a 262k-key logit_bias at once.

    python -m bench.loop_stalls [--tree PATH] [--max-context N]

`--tree`: the source tree to serve (another checkout, to compare); `--max-context`: the FakeEngine's
context (32768: the 87k-message prompts are refused by their length; 10000000: they are run).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SERVER = """
import sys, uvicorn
from engine.config import EngineConfig, LimitsConfig
from server.app import build_app
from server.config import ServerConfig
from tests.helpers.fake_engine import FakeEngine
port, context = int(sys.argv[1]), int(sys.argv[2])
app = build_app(EngineConfig(limits=LimitsConfig(max_queue=64, default_max_tokens=8)),
                ServerConfig(port=port, max_body_bytes=64 * 2**20),
                loader=lambda config: FakeEngine(max_context=context, tokens_per_step=50))
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""
POLLER = """
import os, sys, time, httpx
url, stop = sys.argv[1], sys.argv[2]
worst = 0.0
with httpx.Client() as client:
    while not os.path.exists(stop):
        begin = time.perf_counter()
        client.get(url + "/health")
        worst = max(worst, time.perf_counter() - begin)
        time.sleep(0.01)
print(worst)
"""
HEADERS = {"content-type": "application/json"}


def worst_health(url: str, action, stop: Path) -> tuple[float, object]:
    stop.unlink(missing_ok=True)
    poller = subprocess.Popen([sys.executable, "-c", POLLER, url, str(stop)], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    status = action()
    stop.touch()
    out, _ = poller.communicate()
    stop.unlink()
    return float(out), status


def at_once(url: str, body: bytes, num: int = 4) -> list[int]:
    statuses: list[int] = []
    senders = [threading.Thread(target=lambda: statuses.append(httpx.post(
        url + "/v1/chat/completions", content=body, headers=HEADERS, timeout=300).status_code)) for _ in range(num)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    return sorted(statuses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(REPO), help="source tree to serve")
    parser.add_argument("--max-context", type=int, default=32768)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.max_context)],
                              env={**os.environ, "PYTHONPATH": args.tree}, cwd=args.tree)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        choices = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "n": 8, "logprobs": True,
                   "top_logprobs": 20, "max_tokens": 600, "ignore_eos": True}
        messages = json.dumps({"model": "fake-model", "max_tokens": 1, "messages": [
            {"role": "user", "content": f"hi {i}"} for i in range(87_000)]}).encode()
        bias = json.dumps({"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                           "logit_bias": {str(i): 1 for i in range(262_000)}}).encode()
        cases = [("n=8 top_logprobs=20 600 tokens",
                  lambda: httpx.post(url + "/v1/chat/completions", json=choices, timeout=300).status_code),
                 (f"4 x 87k messages ({len(messages) / 1e6:.1f} MB)", lambda: at_once(url, messages)),
                 (f"4 x 262k logit_bias ({len(bias) / 1e6:.1f} MB)", lambda: at_once(url, bias))]
        stop = Path(f"/tmp/loop-stalls-{os.getpid()}")
        for name, action in cases:
            for _ in range(2):
                worst, status = worst_health(url, action, stop)
                print(json.dumps({"case": name, "worst_health_s": round(worst, 3), "status": status}), flush=True)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
