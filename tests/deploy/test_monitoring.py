"""deploy/ against the Kubernetes API schemas (offline, kubernetes-validate), and the
monitoring overlay against the metrics the services emit: the PodMonitor scrapes ports the
pods declare, and every metric the Grafana dashboard queries is one a service records."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client import CollectorRegistry

from tests.deploy.manifests import DEPLOY, by_kind, containers, load_kustomization, selects

KUBERNETES_VERSION = "1.33"  # validated against this release's API schemas
KUSTOMIZATIONS = ("kubernetes", "istio", "linkerd", "monitoring")
# Custom resources (their operators' CRDs hold the schema; no Kubernetes release has it).
CUSTOM_KINDS = {"PodMonitor": "monitoring.coreos.com/v1",
                "PeerAuthentication": "security.istio.io/v1"}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_document_validates_against_the_kubernetes_schemas(name: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in load_kustomization(DEPLOY / name):
        if doc["kind"] in CUSTOM_KINDS:
            assert doc["apiVersion"] == CUSTOM_KINDS[doc["kind"]]
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{name}: {doc['kind']} {doc['metadata']['name']}: "
                                 f"{e.message} at {list(e.path)}") from None


def test_pod_monitor_scrapes_ports_every_pod_declares() -> None:
    docs = load_kustomization(DEPLOY / "monitoring")
    (monitor,) = by_kind(docs, "PodMonitor")
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["podMetricsEndpoints"])
    selected = [c for c in containers(docs)
                if selects(monitor["spec"]["selector"]["matchLabels"],
                           c.pod["metadata"]["labels"])]
    roles = {c.role for c in selected}
    assert roles == {"router", "gateway", "stage"}
    for c in selected:  # each container serves metrics on one port the monitor scrapes
        names = {p["name"] for p in c.spec["ports"]}
        assert names & scraped, c.spec["name"]
    # the dashboard ships as a ConfigMap for Grafana's sidecar
    kust = (DEPLOY / "monitoring" / "kustomization.yaml").read_text()
    assert "grafana-dashboard.json" in kust and 'grafana_dashboard: "1"' in kust


def _emitted_names() -> set[str]:
    """Every sample name the services' metrics objects can expose."""
    from gateway.metrics import GatewayMetrics
    from router.metrics import CoreMetrics, FrontMetrics
    from stage_worker.metrics import StageMetrics, StepWindow

    registries = [CollectorRegistry() for _ in range(3)]
    FrontMetrics(registries[0])
    CoreMetrics(registries[1])
    StageMetrics(registries[2], StepWindow(), layers=(0, 1), device="cpu", tp_size=1,
                 kv_blocks_used=lambda: 0, kv_blocks_total=lambda: 1, sequences=lambda: 0)
    registries.append(GatewayMetrics().registry)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "info": ("_info",), "gauge": ("",)}
    return {family.name + suffix for r in registries for family in r.collect()
            for suffix in suffixes[family.type]}


def test_the_dashboard_queries_only_metrics_the_services_emit() -> None:
    dashboard = json.loads((DEPLOY / "monitoring" / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"stagemesh_[a-z0-9_]+", target["expr"])}
    emitted = _emitted_names()
    assert queried - emitted == set()
    # the staged mesh's own figures are on it
    assert {"stagemesh_stage_bubble_fraction", "stagemesh_stage_hop_send_seconds_bucket",
            "stagemesh_time_to_first_token_seconds_bucket"} <= queried
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
