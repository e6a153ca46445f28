"""OpenTelemetry tracing for the services, configured by the standard `OTEL_*` variables.

Tracing is on only when an exporter is configured (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_TRACES_EXPORTER`), so default runs and tests
neither pay for spans nor log connection errors to a collector that isn't there. Call
`setup_tracing` before building servers, channels and apps: the interceptor helpers return
nothing while no tracer provider is installed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

if TYPE_CHECKING:
    from fastapi import FastAPI

# Health probes every few hundred ms and reflection are noise, not requests.
_NOT_PROBES = filters.negate(filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection")))


def tracing_configured() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return any(os.environ.get(v) for v in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service_name: str) -> None:
    """Install a batching tracer provider for this process if tracing is configured.

    `OTEL_SERVICE_NAME` overrides `service_name`; `OTEL_RESOURCE_ATTRIBUTES` is merged in.
    The provider flushes its batch on interpreter exit (the services exit after a graceful stop).
    """
    if not tracing_configured():
        return
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource, shutdown_on_exit=True)
    provider.add_span_processor(BatchSpanProcessor(_exporter()))
    trace.set_tracer_provider(provider)


def _exporter() -> SpanExporter:
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
        return ConsoleSpanExporter()
    # Python's OTLP default is gRPC; both exporters read the endpoint, headers and timeout variables.
    env = os.environ
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    if protocol.strip() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def _enabled() -> bool:
    """A tracer provider was installed (by `setup_tracing`, or by a test)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [aio_server_interceptor(filter_=_NOT_PROBES)] if _enabled() else []


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    return aio_client_interceptors(filter_=_NOT_PROBES) if _enabled() else []


def instrument_app(app: FastAPI) -> None:
    """Server spans for a FastAPI app, continuing a caller's `traceparent`
    (`OTEL_PYTHON_FASTAPI_EXCLUDED_URLS` leaves out paths such as probes)."""
    if _enabled():
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        # No span per ASGI message: a streamed completion would get one per chunk.
        FastAPIInstrumentor.instrument_app(app, exclude_spans=["receive", "send"])
