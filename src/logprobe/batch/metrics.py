"""/metrics of the Batch API, read from the store at scrape time: batches by status and their lines
by result, summed over every key (no key, batch or file id is ever a label)."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from .store import ACTIVE, TERMINAL


class BatchMetrics:
    """A prometheus_client collector over the store (the numbers survive a restart, and every ingress of
    a store reports the same)."""

    def __init__(self, store):
        self.store = store

    def collect(self):
        by_status, done, failed = self.store.totals()
        batches = GaugeMetricFamily("logprobe_batches", "Batches kept in the store, by status", labels=["status"])
        for status in (*ACTIVE, *TERMINAL):
            batches.add_metric([status], by_status.get(status, 0))
        lines = GaugeMetricFamily("logprobe_batch_lines", "Lines of the kept batches answered: done (status 200, "
                                  "in the output file) or failed (in the error file)", labels=["result"])
        lines.add_metric(["done"], done)
        lines.add_metric(["failed"], failed)
        return [batches, lines]
