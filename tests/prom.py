"""Read a Prometheus /metrics text with prometheus_client's own parser (label order and
number formatting are the exposition library's business, not the tests')."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name` whose labels include `labels`; None if there is none."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None
