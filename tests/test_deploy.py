"""The deployment files, validated offline (no Docker engine or cluster here): every kustomize
overlay and the RayService (k8s/ray) against the Kubernetes 1.32 schemas in strict mode, compose.yaml
(and with the CPU override merged in) against the compose-spec schema and `docker-compose config`,
the Dockerfile with hadolint, all of them with checkov (compose, which checkov cannot read, by the
properties asserted here); who may reach whom under the NetworkPolicies, worked out from the rendered
manifests; the Redis configurations run for real (a TLS-built redis-server) against the files
`specd keys init` makes; the image's lock file against pyproject.toml; and every environment variable
the manifests set for a specd container is one that container's entrypoint actually reads.

Over 350 lines: one test per property of the deployment files, all offline."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import tomllib
from functools import cache
from pathlib import Path, PurePosixPath

import pytest
import redis
import yaml
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from services.common import certs, discovery, secrets_init
from services.common.redis_server import answers_ping, free_port
from services.common.tls import EdgeTls

pytestmark = pytest.mark.slow  # checkov, docker-compose, kubectl and a TLS redis-server, which scripts/test installs

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
OVERLAYS = sorted(p.name for p in (ROOT / "k8s" / "overlays").iterdir() if p.is_dir())
FIRST_PARTY_IMAGES = ("specd", "ghcr.io/specd/specd")  # ours: a release pins them (kustomize `images: digest`)
PINNED = re.compile(r"^[^@\s]+:[^@\s]+@sha256:[0-9a-f]{64}$")  # name:tag@sha256:digest (the tag says which)
ENTRYPOINTS = {  # how a container's command names what runs in it
    "services.draft": [sys.executable, "-m", "services.draft", "--help"],
    "services.target": [sys.executable, "-m", "services.target", "--help"],
    "services.coordinator": [sys.executable, "-m", "services.coordinator", "--help"],
    "models fetch": [sys.executable, "-m", "services.cli", "models", "fetch", "--help"],
}


def run(*cmd: str, stdin: str | None = None) -> str:
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def tool(name: str) -> str:
    path = shutil.which(name, path=f"{BIN}:/usr/local/bin:/usr/bin")
    assert path, f"{name} is not installed (scripts/test installs it)"
    return path


@cache
def kustomize(target: str) -> str:
    """A rendered overlay (`gpu`, `cpu`) or `ray` (k8s/ray: the RayService and its policies)."""
    return run(tool("kubectl"), "kustomize", "k8s/ray" if target == "ray" else f"k8s/overlays/{target}")


def docs(target: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(kustomize(target)) if d]


def by_kind_and_name(target: str) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs(target)}


def ray_pods(rendered: list[dict]) -> dict[str, dict]:
    """The RayService's pods, as Pods (its CRD is in no schema and no scanner; its pod templates are
    plain pod specs): name -> Pod."""
    pods = {}
    for service in (d for d in rendered if d["kind"] == "RayService"):
        cluster = service["spec"]["rayClusterConfig"]
        groups = [("head", cluster["headGroupSpec"]), *((w["groupName"], w) for w in cluster["workerGroupSpecs"])]
        for group, spec in groups:
            name = f"{service['metadata']['name']}-ray-{group}"
            metadata = {"name": name, "namespace": service["metadata"]["namespace"], **spec["template"].get("metadata", {})}
            pods[name] = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec["template"]["spec"]}
    return pods


def pod_templates(target: str) -> dict[str, dict]:
    """Every pod a target runs: name -> {"labels", "spec", "claims"} (claims: volumeClaimTemplates)."""
    rendered = docs(target)
    found = {d["metadata"]["name"]: {"labels": d["spec"]["template"]["metadata"].get("labels", {}),
                                     "spec": d["spec"]["template"]["spec"],
                                     "claims": {c["metadata"]["name"] for c in d["spec"].get("volumeClaimTemplates", [])}}
             for d in rendered if "template" in d.get("spec", {})}
    for name, pod in ray_pods(rendered).items():
        found[name] = {"labels": pod["metadata"].get("labels", {}), "spec": pod["spec"], "claims": set()}
    return found


def pods(overlay: str) -> dict[str, dict]:
    return {name: pod["spec"] for name, pod in pod_templates(overlay).items()}


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


# --- Kubernetes: schemas --------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_valid_kubernetes(overlay):
    run(tool("kubernetes-validate"), "--strict", "-k", "1.32.0", "-", stdin=kustomize(overlay))


def test_the_rayservice_pods_and_policies_are_valid_kubernetes():
    """The RayService's own schema is KubeRay's; its pod templates and NetworkPolicies are Kubernetes'."""
    rendered = docs("ray")
    objects = [d for d in rendered if d["kind"] != "RayService"] + list(ray_pods(rendered).values())
    assert {d["kind"] for d in objects} == {"NetworkPolicy", "Pod"} and len(ray_pods(rendered)) == 2
    run(tool("kubernetes-validate"), "--strict", "-k", "1.32.0", "-", stdin=yaml.safe_dump_all(objects))


# --- Kubernetes: the overlays' shape ----------------------------------------------------------


def test_gpu_overlay_pins_each_model_service_to_its_own_gpu_pool():
    found = by_kind_and_name("gpu")
    for role in ("draft", "target"):
        pod = found["Deployment", role]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"specd.io/pool": role}
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        container = pod["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["readinessProbe"]["grpc"] and container["livenessProbe"]["grpc"]
        assert pod["initContainers"][0]["command"] == ["specd", "models", "fetch"]
    kinds = {kind for kind, _ in found}
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "StatefulSet", "ConfigMap", "Service"} <= kinds
    assert "volumeClaimTemplates" in found["StatefulSet", "redis"]["spec"]


def specd_config(found: dict) -> dict[str, str]:
    return found["ConfigMap", next(name for kind, name in found if kind == "ConfigMap" and "specd-config" in name)]["data"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_coordinator_finds_each_pool_through_a_headless_service(overlay):
    found = by_kind_and_name(overlay)
    config = specd_config(found)
    for role, port in (("draft", 50052), ("target", 50053)):
        pool = discovery.resolver(config[f"SPECD_{role.upper()}_ADDR"])
        assert isinstance(pool, discovery.Dns) and pool.port == port
        service = found["Service", pool.host]["spec"]
        assert service["clusterIP"] == "None"  # a record per pod, not one virtual IP
        labels = found["Deployment", role]["spec"]["template"]["metadata"]["labels"]
        assert service["selector"].items() <= labels.items()


def test_gpu_overlay_pools_keep_a_replica_through_voluntary_disruptions():
    found = by_kind_and_name("gpu")
    for role in ("draft", "target"):
        replicas = found["Deployment", role]["spec"]["replicas"]
        budget = found["PodDisruptionBudget", role]["spec"]
        assert replicas >= 2 and budget == {"minAvailable": 1, "selector": budget["selector"]}


# --- Kubernetes: what every pod runs as --------------------------------------------------------


@pytest.mark.parametrize("target", [*OVERLAYS, "ray"])
def test_every_pod_runs_locked_down_with_requests_and_limits(target):
    found = pod_templates(target)
    assert found
    for name, template in found.items():
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        security = pod["securityContext"]
        assert security["runAsNonRoot"] and security["runAsUser"] >= 10000, name
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        writable = template["claims"] | {v["name"] for v in pod.get("volumes", [])
                                         if "emptyDir" in v or "persistentVolumeClaim" in v}
        for container in containers(pod):
            where = f"{target}/{name}/{container['name']}"
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            }, where
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"]), where
            assert any(m["name"] in writable for m in container.get("volumeMounts", [])) or name == "jaeger", where


def image_refs(target: str) -> list[str]:
    return [c["image"] for pod in pods(target).values() for c in containers(pod)]


def compose_images(tmp_path) -> list[str]:
    """As compose runs them: `${SPECD_IMAGE:-specd:cuda}` is specd:cuda unless told otherwise."""
    return [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", s["image"]) for path in compose_files(tmp_path).values()
            for s in yaml.safe_load(path.read_text())["services"].values() if "image" in s]


def test_every_third_party_image_is_pinned_by_digest(tmp_path):
    """Redis, Jaeger and the Dockerfile's base image, wherever they appear: `name:tag@sha256:...` (a
    tag alone can be moved under us). specd's own image is pinned by a release overlay (next test)."""
    base_image = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    images = [*compose_images(tmp_path), *(i for t in [*OVERLAYS, "ray"] for i in image_refs(t)), base_image]
    third_party = {i for i in images if i.split("@")[0].rsplit(":", 1)[0] not in FIRST_PARTY_IMAGES}
    assert {i.split(":")[0] for i in third_party} >= {"redis", "jaegertracing/all-in-one", "python"}
    unpinned = sorted(i for i in third_party if not PINNED.match(i))
    assert not unpinned, f"pin these by digest (docker buildx imagetools inspect NAME:TAG): {unpinned}"



def test_a_release_pins_every_specd_image_by_digest(tmp_path):
    """`images: digest:` in an overlay reaches every container of ours, init containers included."""
    digest = "sha256:" + "0" * 64
    names = sorted({i.split("@")[0].rsplit(":", 1)[0] for o in OVERLAYS for i in image_refs(o)} & set(FIRST_PARTY_IMAGES))
    assert names
    overlay = tmp_path / "release"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(ROOT / "k8s/overlays/gpu", overlay)],
        "images": [{"name": n, "digest": digest} for n in names],
    }))
    rendered = run(tool("kubectl"), "kustomize", str(overlay))
    images = [c["image"] for d in yaml.safe_load_all(rendered) if d and "template" in d.get("spec", {})
              for c in containers(d["spec"]["template"]["spec"])]
    ours = [i for i in images if i.split("@")[0].rsplit(":", 1)[0] in names]
    assert ours and all(image.endswith("@" + digest) for image in ours), ours
    assert all(PINNED.match(i) for i in images if i not in ours)


# --- Kubernetes: who may reach whom ----------------------------------------------------------

NAMESPACE = {"kubernetes.io/metadata.name": "specd"}
# The namespaces outside specd a policy may name, and which pods there: the ingress controller, the
# scraper, kube-dns, the KubeRay operator.
OUTSIDE = {
    "ingress": ({"kubernetes.io/metadata.name": "ingress-nginx"}, {}),
    "scraper": ({"specd.io/scrape": "allowed"}, {}),
    "dns": ({"kubernetes.io/metadata.name": "kube-system"}, {"k8s-app": "kube-dns"}),
    "kuberay": ({"kubernetes.io/metadata.name": "kuberay-operator"}, {"app.kubernetes.io/name": "kuberay-operator"}),
}
INTERNET = "203.0.113.7"  # an address outside the cluster (TEST-NET-3)


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against a pod's labels."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        if not {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
                "Exists": has, "DoesNotExist": not has}[e["operator"]]:
            return False
    return True


def peer_matches(peer: dict, endpoint) -> bool:
    """A from/to entry against an endpoint: ("pod", labels), ("outside", (namespace labels, pod labels))
    or ("ip", address)."""
    kind, what = endpoint
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        if kind != "ip" or ":" in block["cidr"]:
            return False
        from ipaddress import ip_address, ip_network
        return ip_address(what) in ip_network(block["cidr"]) and not any(
            ip_address(what) in ip_network(e) for e in block.get("except", []))
    if kind == "ip":
        return False
    namespace, labels = (NAMESPACE, what) if kind == "pod" else what
    if "namespaceSelector" in peer:
        return selects(peer["namespaceSelector"], namespace) and selects(peer.get("podSelector"), labels)
    return kind == "pod" and selects(peer["podSelector"], labels)


def rule_allows(rule: dict, direction: str, endpoint, port: int) -> bool:
    peers = rule.get(direction)
    ports = rule.get("ports")
    return (not peers or any(peer_matches(p, endpoint) for p in peers)) and (
        not ports or any(p.get("port") in (None, port) for p in ports))


class Network:
    """The NetworkPolicies of specd's namespace (an overlay and k8s/ray, applied together), worked
    out as Kubernetes does: a pod selected by a policy of a direction is isolated in it and allowed
    the union of the rules of the policies that select it."""

    def __init__(self, overlay: str):
        rendered = docs(overlay) + docs("ray")
        self.policies = [d["spec"] for d in rendered if d["kind"] == "NetworkPolicy"]
        self.pods = {name: pod["labels"] for t in (overlay, "ray") for name, pod in pod_templates(t).items()}

    def _allows(self, pod: str, kind: str, direction: str, endpoint, port: int) -> bool:
        relevant = [p for p in self.policies if selects(p["podSelector"], self.pods[pod]) and kind in p["policyTypes"]]
        return not relevant or any(rule_allows(r, direction, endpoint, port) for p in relevant for r in p.get(kind.lower(), []))

    def allowed(self, source: str, destination: str, port: int) -> bool:
        """source and destination: a pod's name, an OUTSIDE key, or "internet"."""
        def endpoint(name):
            if name == "internet":
                return ("ip", INTERNET)
            return ("outside", OUTSIDE[name]) if name in OUTSIDE else ("pod", self.pods[name])
        out = source not in self.pods or self._allows(source, "Egress", "to", endpoint(destination), port)
        into = destination not in self.pods or self._allows(destination, "Ingress", "from", endpoint(source), port)
        return out and into


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_network_policy_selects_pods_that_exist(overlay):
    """A selector that matches no pod is a policy that silently does nothing (or a flow silently
    dropped): each podSelector, and each from/to podSelector of this namespace, names real pods."""
    rendered = docs(overlay) + docs("ray")
    labels = [pod["labels"] for t in (overlay, "ray") for pod in pod_templates(t).values()]
    policies = {d["metadata"]["name"]: d["spec"] for d in rendered if d["kind"] == "NetworkPolicy"}
    for name, policy in policies.items():
        assert policy["podSelector"] == {} or any(selects(policy["podSelector"], l) for l in labels), name
        for rule in policy.get("ingress", []) + policy.get("egress", []):
            for peer in rule.get("from", []) + rule.get("to", []):
                if "namespaceSelector" in peer:
                    assert (peer["namespaceSelector"].get("matchLabels"), peer.get("podSelector", {}).get("matchLabels", {})) in [
                        (ns, pod) for ns, pod in OUTSIDE.values()], (name, peer)
                elif "podSelector" in peer:
                    assert any(selects(peer["podSelector"], l) for l in labels), (name, peer)
    assert len(policies) >= 8


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_the_flows_specd_uses_and_no_others(overlay):
    net = Network(overlay)
    head, worker = "specd-ray-head", "specd-ray-gpu"  # the RayService's head and its GPU worker group
    assert {head, worker} <= set(net.pods)
    needed = [
        ("coordinator", "draft", 50052), ("coordinator", "target", 50053), ("coordinator", "redis", 6379),
        ("coordinator", "jaeger", 4317), ("draft", "jaeger", 4317), ("target", "jaeger", 4317),
        ("ingress", "coordinator", 50051), ("ingress", "coordinator", 8000), ("scraper", "coordinator", 8000),
        ("scraper", "draft", 9101), ("scraper", "target", 9102),
        # Ray: head <-> workers on Ray's own ports (GCS, dashboard, a worker port it picked), the gateway
        # replicas to Redis, spans to Jaeger, the operator to the dashboard, clients to Serve.
        (worker, head, 6379), (head, worker, 10005), (worker, worker, 23456), (worker, head, 8265),
        (head, "redis", 6379), (worker, "redis", 6379), (worker, "jaeger", 4317),
        ("kuberay", head, 8265), ("ingress", head, 8000), ("ingress", worker, 8000),
    ]
    needed += [(pod, "dns", 53) for pod in ("coordinator", "draft", "target", head, worker)]
    needed += [(pod, "internet", 443) for pod in ("coordinator", "draft", "target", head)]  # `specd models fetch`
    for flow in needed:
        assert net.allowed(*flow), f"{overlay}: {flow} is blocked"
    refused = [
        ("draft", "redis", 6379), ("target", "redis", 6379), ("draft", "target", 50053), ("target", "draft", 50052),
        ("draft", "coordinator", 50051), ("jaeger", "redis", 6379), ("redis", "coordinator", 50051),
        (head, "draft", 50052), (worker, "target", 50053), ("coordinator", head, 6379),
        ("ingress", "draft", 50052), ("ingress", "redis", 6379), ("ingress", "jaeger", 16686),
        ("scraper", "coordinator", 50051), ("kuberay", head, 6379), ("kuberay", "redis", 6379),
        ("redis", "internet", 443), ("jaeger", "internet", 443), ("redis", "dns", 53), ("jaeger", "dns", 53),
        ("coordinator", "internet", 80), ("draft", "internet", 6379), ("coordinator", "kuberay", 8265),
    ]
    for flow in refused:
        assert not net.allowed(*flow), f"{overlay}: {flow} is open"
    assert {"default-deny"} == {d["metadata"]["name"] for d in docs(overlay) if d["kind"] == "NetworkPolicy"
                                and d["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}}


# --- Kubernetes: Redis and the coordinator's edge ---------------------------------------------


def secret_file(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret, key) behind a mounted file."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    name = path[len(mount["mountPath"]) + 1:]
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
    assert not items or name in items, (path, items)
    return volume["secret"]["secretName"], items.get(name, name)


def redis_conf(found: dict) -> dict[str, str]:
    text = found["ConfigMap", next(n for k, n in found if k == "ConfigMap" and n.startswith("redis-config"))]["data"]["redis.conf"]
    return dict(line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_serves_tls_only_with_the_password_from_its_secret_and_no_shell(overlay):
    found = by_kind_and_name(overlay)
    redis_pod = found["StatefulSet", "redis"]["spec"]["template"]["spec"]
    (server,) = redis_pod["containers"]
    assert server["command"] == ["redis-server", "/etc/redis/redis.conf"]  # no shell, nothing secret in argv
    conf = redis_conf(found)
    assert (conf["port"], conf["tls-port"], conf["tls-auth-clients"]) == ("0", "6379", "no")
    assert (conf["appendonly"], conf["appendfsync"]) == ("yes", "always")
    assert secret_file(redis_pod, server, conf["include"]) == ("specd-redis", "auth.conf")
    files = {name: secret_file(redis_pod, server, conf[name]) for name in ("tls-cert-file", "tls-key-file", "tls-ca-cert-file")}
    assert files == {"tls-cert-file": ("specd-tls", "redis.pem"), "tls-key-file": ("specd-tls", "redis-key.pem"),
                     "tls-ca-cert-file": ("specd-tls", "ca.pem")}
    probe = server["readinessProbe"]["exec"]["command"][-1]
    assert "--tls" in probe and secret_file(redis_pod, server, re.search(r"cat (/\S+)\)", probe).group(1)) == ("specd-redis", "password")
    # The clients: rediss:// to a name Redis's certificate carries, the CA from specd-tls, the password from specd-redis.
    coordinator = found["Deployment", "coordinator"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in coordinator["containers"][0]["env"]}
    url = specd_config(found)["SPECD_REDIS_URL"]
    application = yaml.safe_load(by_kind_and_name("ray")["RayService", "specd"]["spec"]["serveConfigV2"])["applications"][0]
    for client, client_url in ((coordinator, url), (ray_pods(docs("ray"))["specd-ray-head"]["spec"], application["args"]["redis_url"])):
        parsed = re.match(r"rediss://([^:/@]+):6379/0\?ssl_ca_certs=(/\S+)$", client_url)
        assert parsed and parsed.group(1) in certs.REDIS_HOSTS, client_url
        assert secret_file(client, client["containers"][0], parsed.group(2)) == ("specd-tls", "ca.pem")
    assert secret_file(coordinator, coordinator["containers"][0], env["SPECD_REDIS_PASSWORD_FILE"]) == ("specd-redis", "password")
    assert "secretKeyRef" not in kustomize(overlay)  # secrets are files, never environment variables


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_coordinator_serves_its_edge_with_the_certificate_of_its_secret(overlay):
    pod = by_kind_and_name(overlay)["Deployment", "coordinator"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert secret_file(pod, container, env["SPECD_EDGE_TLS_CERT"]) == ("coordinator-edge-tls", "tls.crt")
    assert secret_file(pod, container, env["SPECD_EDGE_TLS_KEY"]) == ("coordinator-edge-tls", "tls.key")
    # kubelet probes speak no TLS to gRPC: readiness on the plaintext health-only port; liveness over HTTPS.
    assert container["readinessProbe"]["grpc"]["port"] == int(env["SPECD_HEALTH_PORT"])
    assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"


# --- Redis, run for real with the deployments' configuration ----------------------------------


def start_redis(binary: str, argv: list[str], port: int, password: str, ca: Path, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([binary, *argv, "--logfile", str(log)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    context = ssl.create_default_context(cafile=str(ca))
    deadline = time.monotonic() + 20
    while not answers_ping(port, password, context):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.05)
    return proc


def check_redis_client(url: str, password: str, port: int) -> None:
    """What the coordinator does: its URL (TLS, the CA) and its password; and what others cannot."""
    client = redis.Redis.from_url(url, password=password, socket_timeout=5)
    assert client.ping()
    assert client.config_get("appendonly") == {"appendonly": "yes"}
    assert client.config_get("appendfsync") == {"appendfsync": "always"}
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url, socket_timeout=5).ping()
    with pytest.raises(redis.exceptions.ConnectionError):  # plaintext to the TLS port
        redis.Redis(port=port, password=password, socket_timeout=2).ping()


def test_compose_redis_runs_its_command_on_the_files_keys_init_makes(tmp_path, tls_redis_binary):
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    secrets = tmp_path / "secrets"
    secrets_init.init(secrets)
    (tmp_path / "data").mkdir()
    redis_, coordinator = services["redis"], services["coordinator"]

    def host_path(service: dict) -> callable:
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}

        def at(path: str) -> str:
            mount = next(m for m in mounts if path == m or path.startswith(m + "/"))
            source = mounts[mount]
            where = tmp_path / "data" if source == "redis-data" else tmp_path / source.removeprefix("./")
            return str(where) + path[len(mount):]
        return at

    port = free_port()
    argv = [host_path(redis_)(a) if a.startswith("/") else a for a in redis_["entrypoint"][1:] + redis_["command"]]
    argv[argv.index("--tls-port") + 1] = str(port)
    password = (secrets / "coordinator" / "redis-password").read_text().strip()
    env = coordinator["environment"]
    url = re.sub(r"ca_certs=(\S+)", lambda m: "ca_certs=" + host_path(coordinator)(m.group(1)), env["SPECD_REDIS_URL"])
    url = url.replace("rediss://redis:6379", f"rediss://localhost:{port}")
    assert Path(host_path(coordinator)(env["SPECD_REDIS_PASSWORD_FILE"])).read_text().strip() == password
    proc = start_redis(tls_redis_binary, argv, port, password, secrets / "tls" / "redis" / "ca.pem", tmp_path / "redis.log")
    try:
        assert password not in " ".join(argv)
        check_redis_client(url, password, port)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_redis_runs_its_config_on_the_secrets_the_readme_makes(tmp_path, overlay, tls_redis_binary):
    """The Secrets as README's Deploying section makes them (`specd keys init`, `specd certs`), mounted
    where the StatefulSet and the coordinator mount them; the rendered redis.conf, run."""
    secrets = tmp_path / "secrets"
    secrets_init.init(secrets)
    certs.make(tmp_path / "tls")
    secret_data = {  # Secret -> key -> file (README: kubectl create secret generic ... --from-file)
        "specd-redis": {"password": secrets / "coordinator" / "redis-password", "auth.conf": secrets / "redis" / "auth.conf"},
        "specd-tls": {p.name: p for p in (tmp_path / "tls").iterdir()},
        "specd-api-keys": {"keys": secrets / "coordinator" / "api-keys"},
    }
    found = by_kind_and_name(overlay)

    def mount(pod: dict, container: dict, extra: dict[str, str]) -> callable:
        """Lay out the container's mounts (the Secrets above, ConfigMap files `extra`, empty volumes) in a
        directory of its own; returns container path -> host path."""
        root = tmp_path / container["name"]
        places = {}
        for m in container["volumeMounts"]:
            volume = next(v for v in pod["volumes"] if v["name"] == m["name"]) if m["name"] in {
                v["name"] for v in pod.get("volumes", [])} else {}
            where = root / m["mountPath"].lstrip("/")
            where.mkdir(parents=True, exist_ok=True)
            if "secret" in volume and volume["secret"]["secretName"] in secret_data:
                data = secret_data[volume["secret"]["secretName"]]
                for item in volume["secret"].get("items", [{"key": k, "path": k} for k in data]):
                    shutil.copy(data[item["key"]], where / item["path"])
            elif "configMap" in volume:
                for name, text in extra.items():
                    (where / name).write_text(text)
            places[m["mountPath"]] = where
        return lambda path: str(places[next(m for m in places if path.startswith(m + "/"))]) + path[len(next(
            m for m in places if path.startswith(m + "/"))):]

    redis_pod = found["StatefulSet", "redis"]["spec"]["template"]["spec"]
    config_map = found["ConfigMap", next(n for k, n in found if k == "ConfigMap" and n.startswith("redis-config"))]["data"]
    at = mount(redis_pod, redis_pod["containers"][0], config_map)
    port = free_port()
    conf = re.sub(r"(?m)^(include|tls-[\w-]+-file|dir) (/\S+)$", lambda m: f"{m.group(1)} {at(m.group(2) + ('/' if m.group(1) == 'dir' else ''))}",
                  config_map["redis.conf"])
    conf = conf.replace("tls-port 6379", f"tls-port {port}")
    (tmp_path / "redis.conf").write_text(conf)
    coordinator = found["Deployment", "coordinator"]["spec"]["template"]["spec"]
    client_at = mount(coordinator, coordinator["containers"][0], {})
    env = {e["name"]: e.get("value") for e in coordinator["containers"][0]["env"]}
    password = Path(client_at(env["SPECD_REDIS_PASSWORD_FILE"])).read_text().strip()
    url = re.sub(r"ca_certs=(\S+)", lambda m: "ca_certs=" + client_at(m.group(1)), specd_config(found)["SPECD_REDIS_URL"])
    url = re.sub(r"rediss://[^/]+/", f"rediss://localhost:{port}/", url)
    ca = Path(at(redis_conf(found)["tls-ca-cert-file"]))
    proc = start_redis(tls_redis_binary, [str(tmp_path / "redis.conf")], port, password, ca, tmp_path / "redis.log")
    try:
        check_redis_client(url, password, port)
    finally:
        proc.kill()
        proc.wait()


# --- compose --------------------------------------------------------------------------------


class Reset:
    """compose's `!reset` tag: the override removes the key."""


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())


def merge(base, override):
    """Compose's merge of an override file: mappings merge key by key, `!reset` removes, the
    rest (scalars, sequences of these files) is replaced."""
    if not isinstance(base, dict) or not isinstance(override, dict):
        return override
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Reset):
            merged.pop(key, None)
        else:
            merged[key] = merge(base.get(key), value)
    return merged


def compose_files(tmp_path) -> dict[str, Path]:
    base = yaml.load((ROOT / "compose.yaml").read_text(), ComposeLoader)
    cpu = merge(base, yaml.load((ROOT / "compose.cpu.yaml").read_text(), ComposeLoader))
    merged = tmp_path / "compose.merged-cpu.yaml"
    merged.write_text(yaml.safe_dump(cpu))
    return {"gpu": ROOT / "compose.yaml", "cpu": merged}


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_compose_is_valid(tmp_path, variant):
    path = compose_files(tmp_path)[variant]
    run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))
    run(tool("docker-compose"), "-f", str(path), "--project-directory", str(ROOT), "config", "-q")


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_compose_publishes_ports_on_this_host_only_unless_told(tmp_path, variant):
    path = compose_files(tmp_path)[variant]

    def published(env: dict[str, str]) -> set[str]:
        config = yaml.safe_load(subprocess.run(
            [tool("docker-compose"), "-f", str(path), "--project-directory", str(ROOT), "config"],
            capture_output=True, text=True, check=True, cwd=ROOT, env={"PATH": "/usr/bin:/bin", **env}).stdout)
        return {host_ip(p) for s in config["services"].values() for p in s.get("ports", [])}

    def host_ip(port) -> str:  # long syntax, or docker-compose 1's "ip:published:target"
        if isinstance(port, dict):
            return port.get("host_ip", "0.0.0.0")
        parts = str(port).split(":")
        return parts[0] if len(parts) == 3 else "0.0.0.0"

    assert published({}) == {"127.0.0.1"}
    assert published({"SPECD_BIND_ADDRESS": "0.0.0.0"}) == {"0.0.0.0", "127.0.0.1"}  # the trace UI stays local


def test_compose_gives_each_model_service_its_own_gpu_and_the_cpu_override_none(tmp_path):
    files = compose_files(tmp_path)
    gpu = yaml.safe_load(files["gpu"].read_text())["services"]
    cpu = yaml.safe_load(files["cpu"].read_text())["services"]
    devices = {role: gpu[role]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for role in ("draft", "target")}
    assert devices == {"draft": ["${SPECD_DRAFT_GPU:-0}"], "target": ["${SPECD_TARGET_GPU:-1}"]}
    assert "deploy" not in cpu["draft"] and "deploy" not in cpu["target"]
    assert cpu["draft"]["environment"]["SPECD_DEVICE"] == "cpu"
    for name, service in gpu.items():
        assert "healthcheck" in service or name == "keys", name  # keys: a one-shot step, done in a second
    assert gpu["coordinator"]["depends_on"]["draft"] == {"condition": "service_healthy"}
    command = gpu["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes" and command[command.index("--appendfsync") + 1] == "always"


def mounts(service: dict) -> dict[str, str]:
    """Container path -> source, for bind mounts of ./secrets."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", []) if v.startswith("./secrets")}


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_compose_mounts_each_service_its_own_secrets_only(tmp_path, variant):
    """Made on the first run by `keys` (`specd keys init`), one directory per container: the
    coordinator sees its key, its Redis password and its certificate, Redis its password file and
    its certificate, each model service its certificate, and none another's key."""
    services = yaml.safe_load(compose_files(tmp_path)[variant].read_text())["services"]
    keys = services["keys"]
    assert keys["command"][:3] == ["specd", "keys", "init"] and "./secrets:/secrets" in keys["volumes"]
    assert "secrets/" in (ROOT / ".gitignore").read_text().splitlines()
    made = tmp_path / "secrets"
    secrets_init.init(made)
    own = {"coordinator": {"./secrets/coordinator", "./secrets/tls/coordinator", "./secrets/tls/edge"},
           "redis": {"./secrets/redis", "./secrets/tls/redis"},
           "draft": {"./secrets/tls/draft"}, "target": {"./secrets/tls/target"}}
    for name, service in services.items():
        if name != "keys":
            assert set(mounts(service).values()) == own.get(name, set()), name
            assert all(v.endswith(":ro") for v in service.get("volumes", []) if v.startswith("./secrets")), name
        for source in mounts(service).values() if name != "keys" else ():
            assert (made / source.removeprefix("./secrets/")).is_dir(), source  # keys init makes what is mounted
        if name in ("coordinator", "redis"):
            assert service["depends_on"]["keys"] == {"condition": "service_completed_successfully"}

    def file_of(service: dict, path: str) -> Path:
        mount = next(m for m in mounts(service) if path.startswith(m + "/"))
        return made / mounts(service)[mount].removeprefix("./secrets/") / path[len(mount) + 1:]

    coordinator = services["coordinator"]
    env = coordinator["environment"]
    assert file_of(coordinator, env["SPECD_API_KEYS_FILE"]) == made / "coordinator" / "api-keys"
    assert file_of(coordinator, env["SPECD_REDIS_PASSWORD_FILE"]) == made / "coordinator" / "redis-password"
    assert file_of(coordinator, env["SPECD_TLS_DIR"] + "/coordinator-key.pem").is_file()
    assert file_of(coordinator, re.search(r"ssl_ca_certs=(\S+)", env["SPECD_REDIS_URL"]).group(1)).is_file()
    # Its edges serve TLS with the edge certificate keys init made (no plaintext: SPECD_INSECURE is gone),
    # which its healthcheck verifies, as clients on this host do, against the CA mounted beside it.
    assert "SPECD_INSECURE" not in env
    edge = EdgeTls(file_of(coordinator, env["SPECD_EDGE_TLS_CERT"]), file_of(coordinator, env["SPECD_EDGE_TLS_KEY"]))
    assert edge.cert == made / "tls" / "edge" / "edge.pem" and edge.check()
    probe = coordinator["healthcheck"]["test"]
    assert probe[:3] == ["CMD", "specd", "health"] and probe[3].startswith("127.0.0.1:")
    ca = x509.load_pem_x509_certificates(file_of(coordinator, probe[probe.index("--edge-ca") + 1]).read_bytes())
    verifier = PolicyBuilder().store(Store(ca)).build_server_verifier(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    verifier.verify(x509.load_pem_x509_certificate(edge.cert.read_bytes()), [])
    for role in ("draft", "target"):
        service = services[role]
        assert file_of(service, service["environment"]["SPECD_TLS_DIR"] + f"/{role}-key.pem").is_file()
        assert service["healthcheck"]["test"][-1] == f"127.0.0.1:{service['environment']['SPECD_HEALTH_PORT']}"


def test_compose_runs_redis_as_its_own_user_without_a_shell_and_its_password_in_a_file():
    redis_ = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]
    assert redis_["user"] == "{}:{}".format(*secrets_init.REDIS_USER)  # whom `keys` hands Redis's files to
    argv = redis_["entrypoint"] + redis_["command"]
    assert argv[0] == "redis-server" and "sh" not in argv and not any("$" in a for a in argv)
    assert "--requirepass" not in argv
    assert argv[1] in {f"{m}/{secrets_init.REDIS_AUTH_CONF}" for m, s in mounts(redis_).items() if s == "./secrets/redis"}
    assert argv[argv.index("--port") + 1] == "0" and argv[argv.index("--tls-port") + 1] == "6379"
    assert redis_["read_only"] is True


def test_compose_services_run_without_privileges():
    """No service gains privileges (no-new-privileges) or keeps capabilities it does not use; only the
    one-shot `keys` step runs as root, with what handing files to their users takes."""
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name, service in services.items():
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert service.get("cap_drop") == ["ALL"], name
        assert service.get("privileged") is not True, name
        if name == "keys":
            assert service["user"] == "0" and set(service["cap_add"]) <= {"CHOWN", "DAC_OVERRIDE", "FOWNER"}
        else:
            assert "cap_add" not in service and service.get("user", "10001") not in ("0", "root"), name


# --- the image: Dockerfile, build context, lock file -------------------------------------------


def test_dockerfile_passes_hadolint_and_runs_as_non_root():
    run(tool("hadolint"), "Dockerfile")
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001$", text, re.M)
    assert "/models" in text and "COPY models" not in text  # weights come from a volume


def dockerignored(path: str) -> bool:
    """Docker's .dockerignore rules for one path: the last matching line wins, `!` lets a path back in,
    a line that matches a parent directory matches what is under it."""
    def regex(pattern: str) -> re.Pattern:
        out = ""
        for i, part in enumerate(re.split(r"(\*\*/?|\*|\?|\[[^]]*\])", pattern)):
            if i % 2:
                out += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, part)  # or a [class]
            else:
                out += re.escape(part)
        return re.compile(out + "(/.*)?$")

    ignored = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = str(PurePosixPath(line.lstrip("!").lstrip("/")))
        if regex(pattern).match(path):
            ignored = not negated
    return ignored


def test_the_build_context_holds_what_the_dockerfile_copies_and_no_secret_or_local_state():
    copied = [src for line in re.findall(r"^COPY (.+)$", (ROOT / "Dockerfile").read_text(), re.M)
              for src in line.split()[:-1] if not src.startswith("--")]
    assert copied
    for source in copied:
        assert not dockerignored(source), source
    for path in ("services/cli.py", "services/common/secrets_init.py", "specd/csrc/quants.c",
                 "services/protogen/specd/v1/draft_pb2.pyi"):
        assert not dockerignored(path), path
    for path in ("secrets/coordinator/api-keys", "secrets/tls/draft/draft-key.pem", "api-keys", "tls/ca.pem",
                 "services/tls/redis-key.pem", ".venv/bin/python", ".venv-checkov/bin/checkov", ".git/config",
                 ".pytest_cache/v", ".hypothesis/examples/x", "services/__pycache__/cli.cpython-311.pyc",
                 "benchmarks/results/run.json", "qwen.gguf", "specd/x.gguf", ".env", "edge.key", "build/lib/x.py"):
        assert dockerignored(path), path


def locked() -> dict[str, set[str]]:
    """requirements/image.lock: name -> its versions (one per Python version it resolves for); every
    entry is `name==version` with its hashes."""
    text = (ROOT / "requirements" / "image.lock").read_text()
    entries = re.split(r"\n(?=\S)", "\n".join(line for line in text.splitlines() if not line.startswith("#")))
    pins: dict[str, set[str]] = {}
    for entry in filter(str.strip, entries):
        requirement = re.match(r"([A-Za-z0-9._-]+)==([^\s;\\]+)", entry)
        assert requirement and "--hash=sha256:" in entry, entry[:80]
        pins.setdefault(canonicalize_name(requirement.group(1)), set()).add(requirement.group(2))
    return pins


def test_the_image_installs_every_python_package_from_the_lock_with_hashes():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"pip install .*--require-hashes --no-deps -r requirements/image\.lock", dockerfile)
    assert re.search(r"pip install .*--no-deps --no-build-isolation \.", dockerfile)  # specd itself: nothing unlocked
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["ray"]]
    wanted += [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]]
    pins = locked()
    torch = next(r for r in wanted if r.name == "torch")
    assert re.search(rf"--index-url \"\$\{{TORCH_INDEX\}}\" torch{re.escape(str(torch.specifier))}", dockerfile)
    assert not {n for n in pins if n == "torch" or n.startswith(("nvidia-", "triton", "cuda-"))}  # from TORCH_INDEX
    for requirement in wanted:
        if requirement.name == "torch":
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins and all(requirement.specifier.contains(v, prereleases=True) for v in pins[name]), (
            requirement, pins.get(name))
        for extra in requirement.extras:  # ray[serve]: what the extra brings is locked too
            for dependency in map(Requirement, importlib.metadata.requires(requirement.name) or []):
                if dependency.marker and dependency.marker.evaluate({"extra": extra}) and not dependency.marker.evaluate({"extra": ""}):
                    assert canonicalize_name(dependency.name) in pins, (requirement, dependency)
    # torch's own requirements (the installed build's, same version): locked, since step 2 adds none but CUDA's.
    if importlib.metadata.version("torch").split("+")[0] == str(torch.specifier).lstrip("="):
        for dependency in map(Requirement, importlib.metadata.requires("torch")):
            if not dependency.marker or dependency.marker.evaluate({"extra": ""}):
                assert canonicalize_name(dependency.name) in pins, dependency


# --- environment variables: set by the manifests, read by the services ----------------------


@cache
def reads(entrypoint: str) -> frozenset[str]:
    """The variables an entrypoint reads: its settings (`[env SPECD_...]` in --help) and, for the
    services, the OpenTelemetry variables of services/common/telemetry.py."""
    names = set(re.findall(r"\[env\s+(SPECD_[A-Z_]+)", run(*ENTRYPOINTS[entrypoint])))
    names.add("HOME")  # the root filesystem is read-only: caches (the kernels, Hugging Face) go to $HOME
    if entrypoint == "models fetch":
        names.add("SPECD_MODELS_DIR")  # services/models.py reads it directly
    else:
        names |= set(re.findall(r"OTEL_[A-Z_]+[A-Z]", (ROOT / "services/common/telemetry.py").read_text()))
    return frozenset(names)


def entrypoint_of(command: list[str]) -> str | None:
    text = " ".join(command)
    return next((name for name in ENTRYPOINTS if name in text), None)


def k8s_containers(target: str):
    for name, pod in pods(target).items():
        for container in containers(pod):
            yield f"{target}/{name}/{container['name']}", container.get("command", []), {
                e["name"] for e in container.get("env", [])
            }


def compose_containers(tmp_path):
    for variant, path in compose_files(tmp_path).items():
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            yield f"compose-{variant}/{name}", service.get("command", []), set(service.get("environment", {}))


def test_every_variable_the_manifests_set_is_read_by_that_container(tmp_path):
    checked = 0
    for where, command, env in [*compose_containers(tmp_path), *(c for t in [*OVERLAYS, "ray"] for c in k8s_containers(t))]:
        entrypoint = entrypoint_of(command)
        if entrypoint is None:  # redis, jaeger, Ray's own: not ours
            continue
        unread = env - reads(entrypoint)
        assert not unread, f"{where} sets {sorted(unread)}, which {entrypoint} never reads"
        checked += 1
    assert checked >= 12  # 4 compose services x 2 variants + 3 Deployments x 2 overlays, and init steps
    image_env = set(re.findall(r"^\s+(SPECD_[A-Z_]+)=", (ROOT / "Dockerfile").read_text(), re.M))
    assert image_env and image_env <= reads("services.draft") | reads("models fetch")


# --- KubeRay --------------------------------------------------------------------------------


def test_rayservice_runs_our_application_with_arguments_it_accepts():
    """The CRD is not in the Kubernetes schemas: check what it hands to services/ray_app.py."""
    from services import ray_app

    service = by_kind_and_name("ray")["RayService", "specd"]
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert application["import_path"] == "services.ray_app:build_app"
    ray_app.build_app(application["args"])  # builds the deployment graph: names and values are accepted
    with pytest.raises(ValueError, match="unknown arguments"):
        ray_app.build_app({**application["args"], "targt_gpus": "1"})
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert all(w["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1 for w in workers)
    # API keys and the Redis password: files from the Secrets, mounted wherever a gateway replica may run
    argv = ray_app.coordinator_argv(application["args"])
    files = [argv[argv.index(flag) + 1] for flag in ("--api-keys-file", "--redis-password-file")]
    for pod in ray_pods(docs("ray")).values():
        spec = pod["spec"]
        assert {secret_file(spec, spec["containers"][0], f)[0] for f in files} == {"specd-api-keys", "specd-redis"}
        keys = [i["key"] for v in spec["volumes"] if "secret" in v for i in v["secret"].get("items", [])]
        assert not any(k.endswith("-key.pem") or k == "auth.conf" for k in keys)  # no TLS key, not Redis's config


# --- checkov --------------------------------------------------------------------------------


def test_checkov_finds_nothing_in_the_manifests_and_the_dockerfile_but_the_reasoned_skips(tmp_path):
    """Scanned without its skips, checkov fails exactly the checks .checkov.yaml skips with a reason
    (no finding unexplained, no skip kept after its finding is gone). The RayService is scanned as its
    pods and NetworkPolicies (checkov cannot read the CRD); its reasoned skips are annotations on them."""
    checkov = ROOT / ".venv-checkov" / "bin" / "checkov"
    assert checkov.is_file(), "checkov is not installed (scripts/test installs it)"
    skipped = set(yaml.safe_load((ROOT / ".checkov.yaml").read_text())["skip-check"])
    targets = [("dockerfile", ROOT / "Dockerfile", 50)]
    for overlay in OVERLAYS:
        (rendered := tmp_path / f"{overlay}.yaml").write_text(kustomize(overlay))
        targets.append(("kubernetes", rendered, 50))
    ray = docs("ray")
    (rendered := tmp_path / "ray.yaml").write_text(yaml.safe_dump_all(
        [d for d in ray if d["kind"] != "RayService"] + list(ray_pods(ray).values())))
    targets.append(("kubernetes", rendered, 50))
    failed = set()
    for framework, path, least in targets:
        quiet = [] if path.name == "ray.yaml" else ["--quiet"]  # the Ray pods': passed checks listed too
        done = subprocess.run([str(checkov), "-f", str(path), "--framework", framework, *quiet, "--skip-download",
                               "-o", "json"], capture_output=True, text=True, timeout=300, cwd=tmp_path)  # not .checkov.yaml
        report = json.loads(done.stdout)
        assert report["summary"]["passed"] > least and not report["summary"]["parsing_errors"], (path.name, report["summary"])
        failed |= {c["check_id"] for c in report["results"]["failed_checks"]}
        if path.name == "ray.yaml":  # the Ray pods are scanned: their security checks ran and passed
            ran = {c["check_id"] for c in report["results"]["passed_checks"] if c["resource"].startswith("Pod.")}
            assert {"CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_28", "CKV_K8S_37", "CKV_K8S_11", "CKV_K8S_13"} <= ran
    assert failed == skipped
