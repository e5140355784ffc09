"""Prometheus metrics of the live alarm, one endpoint per engine process.

Why a port per process (``KEYTRACE_METRICS_PORT`` + the DP rank) rather than the
node-exporter textfile convention: the alarm lives in vLLM's engine-core processes, one per
DP rank, which the API server's own ``/metrics`` does not see; an HTTP endpoint per process
is scraped live, needs no node exporter and no shared directory, and disappears with the
process (a textfile would keep reporting a dead engine's last numbers). The endpoint serves
only keytrace's metrics from a registry of its own, so vLLM's registry is never touched.

The numbers are plain counters the alarm keeps anyway (`keytrace.live.alarm.Alarm`);
this collector turns them into metric families when scraped, so serving costs nothing
between scrapes. Names follow Prometheus conventions (``keytrace_..._total``, tokens and
keys as counts).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from keytrace.format.remote import uploaders
from keytrace.live.registry import AlarmSettings, alarms

log = logging.getLogger("keytrace")

_SERVED: dict[str, Any] = {}
_LOCK = threading.Lock()


class AlarmCollector:
    """A `prometheus_client` collector over every alarm of this process."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        episodes = CounterMetricFamily(
            "keytrace_episodes",
            "Lookup episodes judged live, by verdict (the definitions of keytrace diff).",
            labels=["engine", "verdict"],
        )
        short = CounterMetricFamily(
            "keytrace_short_of_expected_tokens",
            "Tokens a shortfall episode fell short of its expected boundary E, by first "
            "decisive cause and binding group.",
            labels=["engine", "cause", "group"],
        )
        stored = CounterMetricFamily(
            "keytrace_keys_stored",
            "Store-side rows by group and event (prepared, rejected, failed, completed, evicted).",
            labels=["engine", "group", "event"],
        )
        looked = CounterMetricFamily(
            "keytrace_keys_looked_up",
            "manager.lookup calls by group and result.",
            labels=["engine", "group", "result"],
        )
        failures = CounterMetricFamily(
            "keytrace_recorder_failures",
            "Failures inside keytrace's hooks (caught; vLLM unaffected).",
            labels=["engine"],
        )
        dropped = CounterMetricFamily(
            "keytrace_rows_dropped", "Trace rows the writer could not keep.", labels=["engine"]
        )
        parts_dropped = CounterMetricFamily(
            "keytrace_parts_dropped",
            "Trace parts not written because the process reached KEYTRACE_MAX_BYTES.",
            labels=["engine"],
        )
        capped = GaugeMetricFamily(
            "keytrace_trace_capped",
            "1 once the engine's trace stopped at KEYTRACE_MAX_BYTES (the trace on disk is a "
            "complete prefix; keytrace diff says so).",
            labels=["engine"],
        )
        records = GaugeMetricFamily(
            "keytrace_alarm_state_records", "Key records the alarm holds (bounded)."
        )
        forgotten = CounterMetricFamily(
            "keytrace_alarm_forgotten_records",
            "Key records dropped to stay under the alarm's memory cap.",
        )
        uploaded = CounterMetricFamily(
            "keytrace_parts_uploaded",
            "Trace parts uploaded to the object store (KEYTRACE_DIR=s3://...).",
            labels=["destination"],
        )
        upload_failures = CounterMetricFamily(
            "keytrace_upload_failures",
            "Failed attempts to upload a trace part (the store unreachable; retried).",
            labels=["destination"],
        )
        spooled = GaugeMetricFamily(
            "keytrace_spool_bytes",
            "Bytes of closed trace parts waiting in the local spool for the object store.",
            labels=["destination"],
        )
        spool_dropped = CounterMetricFamily(
            "keytrace_spool_dropped_parts",
            "Trace parts dropped because the local spool was full (KEYTRACE_SPOOL_BYTES).",
            labels=["destination"],
        )
        for up in uploaders():
            uploaded.add_metric([up.shown], up.stats.uploaded_parts)
            upload_failures.add_metric([up.shown], up.stats.failures)
            spooled.add_metric([up.shown], up.pending()[1])
            spool_dropped.add_metric([up.shown], up.stats.dropped_parts)
        yield from (uploaded, upload_failures, spooled, spool_dropped)
        n_records = n_forgotten = 0
        for alarm in alarms():
            for (engine, verdict), n in sorted(alarm.episodes.items()):
                episodes.add_metric([engine, verdict], n)
            for (engine, cause, group), n in sorted(alarm.short_tokens.items()):
                short.add_metric([engine, cause, group], n)
            for (engine, group, event), n in sorted(alarm.stored.items()):
                stored.add_metric([engine, group, event], n)
            for (engine, group, result), n in sorted(alarm.looked_up.items()):
                looked.add_metric([engine, group, result], n)
            for engine, fails, drops, parts, at_cap in alarm.health():
                failures.add_metric([engine], fails)
                dropped.add_metric([engine], drops)
                parts_dropped.add_metric([engine], parts)
                capped.add_metric([engine], int(at_cap))
            n_records += alarm.state_records()
            n_forgotten += alarm.forgotten
        records.add_metric([], n_records)
        forgotten.add_metric([], n_forgotten)
        yield from (
            episodes,
            short,
            stored,
            looked,
            failures,
            dropped,
            parts_dropped,
            capped,
            records,
            forgotten,
        )


def _registry() -> Any:
    """A registry of keytrace's own holding the collector (vLLM's is never touched)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(AlarmCollector())
    return registry


def exposition() -> bytes:
    """The current metrics in the Prometheus text format (what the endpoint serves)."""
    from prometheus_client import generate_latest

    return bytes(generate_latest(_registry()))


def serving_port() -> int | None:
    """The port this process's endpoint listens on (None: not serving)."""
    with _LOCK:
        port = _SERVED.get("port")
        return int(port) if port else None


def serve_metrics(settings: AlarmSettings, dp_rank: int | None) -> int | None:
    """Start this process's endpoint once (port ``metrics_port + dp_rank``; 0: any free
    port); the port, or None when no port is configured or it cannot be bound (one
    warning)."""
    if settings.metrics_port is None:
        return None
    with _LOCK:
        if "port" in _SERVED:
            return int(_SERVED["port"])
        port = settings.metrics_port + (dp_rank or 0) if settings.metrics_port else 0
        try:
            from prometheus_client import start_http_server

            server, _thread = start_http_server(port, settings.metrics_addr, registry=_registry())
        except Exception as exc:  # a busy port must not stop vLLM
            log.warning(
                "keytrace: metrics endpoint not started on %s:%d (%s: %s); the alarm still warns",
                settings.metrics_addr,
                port,
                type(exc).__name__,
                exc,
            )
            _SERVED["port"] = None
            return None
        _SERVED["port"] = server.server_port
        _SERVED["server"] = server
        log.info(
            "keytrace: metrics on http://%s:%d/metrics", settings.metrics_addr, server.server_port
        )
        return int(server.server_port)
