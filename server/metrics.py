"""Prometheus metrics (prometheus-client), one CollectorRegistry per app.

Engine-side numbers are recorded from the AsyncEngine's worker thread: per pass (requests, tokens,
nodes, step times) through `observe_step`, per request and pass (accepted tokens, tree size, prefix
cache hits) through `observe_delta`, and `observe_finish` (the
worker thread, or the event loop when a waiting request is aborted or the AsyncEngine stops);
queue gauges read the AsyncEngine at scrape time (`bind_async_engine`); request and token
counts are recorded by the HTTP handlers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.async_engine import SCHEDULING_POLICY, AsyncEngine, JobReport
from engine.types import PassStats, TokenDelta

PREFIX = "specexec"
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ACCEPT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
NODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Finished HTTP generation requests",
                                ["endpoint", "finish_reason"], registry=r)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "Requests answered with an HTTP error",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge(f"{PREFIX}_requests_running", "Requests the engine is running", registry=r)
        self.queue_capacity = Gauge(f"{PREFIX}_queue_capacity", "Bound of the waiting queue", registry=r)
        self.healthy = Gauge(f"{PREFIX}_engine_healthy", "1 when the engine is loaded and serving", registry=r)
        self.scheduler = Info(f"{PREFIX}_scheduler", "How requests share the engine", registry=r)
        self.target_passes = Counter(f"{PREFIX}_target_passes", "Target model passes (engine steps)", registry=r)
        self.accepted_tokens = Counter(f"{PREFIX}_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.accepted_per_pass = Histogram(f"{PREFIX}_accepted_tokens_per_pass",
                                           "Draft tokens accepted per request per target pass",
                                           buckets=ACCEPT_BUCKETS, registry=r)
        self.emitted_per_pass = Histogram(f"{PREFIX}_emitted_tokens_per_pass",
                                          "Tokens emitted per request per target pass (accepted + bonus)",
                                          buckets=ACCEPT_BUCKETS, registry=r)
        self.tree_size = Histogram(f"{PREFIX}_tree_size", "Tree nodes of one request scored in a target pass",
                                   buckets=NODE_BUCKETS, registry=r)
        self.requests_per_pass = Histogram(f"{PREFIX}_requests_per_pass", "Requests whose trees one target pass scored",
                                           buckets=(1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.pass_emitted = Histogram(f"{PREFIX}_pass_emitted_tokens", "Tokens emitted to all requests per target pass",
                                      buckets=ACCEPT_BUCKETS, registry=r)
        self.pass_nodes = Histogram(f"{PREFIX}_pass_tree_nodes", "Tree nodes of all requests scored per target pass",
                                    buckets=NODE_BUCKETS, registry=r)
        self.prefill_tokens = Counter(f"{PREFIX}_prefill_tokens", "Prompt tokens written by target passes",
                                      registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_prefix_cache_hit_tokens",
                                     "Prompt tokens whose KV came from the prefix cache", registry=r)
        self.step_seconds = Histogram(f"{PREFIX}_step_seconds", "Engine step time (draft + target)",
                                      buckets=STEP_BUCKETS, registry=r)
        self.draft_seconds = Histogram(f"{PREFIX}_draft_seconds", "Draft tree growth time per step",
                                       buckets=STEP_BUCKETS, registry=r)
        self.target_seconds = Histogram(f"{PREFIX}_target_seconds", "Target pass time per step",
                                        buckets=STEP_BUCKETS, registry=r)
        self.aborts = Counter(f"{PREFIX}_aborted_requests", "Requests aborted (disconnect, stop string)",
                              registry=r)
        self.abort_lag = Histogram(f"{PREFIX}_abort_lag_steps",
                                   "Engine steps finished after abort() until the request was freed",
                                   buckets=(0, 1, 2, 4, 8), registry=r)
        self.engine_requests = Counter(f"{PREFIX}_engine_requests", "Requests that left the engine loop",
                                       ["finish_reason"], registry=r)

    def bind_async_engine(self, async_engine: AsyncEngine) -> None:
        self.queue_depth.set_function(lambda: float(async_engine.queue_depth))
        self.running.set_function(lambda: float(async_engine.num_running))
        self.queue_capacity.set(async_engine.max_queue)
        self.scheduler.info({"policy": SCHEDULING_POLICY, "max_running": str(async_engine.max_running)})
        self.healthy.set_function(lambda: 1.0 if async_engine.healthy else 0.0)

    def observe_delta(self, delta: TokenDelta) -> None:
        stats = delta.stats
        if stats is None:
            return
        if delta.totals is not None:
            self.cached_tokens.inc(delta.totals.cached_tokens)
        self.accepted_tokens.inc(stats.num_accepted)
        self.accepted_per_pass.observe(stats.num_accepted)
        self.emitted_per_pass.observe(stats.num_emitted)
        self.tree_size.observe(stats.tree_size)

    def observe_step(self, stats: PassStats) -> None:
        """One engine step: one target pass over every running request."""
        self.target_passes.inc()
        self.requests_per_pass.observe(stats.num_requests)
        self.pass_emitted.observe(stats.num_emitted)
        self.pass_nodes.observe(stats.num_tree_nodes)
        self.prefill_tokens.inc(stats.num_prefill_tokens)
        self.step_seconds.observe(stats.step_seconds)
        self.draft_seconds.observe(stats.draft_seconds)
        self.target_seconds.observe(stats.target_seconds)

    def observe_finish(self, report: JobReport) -> None:
        self.engine_requests.labels(report.finish_reason.value).inc()
        if report.aborted:
            self.aborts.inc()
        if report.abort_lag_steps is not None:
            self.abort_lag.observe(report.abort_lag_steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
