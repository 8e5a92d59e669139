"""Gateway Prometheus metrics, named as vLLM's with the `kvmesh:` prefix, in a registry per app.

Counters are exposed with prometheus' `_total` suffix (`kvmesh:prompt_tokens_total`), as vLLM's are.
`num_requests_waiting` counts requests admitted but still before their first token (routing,
prefill, queueing on the worker); `num_requests_running` counts those streaming tokens.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvmesh.gateway.router import REASONS

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0)
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ("model_name",)
        self._model = model_name

        def counter(name: str, doc: str, labels=m):
            return Counter(f"kvmesh:{name}", doc, labels, registry=r)

        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Finished requests by finish reason.",
                                       ("model_name", "finished_reason"))
        self.request_errors = counter("request_errors", "Requests answered with an error, by HTTP status.",
                                      ("model_name", "status"))
        self.router_decisions = counter("router_decisions", "Routing decisions by reason.",
                                        ("model_name", "reason"))
        self.router_predicted_hit_tokens = counter(
            "router_predicted_hit_tokens", "Prompt tokens the index said were cached where routed.")
        self.router_actual_hit_tokens = counter(
            "router_actual_hit_tokens", "Prompt tokens the worker actually served from cache.")
        self.router_prefill_hops = counter("router_prefill_hops", "Requests sent through a prefill worker.")
        self.resumed_choices = counter("resumed_choices", "Choices that went on on another decode worker after "
                                       "theirs died or hung mid-stream.")
        self.prefix_index_errors = counter("prefix_index_errors", "Prefix-index lookups routed as misses "
                                           "because the index failed (error), was slow (timeout) or was being "
                                           "left alone after a failure (skipped).", ("model_name", "reason"))
        self.ttft = Histogram("kvmesh:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kvmesh:inter_token_latency_seconds", "Time between streamed tokens.", m,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kvmesh:e2e_request_latency_seconds", "Request latency end to end.", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.prefill_call = Histogram("kvmesh:prefill_call_seconds",
                                      "Disaggregated requests: the prefill worker's call, sent to answered.", m,
                                      buckets=TTFT_BUCKETS, registry=r)
        self.hit_error = Histogram("kvmesh:router_hit_prediction_error_tokens",
                                   "|predicted - actual| cached prompt tokens per request.", m,
                                   buckets=TOKEN_BUCKETS, registry=r)
        self.running = Gauge("kvmesh:num_requests_running", "Requests streaming tokens.", m, registry=r)
        self.waiting = Gauge("kvmesh:num_requests_waiting", "Requests before their first token.", m,
                             registry=r)
        for reason in REASONS:  # every reason visible at 0 from the start
            self.router_decisions.labels(model_name, reason)

    def lab(self, metric, **labels):
        return metric.labels(model_name=self._model, **labels)

    def index_error(self, reason: str) -> None:
        self.lab(self.prefix_index_errors, reason=reason).inc()

    def decision(self, reason: str, predicted_hit_tokens: int) -> None:
        self.lab(self.router_decisions, reason=reason).inc()
        self.lab(self.router_predicted_hit_tokens).inc(predicted_hit_tokens)

    def prompt_done(self, prompt_tokens: int, cached_tokens: int, predicted: int) -> None:
        self.lab(self.prompt_tokens).inc(prompt_tokens)
        self.lab(self.prefix_cache_queries).inc(prompt_tokens)
        self.lab(self.prefix_cache_hits).inc(cached_tokens)
        self.lab(self.router_actual_hit_tokens).inc(cached_tokens)
        self.lab(self.hit_error).observe(abs(predicted - cached_tokens))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
