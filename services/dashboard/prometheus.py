"""``/metrics``: the cluster's figures for Prometheus, read from Redis at each scrape.

A custom collector (prometheus_client's pattern for exporters of another
system's state): nothing is counted in this process, so a restarted
dashboard shows the same totals, and two dashboards agree. Names follow
Prometheus's conventions: base units (seconds, bytes), ``_total`` for
counters, labelled by ``job`` and ``device``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from common.logging import get_logger
from common.records.jobs import RECENT_JOBS
from common.secrets import mask_text
from services.dashboard.state import ClusterReader

__all__ = ["ClusterCollector", "registry_for"]

log = get_logger(__name__)


class ClusterCollector(Collector):
    """Yields the cluster's metric families from Redis each time it is collected."""

    def __init__(self, reader: ClusterReader) -> None:
        """Collect what `reader` reads."""
        self.reader = reader

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry then does not collect at registration (no Redis read)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The figures; with Redis away only ``asteroid_redis_up 0`` (Prometheus keeps the rest)."""
        up = GaugeMetricFamily("asteroid_redis_up", "Whether the cluster's Redis answered.")
        try:
            families = [*self._devices(), *self._jobs()]
        except Exception as exc:  # a scrape must answer: Redis away, or a record no one wrote
            log.warning("scrape could not read Redis", error=mask_text(str(exc)))
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        yield from families

    def _devices(self) -> list[Metric]:
        age = GaugeMetricFamily(
            "asteroid_device_heartbeat_age_seconds",
            "Seconds since the coordinator last heard the device's heartbeat.",
            labels=["device"],
        )
        up = GaugeMetricFamily(
            "asteroid_device_up",
            "1 while the device's heartbeat is fresh (within the heartbeat expiry), else 0.",
            labels=["device"],
        )
        memory = GaugeMetricFamily(
            "asteroid_device_memory_budget_bytes",
            "Bytes the device has left for training (0: unknown).",
            labels=["device"],
        )
        for d in self.reader.devices():
            if d["age_s"] is not None:
                age.add_metric([d["device"]], d["age_s"])
            up.add_metric([d["device"]], 1.0 if d["up"] else 0.0)
            memory.add_metric([d["device"]], float(d["memory_budget"]))
        return [age, up, memory]

    def _jobs(self) -> list[Metric]:
        job = ["job"]
        rounds = CounterMetricFamily(
            "asteroid_rounds_committed", "Training rounds committed.", labels=job
        )
        samples = CounterMetricFamily(
            "asteroid_samples",
            "Samples trained in committed rounds (replayed rounds included).",
            labels=job,
        )
        recoveries = CounterMetricFamily(
            "asteroid_recoveries", "Recoveries from lost devices.", labels=job
        )
        replans = CounterMetricFamily(
            "asteroid_replans", "Re-plans for joining or drained devices.", labels=job
        )
        duration = HistogramMetricFamily(
            "asteroid_round_duration_seconds", "Wall time of each committed round.", labels=job
        )
        loss = GaugeMetricFamily("asteroid_loss", "Training loss of the newest round.", labels=job)
        rate = GaugeMetricFamily(
            "asteroid_samples_per_second", "Throughput of the newest round.", labels=job
        )
        accuracy = GaugeMetricFamily(
            "asteroid_eval_accuracy", "Newest held-out accuracy (0-1).", labels=job
        )
        state = GaugeMetricFamily(
            "asteroid_job_state",
            "1 for the job's current lifecycle state.",
            labels=["job", "state"],
        )
        requests = CounterMetricFamily(
            "asteroid_inference_requests", "Inference requests answered.", labels=job
        )
        latency = HistogramMetricFamily(
            "asteroid_inference_latency_seconds",
            "Time from a request's start to its answer.",
            labels=job,
        )
        for look in self.reader.jobs(RECENT_JOBS):
            r, t, jid = look.record, look.tail, [look.job]
            state.add_metric([look.job, r.state], 1.0)
            if r.kind == "serve" or t.latency.count:
                requests.add_metric(jid, float(t.latency.count))
                latency.add_metric(jid, t.latency.cumulative(), t.latency.total)
                continue
            rounds.add_metric(jid, float(r.round or 0))
            samples.add_metric(jid, t.samples)
            recoveries.add_metric(jid, float(t.recoveries))
            replans.add_metric(jid, float(t.replans))
            duration.add_metric(jid, t.rounds.cumulative(), t.rounds.total)
            for family, value in ((loss, r.loss), (rate, r.samples_per_s)):
                if value is not None:
                    family.add_metric(jid, value)
            if r.eval_accuracy is not None:
                accuracy.add_metric(jid, r.eval_accuracy)
        training = [rounds, samples, recoveries, replans, duration, loss, rate, accuracy]
        return [*training, state, requests, latency]


def registry_for(reader: ClusterReader) -> CollectorRegistry:
    """A registry holding only the cluster's collector (no process metrics of the dashboard)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(reader))
    return registry
