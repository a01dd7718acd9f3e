"""One OpenTelemetry span per request, exported over OTLP/HTTP (``--otlp-traces-endpoint``,
docs/operations.md#tracing).

The only module that imports OpenTelemetry (``pip install 'tidal[otel]'``), and only
``AsyncLLM`` imports it, when the flag is set. A span runs from the request's arrival to
its end; attributes: request id, model, prompt and output tokens, finish reason; events:
``queued`` (sent to an engine), ``first_token``, ``migrated`` (its outputs come from
another engine: elastic EP moved it) and ``scale_operation`` (one for each elastic EP
operation that finished while it ran). Spans are exported in batches off the event loop.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

# Attribute names of OpenTelemetry's GenAI semantic conventions where one fits.
ATTR_REQUEST_ID = "gen_ai.request.id"
ATTR_MODEL = "gen_ai.request.model"
ATTR_PROMPT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_FINISH_REASON = "gen_ai.response.finish_reasons"
# Spans wait at most this long to be sent (the SDK's default is 5 s).
_EXPORT_DELAY_MS = 1000


class RequestTracer:
    """Open spans by request id; every method is called on the event loop."""

    def __init__(self, endpoint: str, model: str, exporter: SpanExporter | None = None) -> None:
        """``exporter``: where spans go instead of OTLP/HTTP to ``endpoint`` (tests)."""
        self.model = model
        self._provider = TracerProvider(resource=Resource.create({"service.name": "tidal"}))
        exporter = exporter if exporter is not None else OTLPSpanExporter(endpoint=endpoint)
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=_EXPORT_DELAY_MS)
        )
        self._tracer = self._provider.get_tracer("tidal")
        self._spans: dict[str, Span] = {}

    def start(self, request_id: str, prompt_tokens: int) -> None:
        self._spans[request_id] = self._tracer.start_span(
            "llm_request",
            kind=SpanKind.SERVER,
            attributes={
                ATTR_REQUEST_ID: request_id,
                ATTR_MODEL: self.model,
                ATTR_PROMPT_TOKENS: prompt_tokens,
            },
        )

    def event(self, request_id: str, name: str, attributes: dict[str, Any] | None = None) -> None:
        span = self._spans.get(request_id)
        if span is not None:
            span.add_event(name, attributes or {})

    def scale_operation(self, record: dict[str, Any]) -> None:
        """A finished elastic EP operation (``OperationRecord.to_dict()``), on every open span."""
        attributes = {
            "operation_id": str(record.get("operation_id")),
            "result": str(record.get("result") or record.get("phase")),
            "trigger": str(record.get("trigger")),
            "requests_migrated": int(record.get("requests_migrated") or 0),
        }
        for key in ("from_size", "to_size"):
            if isinstance(record.get(key), int):
                attributes[key] = record[key]
        for span in self._spans.values():
            span.add_event("scale_operation", attributes)

    def finish(
        self, request_id: str, output_tokens: int, finish_reason: str, error: str | None = None
    ) -> None:
        span = self._spans.pop(request_id, None)
        if span is None:
            return
        span.set_attribute(ATTR_OUTPUT_TOKENS, output_tokens)
        span.set_attribute(ATTR_FINISH_REASON, [finish_reason])
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def shutdown(self) -> None:
        """End what is still open (as aborted) and send every span not yet sent."""
        for request_id in list(self._spans):
            self.finish(request_id, 0, "abort")
        self._provider.shutdown()
