"""The manifests' own commands, run as real processes on this machine: two stages, the
router and the gateway sidecar, with the arguments deploy/kubernetes gives them. Only what
a cluster provides differently is replaced: each listener gets its own free port (pods have
their own IPs; here all share one host) and the router dials 127.0.0.1 instead of the stages'
DNS names. Wildcard binds, the fixed data-plane port and its advertised address are kept."""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.request

import pytest

from foundation.ports import free_port
from stagemesh.local_mesh import Proc
from tests.deploy.manifests import DEPLOY, Container, load_kustomization, role
from tests.prom import sample

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # greedy, default model (checked against HF)


def _with(container: Container, **values: str) -> list[str]:
    """The container's arguments with `--name=value` replaced for the given names."""
    out = []
    for arg in container.args:
        name = arg.removeprefix("--").partition("=")[0]
        key = name.replace("-", "_")
        out.append(f"--{name}={values[key]}" if arg.startswith("--") and key in values else arg)
    return out


def _get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def test_the_manifest_commands_serve_a_chat_completion() -> None:
    docs = load_kustomization(DEPLOY / "kubernetes")
    stages = sorted(role(docs, "stage"), key=lambda c: int(c.flag("stage-index")))
    (router,) = role(docs, "router")
    (gateway,) = role(docs, "gateway")
    control = [free_port() for _ in stages]
    dataplane = [free_port() for _ in stages]
    metrics = [free_port() for _ in range(len(stages) + 1)]  # the stages', the router's
    router_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "stagemesh"]
    procs = [Proc([*cmd, *_with(s, port=str(control[i]), dataplane_port=str(dataplane[i]),
                                metrics_port=str(metrics[i]))])
             for i, s in enumerate(stages)]
    # In the cluster each stage is a pod of its own (its own host id), so `--transport auto`
    # links every hop over tcp through the fixed data-plane port; here the stages share a
    # host, where auto would take unix, so the router is asked for the cluster's choice.
    procs.append(Proc([*cmd, *_with(
        router, port=str(router_port), metrics_port=str(metrics[-1]),
        stages=",".join(f"127.0.0.1:{p}" for p in control)), "--transport", "tcp"]))
    procs.append(Proc([*cmd, *_with(gateway, port=str(http_port),
                                    router=f"127.0.0.1:{router_port}")]))
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 240
        while _get(f"{base}/ready")[0] != 200:
            dead = [p for p in procs if p.proc.poll() is not None]
            assert not dead, "a process exited:\n" + "\n".join(p.output[-3000:] for p in dead)
            assert time.monotonic() < deadline, "never ready:\n" + procs[-2].output[-3000:]
            time.sleep(0.5)

        body = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 32,
                "messages": [{"role": "user", "content": QUESTION}]}
        request = urllib.request.Request(f"{base}/v1/chat/completions",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            reply = json.load(r)
        assert reply["choices"][0]["message"]["content"] == ANSWER

        # The downstream stage listens on its fixed data-plane port (bound to the wildcard,
        # advertised under the router's name for it, which the upstream stage dialled).
        with socket.create_connection(("127.0.0.1", dataplane[1]), timeout=5):
            pass
        status, text = _get(f"{base}/metrics")
        assert status == 200
        for i in range(len(stages)):
            assert f'stagemesh_kv_blocks_used{{stage="{i}"}}' in text.decode()
        # the router and each stage serve their own metrics on the manifests' metrics port
        for i, port in enumerate(metrics):
            status, text = _get(f"http://127.0.0.1:{port}/metrics")
            name = ("stagemesh_stage_steps_total" if i < len(stages)
                    else "stagemesh_time_to_first_token_seconds_count")
            assert status == 200 and (sample(text.decode(), name) or 0) > 0, name
    finally:
        for p in reversed(procs):
            p.stop(timeout=30)
