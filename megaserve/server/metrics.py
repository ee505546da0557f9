"""The server's Prometheus metrics, through ``prometheus_client``, under vLLM's names.

Every series carries a ``model_name`` label, as vLLM's do, so dashboards and alerts built
for vLLM read a megaserve server unchanged. What vLLM has no name for is ``megaserve:``.

Each ServingCore owns its own ``CollectorRegistry`` (never the process-global one), so
several servers or tests in one process do not collide. Engine gauges and token totals
are read from the engine's statistics at scrape time; latencies and finished/rejected
counts are recorded as requests progress (on the event loop).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket edges follow vLLM's, so dashboards built for vLLM read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Gauges and counters read from the engine's ``EngineStats`` at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], object | None],
                 num_in_flight: Callable[[], int]) -> None:
        self._model = model_name
        self._stats = stats
        self._num_in_flight = num_in_flight

    def describe(self):
        return []  # values depend on the engine: never checked at registration

    def collect(self):
        s = self._stats()

        def stat(name: str) -> float:
            return float(getattr(s, name, 0) or 0)

        total = stat("num_kv_blocks")
        usage = (total - stat("num_free_kv_blocks")) / total if total else 0.0
        gauges = [
            ("vllm:num_requests_running", "Requests in the engine's running batch.",
             stat("num_running")),
            ("vllm:num_requests_waiting", "Requests queued in the engine.", stat("num_waiting")),
            ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", usage),
            ("megaserve:num_requests_in_flight", "Requests admitted by the server and not "
             "finished (running, waiting or being validated).", float(self._num_in_flight())),
            ("megaserve:num_kv_blocks", "KV-cache blocks in total.", total),
            ("megaserve:num_free_kv_blocks", "KV-cache blocks free.", stat("num_free_kv_blocks")),
            ("megaserve:prefix_cache_hit_rate", "Prefix-cache hits / queries in tokens, "
             "since start (0-1).", stat("prefix_cache_hits") / max(1.0, stat("prefix_cache_queries"))),
        ]
        for name, help_, value in gauges:
            family = GaugeMetricFamily(name, help_, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family
        for name, help_, field in [
                ("vllm:prompt_tokens", "Prompt tokens processed.", "prompt_tokens_total"),
                ("vllm:generation_tokens", "Tokens generated.", "generation_tokens_total"),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 "prefix_cache_queries"),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 "prefix_cache_hits"),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                 "spec_num_draft_tokens"),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 "spec_num_accepted_tokens")]:
            family = CounterMetricFamily(name, help_, labels=["model_name"])
            family.add_metric([self._model], stat(field))
            yield family


class ServerMetrics:
    """The server's metrics, all labelled with ``model_name``.

    ``stats`` returns the engine's ``EngineStats`` (or None while loading) and
    ``num_in_flight`` the requests the server has admitted and not yet finished.
    """

    def __init__(self, model_name: str, stats: Callable[[], object | None],
                 num_in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        self.registry.register(_EngineCollector(model_name, stats, num_in_flight))
        reg = self.registry
        self._success = Counter("vllm:request_success", "Finished requests by finished_reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self._rejected = Counter("megaserve:request_rejected", "Requests refused before "
                                 "running (capacity or server state), by code.",
                                 ["model_name", "code"], registry=reg)
        self._ttft = Histogram("vllm:time_to_first_token_seconds",
                               "Time from arrival to the first generated token.",
                               ["model_name"], buckets=TTFT_BUCKETS, registry=reg)
        self._itl = Histogram("vllm:inter_token_latency_seconds",
                              "Time between consecutive generated tokens.",
                              ["model_name"], buckets=ITL_BUCKETS, registry=reg)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds",
                              "Time from arrival to the last token.",
                              ["model_name"], buckets=E2E_BUCKETS, registry=reg)
        # The model's series, looked up once: these are observed every token.
        self._ttft_series = self._ttft.labels(model_name)
        self._itl_series = self._itl.labels(model_name)
        self._e2e_series = self._e2e.labels(model_name)

    def first_token(self, seconds: float) -> None:
        self._ttft_series.observe(seconds)

    def inter_token(self, seconds: float, num_tokens: int = 1) -> None:
        """``num_tokens`` tokens that arrived together, ``seconds`` apart on average."""
        series = self._itl_series
        for _ in range(num_tokens):
            series.observe(seconds)

    def request_done(self, seconds: float) -> None:
        self._e2e_series.observe(seconds)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def rejected(self, code: str) -> None:
        self._rejected.labels(self.model_name, code).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def parse_text(text: str) -> dict[str, float]:
    """Exposition text → ``{'name{k="v",...}': value}`` with labels sorted by name (for
    tests and tools)."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples
