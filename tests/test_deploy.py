"""The deployment files, validated offline (no Docker engine or cluster here): every kustomize
overlay against the Kubernetes 1.32 schemas in strict mode, compose.yaml (and with the CPU
override merged in) against the compose-spec schema and `docker-compose config`, the
Dockerfile with hadolint; and every environment variable the manifests set for a specd
container is one that container's entrypoint actually reads.

Over 350 lines: one test per property of the deployment files, all offline."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from services.common import discovery

pytestmark = pytest.mark.slow  # checkov, docker-compose and kubectl, which scripts/test installs

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
OVERLAYS = sorted(p.name for p in (ROOT / "k8s" / "overlays").iterdir() if p.is_dir())
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
def kustomize(overlay: str) -> str:
    return run(tool("kubectl"), "kustomize", f"k8s/overlays/{overlay}")


# --- Kubernetes ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_valid_kubernetes(overlay):
    run(tool("kubernetes-validate"), "--strict", "-k", "1.32.0", "-", stdin=kustomize(overlay))


def test_gpu_overlay_pins_each_model_service_to_its_own_gpu_pool():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(kustomize("gpu")) if d}
    for role in ("draft", "target"):
        pod = docs["Deployment", role]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"specd.io/pool": role}
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        container = pod["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["readinessProbe"]["grpc"] and container["livenessProbe"]["grpc"]
        assert pod["initContainers"][0]["command"] == ["specd", "models", "fetch"]
    kinds = {kind for kind, _ in docs}
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "StatefulSet", "ConfigMap", "Service"} <= kinds
    assert "volumeClaimTemplates" in docs["StatefulSet", "redis"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_coordinator_finds_each_pool_through_a_headless_service(overlay):
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(kustomize(overlay)) if d}
    config = docs["ConfigMap", next(name for kind, name in docs if kind == "ConfigMap" and "config" in name)]["data"]
    for role, port in (("draft", 50052), ("target", 50053)):
        pool = discovery.resolver(config[f"SPECD_{role.upper()}_ADDR"])
        assert isinstance(pool, discovery.Dns) and pool.port == port
        service = docs["Service", pool.host]["spec"]
        assert service["clusterIP"] == "None"  # a record per pod, not one virtual IP
        labels = docs["Deployment", role]["spec"]["template"]["metadata"]["labels"]
        assert service["selector"].items() <= labels.items()


def test_gpu_overlay_pools_keep_a_replica_through_voluntary_disruptions():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(kustomize("gpu")) if d}
    for role in ("draft", "target"):
        replicas = docs["Deployment", role]["spec"]["replicas"]
        budget = docs["PodDisruptionBudget", role]["spec"]
        assert replicas >= 2 and budget == {"minAvailable": 1, "selector": budget["selector"]}


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
    assert "--appendonly" in gpu["redis"]["command"][-1]


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_compose_turns_api_keys_the_redis_password_and_service_tls_on_from_secrets_made_on_the_first_run(tmp_path, variant):
    services = yaml.safe_load(compose_files(tmp_path)[variant].read_text())["services"]
    keys = services["keys"]
    made_in = next(v.split(":")[0] for v in keys["volumes"] if v.endswith(":/secrets"))
    assert keys["command"][:3] == ["specd", "keys", "init"] and made_in == "./secrets"
    assert "secrets/" in (ROOT / ".gitignore").read_text().splitlines()
    coordinator, redis_ = services["coordinator"], services["redis"]
    mounted = {v.split(":")[1] for v in coordinator["volumes"] if v.startswith(made_in + ":")}
    env = coordinator["environment"]
    for variable, name in (("SPECD_API_KEYS_FILE", "api-keys"), ("SPECD_REDIS_PASSWORD_FILE", "redis-password")):
        assert env[variable] in {f"{m}/{name}" for m in mounted}
    assert '--requirepass "$$(cat /run/specd-secrets/redis-password)"' in redis_["command"][-1]
    assert any(v.startswith(made_in + ":/run/specd-secrets") for v in redis_["volumes"])
    for service in (coordinator, redis_):
        assert service["depends_on"]["keys"] == {"condition": "service_completed_successfully"}
    # Mutual TLS: each model service mounts its own directory (no other role's key), is probed on
    # its plaintext health port, and the coordinator's certificate is where it looks.
    assert env["SPECD_TLS_DIR"] in {f"{m}/tls/coordinator" for m in mounted}
    for role in ("draft", "target"):
        service = services[role]
        tls_dir = service["environment"]["SPECD_TLS_DIR"]
        assert f"{made_in}/tls/{role}:{tls_dir}:ro" in service["volumes"]
        assert not any(v.startswith(made_in + ":") for v in service["volumes"])
        assert service["healthcheck"]["test"][-1] == f"127.0.0.1:{service['environment']['SPECD_HEALTH_PORT']}"
        assert service["depends_on"]["keys"] == {"condition": "service_completed_successfully"}


# --- Dockerfile -----------------------------------------------------------------------------


def test_dockerfile_passes_hadolint_and_runs_as_non_root():
    run(tool("hadolint"), "Dockerfile")
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001$", text, re.M)
    assert "/models" in text and "COPY models" not in text  # weights come from a volume


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


def k8s_containers(overlay: str):
    for doc in yaml.safe_load_all(kustomize(overlay)):
        pod = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            yield f"{overlay}/{doc['metadata']['name']}/{container['name']}", container.get("command", []), {
                e["name"] for e in container.get("env", [])
            }


def compose_containers(tmp_path):
    for variant, path in compose_files(tmp_path).items():
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            yield f"compose-{variant}/{name}", service.get("command", []), set(service.get("environment", {}))


def test_every_variable_the_manifests_set_is_read_by_that_container(tmp_path):
    checked = 0
    for where, command, env in [*compose_containers(tmp_path), *(c for o in OVERLAYS for c in k8s_containers(o))]:
        entrypoint = entrypoint_of(command)
        if entrypoint is None:  # redis, jaeger: not ours
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

    service = yaml.safe_load((ROOT / "k8s" / "ray" / "rayservice.yaml").read_text())
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
    for pod in [service["spec"]["rayClusterConfig"]["headGroupSpec"], *workers]:
        spec = pod["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        mounted = {secrets.get(mounts.get(f.rsplit("/", 1)[0])) for f in files}
        assert mounted == {"specd-api-keys", "specd-redis"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_requires_the_password_the_coordinator_reads_from_the_same_secret(overlay):
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(kustomize(overlay)) if d}
    redis_pod = docs["StatefulSet", "redis"]["spec"]["template"]["spec"]
    (redis_container,) = redis_pod["containers"]

    def secret_file(pod: dict, container: dict, path: str) -> tuple[str, str]:
        """(Secret, key) behind a mounted file."""
        mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        return volume["secret"]["secretName"], path.rsplit("/", 1)[1]

    password_file = re.search(r'cat (/\S+)\)"', redis_container["command"][-1]).group(1)
    assert "requirepass" in redis_container["command"][-1]
    assert password_file in redis_container["readinessProbe"]["exec"]["command"][-1]
    pod = docs["Deployment", "coordinator"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert secret_file(redis_pod, redis_container, password_file) == secret_file(
        pod, pod["containers"][0], env["SPECD_REDIS_PASSWORD_FILE"]) == ("specd-redis", "password")
    assert "secretKeyRef" not in kustomize(overlay)  # secrets are files, never environment variables
    config = docs["ConfigMap", next(n for k, n in docs if k == "ConfigMap" and "config" in n)]["data"]
    assert "@" not in config["SPECD_REDIS_URL"]  # no password in a ConfigMap


# --- hardening: what every pod runs as, who may reach whom, what the scanner says -------------


def pods(overlay: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in yaml.safe_load_all(kustomize(overlay))
            if d and "template" in d.get("spec", {})}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_locked_down_with_requests_and_limits(overlay):
    for name, pod in pods(overlay).items():
        assert pod["automountServiceAccountToken"] is False, name
        security = pod["securityContext"]
        assert security["runAsNonRoot"] and security["runAsUser"] >= 10000, name
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        writable = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v or "persistentVolumeClaim" in v}
        for container in pod.get("initContainers", []) + pod["containers"]:
            where = f"{name}/{container['name']}"
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            }, where
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"]), where
            assert any(m["name"] in writable for m in container.get("volumeMounts", [])) or name == "jaeger", where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_coordinator_reaches_the_model_services_and_redis(overlay):
    docs = [d for d in yaml.safe_load_all(kustomize(overlay)) if d]
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    ports = {"draft": 50052, "target": 50053, "redis": 6379}
    for app, port in ports.items():
        (policy,) = [p for p in policies.values() if p["podSelector"].get("matchLabels") == {"app.kubernetes.io/name": app}]
        for rule in policy["ingress"]:
            opened = {p["port"] for p in rule["ports"]}
            if port in opened:  # the service port: from coordinator pods of this namespace only
                assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "coordinator"}}}]
            else:  # anything else opened is a metrics port, to the scraper's namespace
                assert opened <= {9101, 9102} and "namespaceSelector" in rule["from"][0], (app, rule)
    (coordinator,) = [p for p in policies.values()
                      if p["podSelector"].get("matchLabels") == {"app.kubernetes.io/name": "coordinator"}]
    assert all("namespaceSelector" in rule["from"][0] for rule in coordinator["ingress"])


def test_a_release_pins_every_image_by_digest(tmp_path):
    """`images: digest:` in an overlay reaches every container, init containers included."""
    digest = "sha256:" + "0" * 64
    names = sorted({c["image"].split(":")[0].split("@")[0] for o in OVERLAYS for p in pods(o).values()
                    for c in p.get("initContainers", []) + p["containers"]})
    overlay = tmp_path / "release"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(ROOT / "k8s/overlays/gpu", overlay)],
        "images": [{"name": n, "digest": digest} for n in names],
    }))
    rendered = run(tool("kubectl"), "kustomize", str(overlay))
    images = [c["image"] for d in yaml.safe_load_all(rendered) if d and "template" in d.get("spec", {})
              for c in d["spec"]["template"]["spec"].get("initContainers", []) + d["spec"]["template"]["spec"]["containers"]]
    assert images and all(image.endswith("@" + digest) for image in images), images


def test_checkov_finds_nothing_in_the_overlays_and_the_dockerfile_but_the_reasoned_skips(tmp_path):
    """Scanned without its skips, checkov fails exactly the checks .checkov.yaml skips with a reason
    (no finding unexplained, no skip kept after its finding is gone)."""
    checkov = ROOT / ".venv-checkov" / "bin" / "checkov"
    assert checkov.is_file(), "checkov is not installed (scripts/test installs it)"
    skipped = set(yaml.safe_load((ROOT / ".checkov.yaml").read_text())["skip-check"])
    targets = [("dockerfile", ROOT / "Dockerfile")]
    for overlay in OVERLAYS:
        (rendered := tmp_path / f"{overlay}.yaml").write_text(kustomize(overlay))
        targets.append(("kubernetes", rendered))
    failed = set()
    for framework, path in targets:
        done = subprocess.run([str(checkov), "-f", str(path), "--framework", framework, "--quiet", "--skip-download",
                               "-o", "json"], capture_output=True, text=True, timeout=300, cwd=tmp_path)  # not .checkov.yaml
        report = json.loads(done.stdout)
        assert report["summary"]["passed"] > 50 and not report["summary"]["parsing_errors"], (path.name, report["summary"])
        failed |= {c["check_id"] for c in report["results"]["failed_checks"]}
    assert failed == skipped
