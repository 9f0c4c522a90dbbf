"""Reading deploy/: kustomizations (resource lists and a namespace; no patches are used),
their documents, and the stagemesh containers in them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

Doc = dict[str, Any]


def load_kustomization(directory: Path) -> list[Doc]:
    """Every document a kustomization directory renders to (resources, recursively; the
    `namespace` field applied to namespaced kinds)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[Doc] = []
    for resource in kust.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            docs.extend(load_kustomization(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    if namespace := kust.get("namespace"):
        for d in docs:
            if d["kind"] != "Namespace":
                d["metadata"]["namespace"] = namespace
    return docs


def by_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


@dataclass(frozen=True)
class Container:
    """A container of a workload, with its pod template."""

    workload: Doc
    spec: Doc

    @property
    def pod(self) -> Doc:
        return self.workload["spec"]["template"]  # type: ignore[no-any-return]

    @property
    def args(self) -> list[str]:
        return [str(a) for a in self.spec.get("args", [])]

    @property
    def role(self) -> str:
        return self.args[0]

    def flag(self, name: str) -> str:
        """The value of `--name=value` (the manifests' only form)."""
        prefix = f"--{name}="
        values = [a.removeprefix(prefix) for a in self.args if a.startswith(prefix)]
        assert len(values) == 1, f"{self.spec['name']}: expected one {prefix}..., got {values}"
        return values[0]

    def port(self, name: str) -> int:
        ports = {p["name"]: p["containerPort"] for p in self.spec.get("ports", [])}
        return int(ports[name])


def containers(docs: list[Doc]) -> list[Container]:
    return [Container(w, c) for w in docs if w["kind"] in ("Deployment", "StatefulSet")
            for c in w["spec"]["template"]["spec"]["containers"]]


def role(docs: list[Doc], name: str) -> list[Container]:
    return [c for c in containers(docs) if c.role == name]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
