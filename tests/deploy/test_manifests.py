"""deploy/ read against the code it runs: every container's arguments parse with the real
`stagemesh` command line, probes and Services point at declared ports and health names, the
router names each stage's stable DNS name in pipeline order, and the data plane bypasses the
mesh proxies and is reachable from stage pods only."""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml

from stagemesh.cli import build_parser
from tests.deploy.manifests import (
    DEPLOY,
    Container,
    by_kind,
    containers,
    load_kustomization,
    role,
    selects,
)

BASE = load_kustomization(DEPLOY / "kubernetes")
OVERLAYS = ("istio", "linkerd")
REPO = DEPLOY.parent


def stage_containers() -> list[Container]:
    return sorted(role(BASE, "stage"), key=lambda c: int(c.flag("stage-index")))


def test_every_document_is_a_named_kubernetes_object() -> None:
    assert BASE
    for d in BASE:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), d


@pytest.mark.parametrize("container", containers(BASE), ids=lambda c: c.spec["name"])
def test_container_arguments_parse_with_the_real_cli(container: Container) -> None:
    assert container.spec["image"] == "stagemesh"
    args = build_parser().parse_args(container.args)  # exits (fails the test) on a bad flag
    assert args.command == container.role


@pytest.mark.parametrize("container", containers(BASE), ids=lambda c: c.spec["name"])
def test_probes_use_declared_ports_and_the_health_service_names(container: Container) -> None:
    declared = {p["containerPort"] for p in container.spec["ports"]}
    probes = [container.spec[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")
              if k in container.spec]
    assert {"livenessProbe", "readinessProbe"} <= container.spec.keys()
    for probe in probes:
        if "grpc" in probe:
            assert probe["grpc"]["port"] in declared
            assert probe["grpc"]["port"] == int(container.flag("port"))
            assert probe["grpc"]["service"] in ("liveness", "readiness")
        else:
            assert probe["httpGet"]["port"] in declared
            assert probe["httpGet"]["path"] in ("/health", "/ready")
    if any("grpc" in p for p in probes):
        assert container.spec["readinessProbe"]["grpc"]["service"] == "readiness"
        assert container.spec["livenessProbe"]["grpc"]["service"] == "liveness"


def test_router_names_every_stage_in_pipeline_order() -> None:
    (router,) = role(BASE, "router")
    stages = stage_containers()
    entries = router.flag("stages").split(",")
    assert len(entries) == len(stages) >= 2
    services = {s["metadata"]["name"]: s for s in by_kind(BASE, "Service")}
    for index, (entry, stage) in enumerate(zip(entries, stages, strict=True)):
        assert int(stage.flag("stage-index")) == index
        assert int(stage.flag("num-stages")) == len(stages)
        sts = stage.workload
        assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] == 1
        headless = services[sts["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None"
        assert selects(headless["spec"]["selector"], stage.pod["metadata"]["labels"])
        # Pod DNS name of a StatefulSet replica: <statefulset>-<ordinal>.<service>.
        host, _, port = entry.rpartition(":")
        assert host == f"{sts['metadata']['name']}-0.{headless['metadata']['name']}"
        assert int(port) == stage.port("control") == int(stage.flag("port"))
        # No other stage's pods answer to this Service.
        others = [s for s in stages if s is not stage]
        assert not any(selects(headless["spec"]["selector"], o.pod["metadata"]["labels"])
                       for o in others)


def test_gateway_reaches_the_router_over_the_pod_loopback() -> None:
    (router,) = role(BASE, "router")
    (gateway,) = role(BASE, "gateway")
    assert gateway.workload is router.workload  # a sidecar in the router's pod
    assert gateway.flag("router") == f"127.0.0.1:{router.flag('port')}"
    assert int(gateway.flag("port")) == gateway.port("http")


@pytest.mark.parametrize("container", stage_containers(), ids=lambda c: c.spec["name"])
def test_data_plane_bypasses_the_mesh_proxies(container: Container) -> None:
    port = container.flag("dataplane-port")
    assert int(port) == container.port("dataplane")
    annotations = container.pod["metadata"]["annotations"]
    for key in ("traffic.sidecar.istio.io/excludeInboundPorts",
                "traffic.sidecar.istio.io/excludeOutboundPorts",
                "config.linkerd.io/skip-inbound-ports", "config.linkerd.io/skip-outbound-ports"):
        assert port in annotations[key].split(","), key
    # Wildcard bind: the upstream stage dials the name the router uses for this stage.
    assert container.flag("dataplane-host") == "0.0.0.0"


def _ingress_rules_for(pod_labels: dict[str, str]) -> list[dict]:
    rules = []
    for policy in by_kind(BASE, "NetworkPolicy"):
        if selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels):
            rules.extend(policy["spec"]["ingress"])
    return rules


def test_network_policy_keeps_control_and_data_plane_inside_the_pipeline() -> None:
    (router,) = role(BASE, "router")
    router_labels = router.pod["metadata"]["labels"]
    for stage in stage_containers():
        labels = stage.pod["metadata"]["labels"]
        allowed: dict[int, list[dict[str, str]]] = {}
        open_to_all: set[int] = set()
        for rule in _ingress_rules_for(labels):
            ports = {int(p["port"]) for p in rule["ports"]}
            if "from" not in rule:  # only Prometheus's port is open to the cluster
                open_to_all |= ports
                continue
            sources = [f["podSelector"]["matchLabels"] for f in rule["from"]]
            for port in ports:
                allowed.setdefault(port, []).extend(sources)
        assert open_to_all == {stage.port("metrics")}
        assert set(allowed) == {stage.port("control"), stage.port("dataplane")}
        assert all(selects(s, router_labels) for s in allowed[stage.port("control")])
        for source in allowed[stage.port("dataplane")]:
            assert all(selects(source, s.pod["metadata"]["labels"]) for s in stage_containers())
            assert not selects(source, router_labels)
    open_ports = {int(p["port"]) for r in _ingress_rules_for(router_labels) for p in r["ports"]}
    assert open_ports == {int(router.flag("port")), int(role(BASE, "gateway")[0].flag("port")),
                          router.port("metrics")}


@pytest.mark.parametrize("container", [*stage_containers(), *role(BASE, "router")],
                         ids=lambda c: c.spec["name"])
def test_metrics_port_is_declared_and_outside_the_mesh_proxies(container: Container) -> None:
    port = container.flag("metrics-port")
    assert int(port) == container.port("metrics")
    annotations = container.pod["metadata"]["annotations"]
    for key in ("traffic.sidecar.istio.io/excludeInboundPorts",
                "config.linkerd.io/skip-inbound-ports"):
        assert port in annotations[key].split(","), key


def test_services_target_named_ports_of_the_pods_they_select() -> None:
    for service in by_kind(BASE, "Service"):
        pods = [c for c in containers(BASE)
                if selects(service["spec"]["selector"], c.pod["metadata"]["labels"])]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        names = {p["name"] for c in pods for p in c.spec["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names


def test_image_tag_is_the_package_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    kust = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    assert kust["images"] == [{"name": "stagemesh", "newTag": version}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mesh_overlays_put_everything_in_an_injected_namespace(overlay: str) -> None:
    docs = load_kustomization(DEPLOY / overlay)
    (namespace,) = by_kind(docs, "Namespace")
    name = namespace["metadata"]["name"]
    assert all(d["metadata"].get("namespace") == name for d in docs if d is not namespace)
    assert len(docs) > len(BASE)
    if overlay == "istio":
        assert namespace["metadata"]["labels"]["istio-injection"] == "enabled"
        (peer,) = by_kind(docs, "PeerAuthentication")
        assert peer["spec"]["mtls"]["mode"] == "STRICT"
    else:
        assert namespace["metadata"]["annotations"]["linkerd.io/inject"] == "enabled"


def test_dockerfile_installs_every_package_and_bakes_the_default_model() -> None:
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, flags=re.MULTILINE))
    assert {p.rstrip("*") for p in packages} <= copied
    assert "stagemesh fetch-model" in dockerfile
    assert 'ENTRYPOINT ["stagemesh"]' in dockerfile


def _secret_refs(container: Container) -> dict[str, tuple[str, str]]:
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.spec.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}
    return {name: (ref["name"], ref["key"]) for name, ref in refs.items()}


def test_router_and_gateway_share_optional_api_keys() -> None:
    (router,) = role(BASE, "router")
    (gateway,) = role(BASE, "gateway")
    router_refs, gateway_refs = _secret_refs(router), _secret_refs(gateway)
    assert router_refs["STAGEMESH_API_KEYS"] == gateway_refs["STAGEMESH_API_KEYS"]
    secret = router_refs["STAGEMESH_API_KEYS"][0]
    assert gateway_refs["STAGEMESH_ROUTER_API_KEY"][0] == secret
    for c in (router, gateway):
        assert all(e["valueFrom"]["secretKeyRef"]["optional"] for e in c.spec["env"]
                   if "secretKeyRef" in e.get("valueFrom", {}))


def test_router_and_stages_share_the_optional_pairing_secret() -> None:
    (router,) = role(BASE, "router")
    stages = role(BASE, "stage")
    assert len(stages) == 2
    want = _secret_refs(router)["STAGEMESH_STAGE_TOKEN"]
    for stage in stages:
        assert _secret_refs(stage)["STAGEMESH_STAGE_TOKEN"] == want
