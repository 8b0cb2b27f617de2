"""`ministream serve --nnodes 2`: one model served across two nodes by vLLM's multiprocessing executor (issue 22).

Each node is its own process tree in its own mount namespace with a private /dev/shm and its own core, so
the two share nothing but TCP on 127.0.0.1: what two machines share. The greedy token ids of TP=2 over two
nodes must be the reference model's (and so TP=1's, which test_vllm.py holds to the same reference). Then
the faults a cluster meets, each within a bound: a node that never comes, a node with another folder or
dtype, a node killed while serving. Real servers, real namespaces (root: skipped elsewhere), real SIGKILL.
"""

import os
import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from ministream import MiniStreamError
from ministream.paths import DOCKER
from ministream.run import nodes
from ministream.run.generate import DEFAULT_PROMPTS, reference_generate, tokenize
from ministream.run.server import complete, free_port, log_tail, start, stop, wait_ready

EXE = Path(sys.executable).parent / "ministream"
LWS = Path(__file__).resolve().parents[1] / "deploy" / "lws.yaml"
ENTRYPOINT = Path(str(DOCKER)) / "entrypoint.sh"
MAX_TOKENS = 12
PROMPTS = DEFAULT_PROMPTS[:4]
START_TIMEOUT = 600


namespaces_work = nodes.can_isolate
pytestmark = [
    pytest.mark.skipif(not namespaces_work(), reason="needs root and mount namespaces (unshare)"),
    pytest.mark.vllm,
]


def node(model: Path, rank: int, master_port: int, log: Path, *args, port: int = 0, python=None, env=None):
    """`ministream serve` as node `rank` of 2, in a mount namespace of its own with a private /dev/shm, on one
    core; its process group is the returned process's pid. python: another environment's interpreter (the
    plugin's), which runs `python -m ministream.cli`."""
    cpu = rank % len(os.sched_getaffinity(0))
    exe = [str(python), "-m", "ministream.cli"] if python else [str(EXE)]
    serve = [*exe, "serve", str(model), "--nnodes", "2", "--node-rank", str(rank)]
    serve += ["--master-addr", "127.0.0.1", "--master-port", str(master_port), "--port", str(port or 8000)]
    serve += [str(a) for a in args]
    return start(nodes.isolated(serve, str(cpu)), log, {**(env or os.environ), "VLLM_CPU_KVCACHE_SPACE": "1"})


def two_nodes(model: Path, logs: Path, *args, python=None, env=None):
    """Both nodes of one server; (node 0, node 1, its URL) once node 0 answers."""
    master, http = free_port(), free_port()
    n0 = node(model, 0, master, logs / "node0.log", *args, port=http, python=python, env=env)
    n1 = node(model, 1, master, logs / "node1.log", *args, python=python, env=env)
    return both_ready(n0, n1, http, logs)


def both_ready(n0, n1, http: int, logs: Path):
    """(node 0, node 1, the URL) once node 0 answers on port `http`; both stopped, and node 1's log shown, if not."""
    url = f"http://127.0.0.1:{http}"
    try:
        wait_ready(url, n0, logs / "node0.log", START_TIMEOUT)
    except Exception:
        for n in (n0, n1):
            stop(n)
        raise AssertionError(f"node 1's log:\n{log_tail(logs / 'node1.log')}") from None
    return n0, n1, url


def greedy_ids(url: str, model: Path) -> list[list[int]]:
    got = []
    for p in tokenize(model, PROMPTS):
        status, body = complete(url, model.name, p, MAX_TOKENS, return_token_ids=True)
        assert status == 200, body
        got.append(body["choices"][0]["token_ids"])
    return got


def reference_ids(model: Path) -> list[list[int]]:
    return [r["ids"] for r in reference_generate(model, tokenize(model, PROMPTS), MAX_TOKENS)]


def group_left(pgid: int) -> list[str]:
    return [p.name() for p in psutil.process_iter() if _pgid(p.pid) == pgid]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def lws_commands(model: Path, http: int, master: int) -> list[tuple[list[str], dict]]:
    """deploy/lws.yaml's leader and worker, as its pods run them: the image's entry point with the container's
    args, LWS's variables ($(LWS_...)) expanded as Kubernetes does, the folder at MODEL; (command, env) each."""
    (manifest,) = [d for d in yaml.safe_load_all(LWS.read_text()) if d and d["kind"] == "LeaderWorkerSet"]
    template = manifest["spec"]["leaderWorkerTemplate"]
    out = []
    for rank, role in enumerate(("leaderTemplate", "workerTemplate")):
        (container,) = template[role]["spec"]["containers"]
        lws = {
            "LWS_GROUP_SIZE": str(template["size"]),
            "LWS_LEADER_ADDRESS": "127.0.0.1",
            "LWS_WORKER_INDEX": str(rank),
        }
        args = [re.sub(r"\$\((\w+)\)", lambda m, v=lws: v[m.group(1)], a) for a in container["args"]]
        env = {"MODEL": str(model), "HOST": "127.0.0.1", "PORT": str(http)}
        env["PATH"] = f"{EXE.parent}{os.pathsep}{os.environ['PATH']}"  # ministream, as in the image
        out.append((["sh", str(ENTRYPOINT), *args, "--master-port", str(master)], env))
    return out


# make test: the GQA model (its kv heads split over the nodes); test-full: the MHA one too
@pytest.fixture(scope="module", params=["tiny_gqa_hf", pytest.param("tiny_hf", marks=pytest.mark.full)])
def cluster(request, tmp_path_factory):
    """TP=2 over two nodes, fp32 (eager: the route is the subject; test_vllm.py proves the compiled path), started
    by deploy/lws.yaml's own commands (lws_commands)."""
    model = request.getfixturevalue(request.param)
    logs = tmp_path_factory.mktemp("nodes")
    test_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--node-timeout", "300"]
    master, http = free_port(), free_port()
    procs = []
    for rank, (cmd, env) in enumerate(lws_commands(model, http, master)):
        isolated = nodes.isolated([*cmd, *test_args], str(rank % len(os.sched_getaffinity(0))))
        full_env = {**os.environ, **env, "VLLM_CPU_KVCACHE_SPACE": "1"}
        procs.append(start(isolated, logs / f"node{rank}.log", full_env))
    n0, n1, url = both_ready(*procs, http, logs)
    yield {"model": model, "url": url, "nodes": (n0, n1), "logs": logs, "name": model.name}
    stop(n0)
    stop(n1)


def test_tp2_over_two_nodes_gives_the_reference_models_token_ids(cluster):
    """deploy/lws.yaml's leader and worker commands, run as two nodes: the reference model's tokens."""
    assert greedy_ids(cluster["url"], cluster["model"]) == reference_ids(cluster["model"])
    assert "--tensor-parallel-size 2" in (cluster["logs"] / "node0.log").read_text()  # the manifest's TP reached vLLM
    node1 = (cluster["logs"] / "node1.log").read_text()
    assert "headless multiproc executor" in node1
    assert "node 1 joined from 127.0.0.1" in (cluster["logs"] / "node0.log").read_text()


def test_a_node_killed_while_serving_ends_rank_0_promptly_naming_it(cluster):
    """Last test of each cluster: node 1's whole process tree gets SIGKILL, as when its machine dies."""
    n0, n1 = cluster["nodes"]
    os.killpg(n1.pid, signal.SIGKILL)
    n1.wait(timeout=30)  # reaped: our child, gone
    # a hang bound, not a timing: rank 0's watcher ends it within seconds; without it vLLM waits on its collective
    # until torch.distributed's timeout (minutes), which is what "promptly" rules out
    rc = n0.wait(timeout=60)
    log = (cluster["logs"] / "node0.log").read_text()
    assert rc == 3, (rc, log[-3000:])  # serve's status for a lost node: its watcher ended it, nothing else
    assert "node 1 was lost" in log
    deadline = time.monotonic() + 30
    while (group_left(n0.pid) or group_left(n1.pid)) and time.monotonic() < deadline:
        time.sleep(1)
    assert group_left(n0.pid) == [] and group_left(n1.pid) == []


# --- faults before vLLM starts ------------------------------------------------------------------------


@pytest.mark.full  # make test keeps the two nodes serving and a node killed
def test_rank_0_alone_says_it_waits_and_gives_up_after_its_timeout(tiny_hf, tmp_path):
    master = free_port()
    proc = node(tiny_hf, 0, master, tmp_path / "node0.log", "--tp", 2, "--node-timeout", 8)
    rc = proc.wait(timeout=120)  # a hang bound: it gives up at --node-timeout, before vLLM starts (the log says)
    log = (tmp_path / "node0.log").read_text()
    assert rc == 2, (rc, log)
    assert f"waiting for node(s) 1 at 127.0.0.1:{master + 1}" in log
    assert f"node(s) 1 of 2 did not join at 127.0.0.1:{master + 1} within 8 s" in log and "Traceback" not in log


# make test: the cards' comparison (below); the two refusals by real nodes in make test-full
@pytest.mark.full
@pytest.mark.parametrize("differ", ["model", "dtype"])
def test_a_node_with_another_folder_or_dtype_is_refused_by_name_on_both(tiny_hf, tiny_gqa_hf, tmp_path, differ):
    master = free_port()
    n0 = node(tiny_hf, 0, master, tmp_path / "node0.log", "--tp", 2, "--dtype", "float32", "--node-timeout", 60)
    other = (tiny_gqa_hf, "float32") if differ == "model" else (tiny_hf, "bfloat16")
    n1 = node(other[0], 1, master, tmp_path / "node1.log", "--tp", 2, "--dtype", other[1], "--node-timeout", 60)
    rcs = [n0.wait(timeout=120), n1.wait(timeout=120)]
    logs = [(tmp_path / f"node{r}.log").read_text() for r in (0, 1)]
    assert rcs == [2, 2], (rcs, logs)
    for log in logs:
        assert f"node 1 at 127.0.0.1 differs from node 0: {differ}" in log and "Traceback" not in log
    assert "does not start" in logs[1]


def test_cards_differ_by_the_vllm_version_by_name():
    mine = {"model": "a", "dtype": "float32", "vllm": "0.32.0+ministream.0.1.0"}
    assert nodes.differences(mine, {**mine, "vllm": "0.31.0"}) == ["vllm '0.31.0' (node 0: '0.32.0+ministream.0.1.0')"]


# --- pipeline parallelism on the CPU (compiled: eager meets vLLM's missing warm-up, docs/routes.md) ------


@pytest.mark.full
def test_pp2_on_one_node_gives_the_reference_models_token_ids(tiny_hf, start_serve, tmp_path):
    log = tmp_path / "server.log"
    proc, url = start_serve(tiny_hf, log, "--pp", 2, "--dtype", "float32", "--max-model-len", 256)
    try:
        wait_ready(url, proc, log, START_TIMEOUT)
        assert greedy_ids(url, tiny_hf) == reference_ids(tiny_hf)
    finally:
        stop(proc)


@pytest.mark.full
def test_pp2_over_two_nodes_gives_the_reference_models_token_ids(tiny_gqa_hf, tmp_path):
    n0, n1, url = two_nodes(tiny_gqa_hf, tmp_path, "--pp", 2, "--dtype", "float32", "--max-model-len", 256)
    try:
        assert greedy_ids(url, tiny_gqa_hf) == reference_ids(tiny_gqa_hf)
    finally:
        stop(n0)
        stop(n1)


@pytest.mark.parametrize(
    "version, gpu, refused",
    [
        ("0.8.5.post2+ministream.0.1.0", True, "has no multi-node .* from 0.11.1"),
        ("0.11.1", True, None),
        ("0.12.0.post2+ministream.0.1.0", False, "multi-node executor cannot run on a CPU: .*torch.cuda.device_count"),
        ("0.13.0", False, None),
        ("0.32.0", False, None),
    ],
)
def test_a_vllm_older_than_the_multinode_executor_is_refused_by_name(version, gpu, refused):
    """Before 0.11.1 there is no executor; on a CPU, 0.11 and 0.12's divides by the CUDA device count (0)."""
    if refused:
        with pytest.raises(MiniStreamError, match=rf"vLLM {re.escape(version)}.*{refused}"):
            nodes.check_release((version, "cpu"), gpu=gpu)
    else:
        nodes.check_release((version, "cpu"), gpu=gpu)


def test_start_here_starts_every_rank_isolated_on_its_own_core_with_the_cluster_arguments(tmp_path):
    """The helper bench-nodes and `matrix --run` start their nodes with: each rank gets the cluster's arguments,
    a core of its own and a /dev/shm of its own (each sees only the file it wrote there)."""
    shown = 'taskset -pc $$; touch /dev/shm/rank$4; ls /dev/shm; echo "$@"'
    procs = nodes.start_here(["sh", "-c", shown, "sh"], 2, 29999, tmp_path, dict(os.environ))
    for p in procs:
        assert p.wait(timeout=60) == 0
    cores = sorted(os.sched_getaffinity(0))
    for rank in (0, 1):
        said = (tmp_path / f"node{rank}.log").read_text().split("\n")
        assert said[0].endswith(f"current affinity list: {cores[rank % len(cores)]}"), said
        assert said[1:3] == [
            f"rank{rank}",
            f"--nnodes 2 --node-rank {rank} --master-addr 127.0.0.1 --master-port 29999",
        ]
