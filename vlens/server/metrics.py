"""Prometheus text exposition of the server's counters and the engine's gauges.

Counters are updated on the event-loop thread only; engine gauges come from the snapshot the engine
thread publishes after every step, so scraping never touches the engine itself.
"""

from __future__ import annotations

import os
from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlens.engine.llm_engine import EngineStats
from vlens.outputs import RequestMetrics, RequestOutput
from vlens.server.activations import ActivationStore
from vlens.server.admission import Admission

ROUTES = (
    "/health", "/metrics", "/v1/models", "/v1/hooks", "/v1/saes", "/v1/steering_vectors", "/v1/completions",
    "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/classify", "/pooling", "/score", "/v1/score",
    "/rerank", "/v1/rerank", "/tokenize", "/detokenize", "/tokenizer_info", "/openapi.json", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)  # fmt: skip
ACTIVATIONS_ROUTE = "/v1/activations/{id}"


def resident_bytes() -> int | None:
    """This process's resident memory (Linux's /proc; None elsewhere): a server left running for days
    must show that it does not grow."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def route_label(path: str) -> str:
    """A bounded label set: handle ids and unknown paths must not each become a time series."""
    if path in ROUTES:
        return path
    return ACTIVATIONS_ROUTE if path.startswith("/v1/activations/") else "other"


# vLLM's buckets for these histograms (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # fmt: skip
# vLLM's per-request latency histograms: name -> (what it times, its buckets)
LATENCIES = {
    "time_to_first_token": ("from a request's arrival in the engine to its first generated token", TTFT_BUCKETS),
    "e2e_request_latency": ("from a request's arrival in the engine to its end", E2E_BUCKETS),
    "request_queue_time": ("a request waited before its first step", E2E_BUCKETS),
    "request_prefill_time": ("from a request's first step to its first generated token", E2E_BUCKETS),
    "request_decode_time": ("from a request's first generated token to its end", E2E_BUCKETS),
    "request_time_per_output_token": ("a request's mean time between its generated tokens", TPOT_BUCKETS),
}


def latencies(m: RequestMetrics) -> dict[str, float | None]:
    """A finished request's LATENCIES, in seconds (None: what a request that generated too little lacks)."""
    first, n = m.first_token_time, m.num_generated_tokens
    return {
        "time_to_first_token": None if first is None else first - m.arrival_time,
        "e2e_request_latency": m.finished_time - m.arrival_time,
        "request_queue_time": m.first_scheduled_time - m.arrival_time,
        "request_prefill_time": None if first is None else first - m.first_scheduled_time,
        "request_decode_time": None if first is None else m.finished_time - first,
        "request_time_per_output_token": None if first is None or n < 2 else (m.finished_time - first) / (n - 1),
    }


class Histogram:
    """Prometheus's cumulative buckets, their sum and count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> list[tuple[str, float]]:
        buckets = [(f'_bucket{{le="{bound}"}}', n) for bound, n in zip(self.bounds, self.counts)]
        return [*buckets, ('_bucket{le="+Inf"}', self.count), ("_sum", self.sum), ("_count", self.count)]


class Metrics:
    def __init__(self) -> None:
        self.http: Counter[tuple[str, int]] = Counter()
        self.captured_bytes = 0
        self.aborted = 0
        self.latencies = {name: Histogram(buckets) for name, (_, buckets) in LATENCIES.items()}
        self.finished: Counter[str] = Counter()  # requests' samples by finish reason

    def observe(self, output: RequestOutput) -> None:
        """A finished engine request's latencies (vLLM's histograms) and its samples' finish reasons."""
        if output.metrics is not None:
            for name, seconds in latencies(output.metrics).items():
                if seconds is not None:
                    self.latencies[name].observe(seconds)
        self.finished.update(c.finish_reason or "abort" for c in output.outputs)

    def render(self, stats: EngineStats, store: ActivationStore, admission: Admission) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{suffix} {value}" for suffix, value in samples)  # (labels, or a histogram's parts)

        http = [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.http.items())]
        metric("vlens_http_requests_total", "counter", "HTTP requests by route and status code.", http)
        metric(
            "vlens_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", [("", stats.prompt_tokens)]
        )
        metric("vlens_generation_tokens_total", "counter", "Tokens generated.", [("", stats.generation_tokens)])
        metric(
            "vlens_captured_bytes_total",
            "counter",
            "Bytes of activations returned (safetensors).",
            [("", self.captured_bytes)],
        )
        metric(
            "vlens_requests_aborted_total",
            "counter",
            "Requests aborted because the client went away.",
            [("", self.aborted)],
        )
        for name, (help_, _) in LATENCIES.items():
            metric(f"vlens_{name}_seconds", "histogram", f"Seconds {help_}.", self.latencies[name].samples())
        metric("vlens_request_success_total", "counter", "Samples finished, by finish reason.",
               [(f'{{finished_reason="{r}"}}', n) for r, n in sorted(self.finished.items())])  # fmt: skip
        metric("vlens_requests_running", "gauge", "Requests in the running batch.", [("", stats.running)])
        metric("vlens_requests_waiting", "gauge", "Requests queued for admission.", [("", stats.waiting)])
        metric(
            "vlens_kv_cache_usage", "gauge", "Fraction of KV-cache blocks in use (0..1).", [("", stats.kv_cache_usage)]
        )
        metric("vlens_preemptions_total", "counter", "Sequences preempted for KV space.", [("", stats.num_preemptions)])
        metric("vlens_prefix_cache_queries_total", "counter",
               "Tokens of sequences admitted (vLLM's prefix cache queries).", [("", stats.prefix_cache_queries)])
        metric("vlens_prefix_cache_hits_total", "counter", "Of those tokens, the ones the prefix cache gave.",
               [("", stats.prefix_cache_hits)])  # fmt: skip
        metric("vlens_kept_states", "gauge", "Prefixes' states kept for later prompts (models that keep states).",
               [("", stats.kept_states)])  # fmt: skip
        if stats.max_loras:  # (vLLM's gauge: the adapters by name in its labels)
            labels = (f'{{running_lora_adapters="{",".join(stats.running_loras)}",'
                      f'waiting_lora_adapters="{",".join(stats.waiting_loras)}",max_lora="{stats.max_loras}"}}')
            metric("vlens_lora_requests_info", "gauge", "LoRA adapters of running and waiting requests.",
                   [(labels, 1)])  # fmt: skip
        metric("vlens_activation_handles", "gauge", "Activation payloads awaiting download.", [("", store.count)])
        metric("vlens_activation_handle_bytes", "gauge", "Bytes held for activation downloads.", [("", store.nbytes)])
        metric(
            "vlens_requests_admitted",
            "gauge",
            "Prompts of HTTP requests admitted and not yet answered (the --max-pending-requests count).",
            [("", admission.requests)],
        )
        metric(
            "vlens_capture_bytes_reserved",
            "gauge",
            "Capture bytes reserved by admitted requests (with handle bytes, the --max-capture-bytes-in-flight count).",
            [("", admission.capture_bytes)],
        )
        rss = resident_bytes()
        if rss is not None:
            metric("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", [("", rss)])
        return "\n".join(lines) + "\n"


class CountRequests:
    """ASGI middleware counting every response by route and status, including auth and size refusals."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http[(route_label(scope["path"]), message["status"])] += 1
            await send(message)

        await self.app(scope, receive, counting_send)
