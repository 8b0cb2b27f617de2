"""lm-evaluation-harness, a client nobody here wrote, on a converted folder through three routes (`ministream eval`,
run as a user runs it): lm-eval's hf backend (the folder in transformers, trust_remote_code), its vllm backend (the
patched wheel) and local-completions against `ministream serve`. Our own tasks, which need no hub (from the held-out
text): the same choice on every multiple-choice item in float32, and every loglikelihood within TOL_PER_TOKEN of
the hf backend's per token it sums over."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from ministream.run.eval import NEXT_TASK, OURS, PERPLEXITY_TASK

from conftest import one_line_error

# Both sides compute in float32 from the same weights and differ only in the order of their sums (vLLM's CPU GEMMs,
# attention and log-softmax vs PyTorch's): each token's logprob moves by some 1e-5 (test_sampling.py derives and
# measures it on the same tiny model: at most 1.5e-5 over 3200 logprobs, its bound 1e-4). A loglikelihood sums n of
# them, so its error is at most n times one token's, whichever way each moves: TOL_PER_TOKEN * n, the n tokens of
# the continuation (a rolling paragraph: all of its ~145). Measured here (2-core AVX2 EPYC, 2026-12-06, every item):
# the vllm backend and the server both 3.9e-5 at most on a choice of 16-55 tokens (tolerance 1.6e-3 to 5.5e-3),
# 6.5e-5 on a paragraph (~1.4e-2); the other test model (the control) is beyond the tolerance on every item; each
# item's best choice beats its second by 165 of their summed tolerances or more, so a route within them must pick
# the same. Planted defect that fails the wheel test: lm-eval's default BOS on the wheel route alone (two BOS before
# a rolling text: 8.8 apart).
TOL_PER_TOKEN = 1e-4
QUICK_LIMIT = 8  # the quick tier's items of each task: the engine start is the cost, not the items


def run_eval(cli, folder: Path, out: Path, route: str, *args) -> dict:
    """`ministream eval FOLDER --route ROUTE` (our two tasks unless args say) -> its results.json."""
    r = cli("eval", folder, "--route", route, "--out", out, *args, env=_env(), timeout=1800)
    assert r.returncode == 0, r.stderr[-5000:]
    return json.loads((out / "results.json").read_text())


def _env() -> dict:
    # the tasks' data are local files: nothing may reach for the hub
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def loglikelihoods(results: dict, task: str) -> dict[int, list[float]]:
    """doc_id -> the loglikelihood of each choice (multiple choice) or of the whole text (rolling)."""
    return {
        s["doc_id"]: [r[0] if isinstance(r, list) else r for r in s["filtered_resps"]] for s in results["samples"][task]
    }


def token_counts(results: dict, task: str, folder: Path) -> dict[int, list[int]]:
    """doc_id -> the tokens each loglikelihood sums over: a choice's after its context, a rolling text's all (and
    the first, predicted from the prefix token)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def n(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    counts = {}
    for s in results["samples"][task]:
        doc = s["doc"]
        if task == NEXT_TASK:
            counts[s["doc_id"]] = [n(doc["context"] + " " + c) - n(doc["context"]) for c in doc["choices"]]
        else:
            counts[s["doc_id"]] = [n(doc["text"])]
    return counts


def differences(got: dict, want: dict, folder: Path, task: str) -> list[str]:
    """Every item of `got` whose choice differs from `want`'s, or a loglikelihood beyond the tolerance."""
    have, expect, counts = loglikelihoods(got, task), loglikelihoods(want, task), token_counts(want, task, folder)
    assert have and set(have) <= set(expect), (sorted(have), sorted(expect))
    found = []
    for doc, lls in have.items():
        ref = expect[doc]
        if task == NEXT_TASK and lls.index(max(lls)) != ref.index(max(ref)):
            found.append(f"{task} {doc}: choice {lls.index(max(lls))}, the hf backend's {ref.index(max(ref))}")
        for i, (a, b, n) in enumerate(zip(lls, ref, counts[doc], strict=True)):
            if abs(a - b) > TOL_PER_TOKEN * n:
                found.append(f"{task} {doc}/{i}: {a} vs {b}, beyond {TOL_PER_TOKEN} x {n} tokens")
    return found


def worst(got: dict, want: dict, task: str) -> float:
    have, expect = loglikelihoods(got, task), loglikelihoods(want, task)
    return max(abs(a - b) for d in have for a, b in zip(have[d], expect[d], strict=True))


@pytest.fixture(scope="module")
def transformers_run(cli, tiny_hf, tmp_path_factory) -> dict:
    """Our two tasks, every item, through lm-eval's hf backend: what the engine routes are held to."""
    return run_eval(cli, tiny_hf, tmp_path_factory.mktemp("eval-hf"), "transformers")


def test_tasks_choices_are_told_apart_beyond_the_tolerance(transformers_run, tiny_hf):
    """The control on the proof's margins: on every item the hf backend's best choice beats its second by more than
    both their tolerances, so "the same choice within the tolerance" is no coin toss; and the rolling task scored
    every paragraph."""
    lls = loglikelihoods(transformers_run, NEXT_TASK)
    counts = token_counts(transformers_run, NEXT_TASK, tiny_hf)
    assert len(lls) == 40
    for doc, ll in lls.items():
        order = sorted(range(len(ll)), key=ll.__getitem__, reverse=True)
        margin = ll[order[0]] - ll[order[1]]
        assert margin > TOL_PER_TOKEN * (counts[doc][order[0]] + counts[doc][order[1]]), (doc, ll)
    assert len(loglikelihoods(transformers_run, PERPLEXITY_TASK)) == 10
    assert transformers_run["results"][PERPLEXITY_TASK]["word_perplexity,none"] > 1


@pytest.mark.full
@pytest.mark.vllm
def test_eval_wheel_gives_the_transformers_choices_and_loglikelihoods(cli, tiny_hf, transformers_run, tmp_path):
    """lm-eval's vllm backend on the patched wheel (an offline engine, eager)
    against its hf backend, on the first QUICK_LIMIT items of both tasks."""
    got = run_eval(cli, tiny_hf, tmp_path, "wheel", "--limit", QUICK_LIMIT, "--enforce-eager")
    for task in OURS:
        print(f"wheel vs hf, {task}: at most {worst(got, transformers_run, task):.2g} apart")
        assert differences(got, transformers_run, tiny_hf, task) == []
    assert got["ministream"]["lm_eval_model"] == "vllm"


@pytest.mark.full
@pytest.mark.vllm
@pytest.mark.parametrize("route", ["wheel", "server"])
def test_eval_engine_routes_give_the_transformers_numbers_on_every_item(
    cli, tiny_hf, transformers_run, tmp_path, route
):
    """Every item of both tasks, as a user runs it: the wheel compiled (vLLM's default), the server through
    `ministream serve` started for the run; the same accuracy, and each loglikelihood within its tolerance."""
    got = run_eval(cli, tiny_hf, tmp_path, route)
    print(f"{route}: {got['results']}")
    for task in OURS:
        print(f"{route} vs hf, {task}: at most {worst(got, transformers_run, task):.2g} apart")
        assert differences(got, transformers_run, tiny_hf, task) == []
    assert got["results"][NEXT_TASK]["acc,none"] == transformers_run["results"][NEXT_TASK]["acc,none"]


@pytest.mark.full
def test_eval_of_another_model_differs_on_every_item(cli, tiny_gqa_hf, tiny_hf, transformers_run, tmp_path):
    """The control that can fail: the other test model's folder (a planted wrong model) through the same route is
    beyond the tolerance on every item, so agreement above is the model's, not lm-eval's or the task's."""
    got = run_eval(cli, tiny_gqa_hf, tmp_path, "transformers", "--limit", QUICK_LIMIT)
    for task in OURS:
        found = differences(got, transformers_run, tiny_hf, task)
        assert {line.split("/")[0].split(":")[0] for line in found} == {f"{task} {d}" for d in range(QUICK_LIMIT)}


# --- refusals: one line, exit 2, before anything starts ----------------------------------------------


def test_eval_refuses_an_unknown_task_by_name(cli, tiny_hf, tmp_path):
    r = cli("eval", tiny_hf, "--route", "transformers", "--tasks", "no_such_task", "--out", tmp_path, env=_env())
    line = one_line_error(r)
    assert "'no_such_task'" in line and "--include-path" in line
    assert not (tmp_path / "results.json").exists()


@pytest.mark.full
def test_eval_runs_a_users_own_task_from_the_include_path(cli, tiny_hf, tmp_path):
    """A task of the user's own (a YAML in --include-path, data beside it) runs by name; here one of ours renamed."""
    from ministream.run.eval import write_tasks

    mine = tmp_path / "mine"
    write_tasks(tmp_path / "ours")
    mine.mkdir()
    yaml = (tmp_path / "ours" / f"{NEXT_TASK}.yaml").read_text().replace(f"task: {NEXT_TASK}", "task: my_task")
    (mine / "my_task.yaml").write_text(yaml)
    out = tmp_path / "out"
    got = run_eval(cli, tiny_hf, out, "transformers", "--tasks", "my_task", "--include-path", mine, "--limit", 2)
    assert list(got["results"]) == ["my_task"] and len(got["samples"]["my_task"]) == 2


def test_eval_refuses_a_folder_that_fails_the_folder_check(cli, tiny_hf, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_hf, broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (broken / "config.json").write_text(json.dumps(config))
    line = one_line_error(cli("eval", broken, "--route", "transformers", "--out", tmp_path / "out", env=_env()))
    assert "model.layers.2" in line and "num_hidden_layers" in line
    missing = one_line_error(cli("eval", tmp_path / "nothing", "--out", tmp_path / "out", env=_env()))
    assert "nothing: no such folder" in missing


def test_eval_without_lm_eval_says_how_to_install_it(tiny_hf, tmp_path):
    """Where lm_eval cannot be imported (hidden from this interpreter, as if not installed)."""
    code = "import sys; sys.modules['lm_eval'] = None; from ministream.cli import console; console()"
    args = ["eval", str(tiny_hf), "--route", "transformers", "--out", str(tmp_path)]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env())
    line = one_line_error(r)
    assert "lm_eval" in line and "pip install 'lm_eval[api]'" in line
