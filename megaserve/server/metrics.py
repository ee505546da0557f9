"""A small Prometheus registry (text exposition format 0.0.4), vLLM-style names.

Only what the server needs: counters, gauges (set, or read through a callback at scrape
time) and histograms with fixed buckets, each with string labels. Single-threaded: every
update happens on the server's event loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[tuple[str, str], ...]


def _labels(labels: dict[str, str] | None) -> Labels:
    return tuple(sorted((labels or {}).items()))


def _fmt_labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    pairs = list(labels) + ([extra] if extra else [])
    if not pairs:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_: str) -> None:
        if not name.replace(":", "_").replace("_", "a").isalnum():
            raise ValueError(f"metric name {name!r} is not a valid Prometheus name")
        self.name = name
        self.help = help_

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class _ValueMetric(_Metric):
    """One value per label set, either stored or read from ``callback`` at scrape time
    (under the fixed ``labels``)."""

    def __init__(self, name: str, help_: str, callback: Callable[[], float] | None = None,
                 labels: dict[str, str] | None = None) -> None:
        super().__init__(name, help_)
        self._callback = callback
        self._fixed_labels = _labels(labels)
        self._values: dict[Labels, float] = {}

    def value(self, labels: dict[str, str] | None = None) -> float:
        return self._values.get(_labels(labels), 0.0)

    def render(self) -> list[str]:
        values = dict(self._values)
        if self._callback is not None:
            values[self._fixed_labels] = float(self._callback())
        return [f"{self.name}{_fmt_labels(k)} {_fmt_value(v)}" for k, v in values.items()]


class Counter(_ValueMetric):
    """A monotonically increasing value per label set. The name should end in ``_total``.

    With a callback the value comes from a source that already counts (for example the
    engine's token totals).
    """

    kind = "counter"

    def inc(self, amount: float = 1.0, labels: dict[str, str] | None = None) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (got {amount})")
        key = _labels(labels)
        self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_ValueMetric):
    """A value that goes up and down: ``set``, or read from a callback at scrape time."""

    kind = "gauge"

    def set(self, value: float, labels: dict[str, str] | None = None) -> None:
        self._values[_labels(labels)] = float(value)


class Histogram(_Metric):
    """Cumulative buckets (``_bucket{le=...}``), ``_sum`` and ``_count`` per label set."""

    kind = "histogram"

    def __init__(self, name: str, help_: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_)
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(f"{name}: buckets must be strictly increasing, got {buckets}")
        self.buckets = tuple(float(b) for b in buckets) + (math.inf,)
        self._counts: dict[Labels, list[int]] = {}
        self._sums: dict[Labels, float] = {}

    def observe(self, value: float, labels: dict[str, str] | None = None) -> None:
        key = _labels(labels)
        counts = self._counts.setdefault(key, [0] * len(self.buckets))
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                counts[i] += 1
                break
        self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, labels: dict[str, str] | None = None) -> int:
        return sum(self._counts.get(_labels(labels), []))

    def render(self) -> list[str]:
        lines = []
        for key, counts in self._counts.items():
            cumulative = 0
            for upper, n in zip(self.buckets, counts):
                cumulative += n
                le = ("le", _fmt_value(upper))
                lines.append(f"{self.name}_bucket{_fmt_labels(key, le)} {cumulative}")
            lines.append(f"{self.name}_sum{_fmt_labels(key)} {_fmt_value(self._sums[key])}")
            lines.append(f"{self.name}_count{_fmt_labels(key)} {cumulative}")
        return lines


class Registry:
    """Holds metrics by name and renders them all in the Prometheus text format."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name!r} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines += metric.header() + metric.render()
        return "\n".join(lines) + "\n"


def parse_text(text: str) -> dict[str, float]:
    """Parses exposition text into ``{"name{labels}": value}`` (for tests and tools)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        samples[key] = float(value)
    return samples


# Bucket edges follow vLLM's, so dashboards built for vLLM read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's metrics under ``megaserve:``, all labelled with ``model_name``.

    ``stats`` returns the engine's ``EngineStats`` (or None while loading) and
    ``num_in_flight`` the requests the server has admitted and not yet finished.
    """

    def __init__(self, model_name: str, stats: Callable[[], object | None],
                 num_in_flight: Callable[[], int]) -> None:
        self.registry = Registry()
        self.labels = {"model_name": model_name}
        lab = self.labels

        def stat(field: str) -> Callable[[], float]:
            return lambda: float(getattr(stats(), field, 0) or 0)

        def kv_usage() -> float:
            s = stats()
            total = getattr(s, "num_kv_blocks", 0) or 0
            return (total - s.num_free_kv_blocks) / total if total else 0.0

        reg = self.registry.register
        reg(Gauge("megaserve:num_requests_running", "Requests in the engine's running batch.",
                  stat("num_running"), lab))
        reg(Gauge("megaserve:num_requests_waiting", "Requests queued in the engine.",
                  stat("num_waiting"), lab))
        reg(Gauge("megaserve:num_requests_in_flight",
                  "Requests admitted by the server and not finished (running, waiting or "
                  "being validated).", lambda: float(num_in_flight()), lab))
        reg(Gauge("megaserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                  kv_usage, lab))
        reg(Gauge("megaserve:num_kv_blocks", "KV-cache blocks in total.",
                  stat("num_kv_blocks"), lab))
        reg(Gauge("megaserve:num_free_kv_blocks", "KV-cache blocks free.",
                  stat("num_free_kv_blocks"), lab))
        reg(Counter("megaserve:prompt_tokens_total", "Prompt tokens processed.",
                    stat("prompt_tokens_total"), lab))
        reg(Counter("megaserve:generation_tokens_total", "Tokens generated.",
                    stat("generation_tokens_total"), lab))
        self.request_success = reg(Counter(
            "megaserve:request_success_total", "Finished requests by finished_reason."))
        self.request_rejected = reg(Counter(
            "megaserve:request_rejected_total", "Requests refused before running, by code."))
        self.ttft = reg(Histogram("megaserve:time_to_first_token_seconds",
                                  "Time from arrival to the first generated token.",
                                  TTFT_BUCKETS))
        self.itl = reg(Histogram("megaserve:inter_token_latency_seconds",
                                 "Time between consecutive generated tokens.", ITL_BUCKETS))
        self.e2e = reg(Histogram("megaserve:e2e_request_latency_seconds",
                                 "Time from arrival to the last token.", E2E_BUCKETS))

    def finished(self, reason: str) -> None:
        self.request_success.inc(labels={**self.labels, "finished_reason": reason})

    def rejected(self, code: str) -> None:
        self.request_rejected.inc(labels={**self.labels, "code": code})

    def render(self) -> str:
        return self.registry.render()
