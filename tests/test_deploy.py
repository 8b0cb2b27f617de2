"""deploy/ and the image's entry point, without an engine: the manifests against the Kubernetes schemas, what their
probes and stop settings promise, and the entry point's dispatch as Docker runs it (real processes).

The manifests' commands run with engines elsewhere: the LWS leader and worker in test_nodes.py (two isolated
nodes), `ministream serve`'s readiness, metrics and drain in test_serve.py, `vllm serve` through the entry
point and the image itself in test_image.py (test-full)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ministream import MiniStreamError
from ministream.paths import DOCKER
from ministream.run.serve import DRAIN_MARGIN, drain_args, passed_on, split_options

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ENTRYPOINT = Path(str(DOCKER)) / "entrypoint.sh"
K8S = kubernetes_validate.latest_version()


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def pod_templates() -> list[tuple[str, dict]]:
    """(where, pod template) of every workload in deploy/: the Deployment's, the LWS leader's and worker's."""
    out = []
    for name in ("deployment.yaml", "lws.yaml"):
        for d in documents(name):
            if d["kind"] == "Deployment":
                out.append((f"{name} Deployment", d["spec"]["template"]))
            elif d["kind"] == "LeaderWorkerSet":
                lwt = d["spec"]["leaderWorkerTemplate"]
                out += [(f"{name} {k}", lwt[k]) for k in ("leaderTemplate", "workerTemplate")]
    return out


def as_pod(template: dict) -> dict:
    """A pod template as the Pod it makes, for the schema of Pod (LeaderWorkerSet is a CRD: no bundled schema)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **template.get("metadata", {})}, **template}


def test_every_manifest_validates_against_the_kubernetes_schemas():
    checked = []
    for name in ("deployment.yaml", "lws.yaml"):
        for d in documents(name):
            if d["kind"] != "LeaderWorkerSet":  # its pod templates below
                kubernetes_validate.validate(d, K8S, strict=True)
                checked.append(d["kind"])
    for _, template in pod_templates():
        kubernetes_validate.validate(as_pod(template), K8S, strict=True)
    assert sorted(checked) == ["Deployment", "Service", "Service"] and len(pod_templates()) == 3


@pytest.mark.parametrize(
    "fault",
    [
        lambda c: c["ports"][0].update(containerPort="http"),  # a name where a number goes
        lambda c: c.update(readinesProbe=c["readinessProbe"]),  # a misspelt field: strict refuses it
    ],
    ids=["port name for number", "misspelt field"],
)
def test_the_validator_refuses_a_broken_manifest(fault):
    (d,) = [d for d in documents("deployment.yaml") if d["kind"] == "Deployment"]
    fault(d["spec"]["template"]["spec"]["containers"][0])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(d, K8S, strict=True)


def _option(args: list[str], name: str, default: float) -> float:
    for i, a in enumerate(args):
        if a == name:
            return float(args[i + 1])
        if a.startswith(name + "="):
            return float(a.split("=", 1)[1])
    return default


@pytest.mark.parametrize("where, template", pod_templates(), ids=[w for w, _ in pod_templates()])
def test_each_pod_stops_within_its_grace_and_probes_what_serve_answers(where, template):
    spec = template["spec"]
    (c,) = spec["containers"]
    args = c.get("args", [])
    # the grace covers the preStop sleep and serve's own bound, within which vLLM drains
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
    stop_timeout = _option(args, "--stop-timeout", 30)
    assert spec["terminationGracePeriodSeconds"] >= float(pre_stop[-1]) + stop_timeout, where
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 1000
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/model"]["readOnly"] and "/dev/shm" in mounts
    shm = next(v for v in spec["volumes"] if v["name"] == mounts["/dev/shm"]["name"])
    assert shm["emptyDir"]["medium"] == "Memory"
    if "--headless" in args:  # a worker serves no API: nothing to probe
        assert "readinessProbe" not in c and "ports" not in c
        return
    assert c["livenessProbe"]["httpGet"]["path"] == c["startupProbe"]["httpGet"]["path"] == "/health"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a compiled first start on a few cores
    assert c["readinessProbe"]["exec"]["command"][:2] == ["ministream", "ready"]
    key = next(e for e in c["env"] if e["name"] == "VLLM_API_KEY")
    assert "secretKeyRef" in key["valueFrom"]  # from a Secret, never in the manifest


def test_the_production_stack_values_run_our_image_on_a_mounted_folder():
    values = yaml.safe_load((DEPLOY / "production-stack-values.yaml").read_text())
    (spec,) = values["servingEngineSpec"]["modelSpec"]
    assert spec["repository"].endswith("/ministream-vllm") and spec["modelURL"].startswith("/data/")
    assert spec["vllmConfig"]["extraArgs"][:1] == ["--shutdown-timeout"]


# --- the entry point, as Docker runs it --------------------------------------------------------------------


def entrypoint(*args, env=None, timeout=60) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # ministream and vllm, as in the image
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path, **(env or {})},
        timeout=timeout,
    )


def test_a_command_runs_as_it_is():
    r = entrypoint("sh", "-c", 'echo "ran $0 $1"', "one", "two")
    assert r.returncode == 0 and r.stdout == "ran one two\n"


def test_no_arguments_serve_the_folder_at_MODEL(tmp_path):
    r = entrypoint(env={"MODEL": str(tmp_path / "absent")})
    assert r.returncode == 2 and f"{tmp_path / 'absent'}" in r.stderr and "Traceback" not in r.stderr


def test_options_go_to_serve_and_vllms_model_option_names_the_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    r = entrypoint("--model", tmp_path / "empty", "--max-num-seqs", "8", env={"MODEL": "/nowhere"})
    assert r.returncode == 2 and f"{tmp_path / 'empty' / 'config.json'}: no such file" in r.stderr, r.stderr
    assert "/nowhere" not in r.stderr


def test_a_folder_first_is_served_as_vllms_image_does(tmp_path):
    (tmp_path / "empty").mkdir()
    r = entrypoint(tmp_path / "empty", "--dtype", "float32")
    assert r.returncode == 2 and f"{tmp_path / 'empty' / 'config.json'}: no such file" in r.stderr, r.stderr


def test_ready_says_not_ready_where_nothing_answers():
    from ministream.run.server import free_port

    r = subprocess.run(
        [str(Path(sys.executable).parent / "ministream"), "ready", "--url", f"http://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr.startswith("not ready: ") and "does not answer" in r.stderr


# --- vLLM's options beside serve's --------------------------------------------------------------------------

TAKES = {"--host": True, "--port": True, "--dtype": True, "--tp": True, "--nnodes": True, "--enforce-eager": False}


@pytest.mark.parametrize(
    "argv, ours, theirs",
    [
        (["m", "--max-num-seqs", "64", "--dtype", "float32"], ["m", "--dtype", "float32"], ["--max-num-seqs", "64"]),
        (["--model", "m", "--enforce-eager", "--tp=2"], ["--enforce-eager", "--tp=2"], ["--model", "m"]),
        (["m", "--enable-prefix-caching", "--port", "1"], ["m", "--port", "1"], ["--enable-prefix-caching"]),
        (["--tensor-parallel-size=2", "--headless"], [], ["--tensor-parallel-size=2", "--headless"]),
    ],
)
def test_options_serve_does_not_have_are_vllms_with_their_values(argv, ours, theirs):
    assert split_options(argv, TAKES) == (ours, theirs)


def test_a_flag_of_vllms_before_a_converted_folder_leaves_the_folder_to_serve(tiny_hf):
    assert split_options(["--enable-prefix-caching", str(tiny_hf)], TAKES) == (
        [str(tiny_hf)],
        ["--enable-prefix-caching"],
    )


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"model": None, "name": None, "tp": 1, "pp": 1, "nnodes": 1, "node_rank": 0, **kw})


def test_vllms_names_of_serves_options_set_them_and_the_rest_pass_on():
    a = _args()
    extra = passed_on(["--model", "/m", "-tp", "2", "--served-model-name=x", "--max-num-seqs", "8"], a)
    assert (a.model, a.tp, a.name, extra) == (Path("/m"), 2, "x", ["--max-num-seqs", "8"])
    assert passed_on(["--load-format", "safetensors"], _args(model=Path("/m"))) == ["--load-format", "safetensors"]
    a = _args(model=Path("/m"), nnodes=2, node_rank=1)
    assert passed_on(["--headless", "--pipeline-parallel-size=2"], a) == [] and a.pp == 2


@pytest.mark.parametrize(
    "argv, kw, message",
    [
        (["--headless"], {"model": Path("/m")}, "only a node of rank 1 or above"),
        (["--model", "/b"], {"model": Path("/a")}, "two folders to serve"),
        (["-tp", "two"], {"model": Path("/m")}, "-tp 'two': give a number"),
        ([], {}, "give the converted folder"),
        (["--port=1"], {"model": Path("/m")}, "which serve sets itself"),
        # options that would serve another model than the folder's, with exit 0: refused by the one check
        (["--load-format", "dummy"], {"model": Path("/m")}, "--load-format dummy: serve runs the folder's own"),
        (["--hf-overrides.rope_theta", "1e6"], {"model": Path("/m")}, "--hf-overrides, which would serve other math"),
        (["--hf-config-path=/other"], {"model": Path("/m")}, "--hf-config-path, which would serve other math"),
        (["--tokenizer", "/other"], {"model": Path("/m")}, "--tokenizer, which would serve other math"),
    ],
)
def test_what_serve_cannot_take_from_vllms_options_is_refused_by_name(argv, kw, message):
    with pytest.raises(MiniStreamError, match=message):
        passed_on(argv, _args(**kw))


@pytest.mark.parametrize(
    "release, stop, extra, want",
    [
        ("0.32.0", 30, [], ["--shutdown-timeout", str(30 - DRAIN_MARGIN)]),
        ("0.18.0+ministream.0.1.0", 40, [], ["--shutdown-timeout", "35"]),
        ("0.17.1", 30, [], []),  # before vLLM drained: it aborts what is in flight
        ("0.32.0", 30, ["--shutdown-timeout=3"], []),  # the user's own
        ("0.32.0", 5, [], []),  # no time left to drain in
        (None, 30, [], []),
    ],
)
def test_serve_asks_vllm_to_drain_within_its_own_stop_bound(release, stop, extra, want):
    assert drain_args(release, stop, extra) == want


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--shutdown-timeout", "60"], r"drains longer than serve waits .* give --stop-timeout 65 or more"),
        (["--shutdown-timeout=soon"], r"--shutdown-timeout 'soon': give a number of seconds"),
    ],
)
def test_a_drain_serve_would_cut_short_is_refused(extra, message):
    with pytest.raises(MiniStreamError, match=message):
        drain_args("0.32.0", 30, extra)
