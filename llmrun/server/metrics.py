"""The Prometheus metrics that `llmrun serve` reports on /metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

# --- metrics --------------------------------------------------------------------------

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, service: Any) -> None:
        disable_created_metrics()  # `*_created` series would only add noise
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "llmrun_requests",
            "Requests answered, by endpoint and HTTP status (499: the client went away).",
            ["endpoint", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "llmrun_prompt_tokens", "Prompt tokens processed.", registry=registry
        )
        self.generation_tokens = Counter(
            "llmrun_generation_tokens", "Tokens generated.", registry=registry
        )
        self.ttft = Histogram(
            "llmrun_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "llmrun_time_per_output_token_seconds",
            "Between successive generated tokens of a request.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "llmrun_request_duration_seconds",
            "From a request's arrival to its last token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        waiting = Gauge(
            "llmrun_requests_waiting", "Requests queued for a free slot.", registry=registry
        )
        waiting.set_function(lambda: len(service.scheduler.waiting) if service.scheduler else 0)
        running = Gauge("llmrun_requests_running", "Requests holding a slot.", registry=registry)
        running.set_function(lambda: len(service.scheduler.active) if service.scheduler else 0)
        slots = Gauge("llmrun_slots", "Sequences decoded together.", registry=registry)
        slots.set(service.parallel)
        blocks = Gauge(
            "llmrun_kv_blocks",
            "KV cache blocks: total, used (held by a sequence), cached (naming a prefix).",
            ["state"],
            registry=registry,
        )
        window_blocks = Gauge(
            "llmrun_kv_window_blocks",
            "The sliding-window layers' KV blocks (0 without such layers): total, used, cached.",
            ["state"],
            registry=registry,
        )

        def group(windowed: bool) -> Any:
            if service.scheduler is None:
                return None
            blocks = service.scheduler.blocks
            return blocks.window_manager if windowed else blocks

        for gauge, windowed in ((blocks, False), (window_blocks, True)):
            for state, count in (
                ("total", lambda b: b.n_blocks),
                ("used", lambda b: b.used),
                ("cached", lambda b: b.cached_blocks),
            ):
                gauge.labels(state).set_function(
                    lambda count=count, windowed=windowed: (
                        0 if group(windowed) is None else count(group(windowed))
                    )
                )
        preempted = Gauge(
            "llmrun_preemptions",
            "Sequences preempted (to be prefilled again) when KV blocks ran out.",
            registry=registry,
        )
        preempted.set_function(lambda: service.scheduler.preemptions if service.scheduler else 0)
        self.cached_tokens = Counter(
            "llmrun_prompt_tokens_cached",
            "Prompt tokens whose keys and values came from the prefix cache.",
            registry=registry,
        )
