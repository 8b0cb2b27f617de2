"""Every scheduler path gives the plain run's tokens, and the reference model's (issue 33).

Real vLLM engines on a test model, fp32, greedy: chunked prefill under a step budget below the prompt's
length, a prefix-cache hit (the same long prompt again, and a second one sharing its first two thirds),
preemption and recompute under a KV cache too small for the batch, one batch of long and short prompts,
max_num_seqs 64 and 1. Each test proves its path was taken from what vLLM itself reports
(scheduler_engine.py): the settings it resolved, each engine step's scheduled requests and tokens (its
iteration log), each request's cached tokens and preemptions, its prefix-cache and preemption counters.

Three engines per route and model, in one process (scheduler_engine.py): "plain" (vLLM's defaults, the
prefix cache off: each batch prefilled whole in its first step), "stressed" (budget, prefix cache, small
cache and max_num_seqs 64 at once, each batch showing one of them) and "one at a time" (max_num_seqs 1).
make test: the stressed engine alone on the patched wheel and the GQA model, every path it takes proven and
its tokens the reference model's. make test-full: all three engines, the patched wheel and the plugin route
on the GQA model, the patched wheel on the MHA model, each path's tokens also the plain engine's.
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ministream.run.generate import DEFAULT_PROMPTS, folder_tokenizer, tokenize
from ministream.run.prompts import SHARING, THE_END, context_prompts
from ministream.run.verify import compare, reference_outputs

pytestmark = pytest.mark.vllm
SCRIPT = Path(__file__).with_name("scheduler_engine.py")
MAX_TOKENS = 32
TOP_K = 5
BUDGET = 80  # tokens one engine step may schedule: below every long prompt (a quarter of 512 is 128)
SEQS = 64
BLOCK = 32  # the KV cache's block (the CPU's default is 128): the unit of the prefix cache and of preemption
BLOCKS = 100  # 3200 tokens: one sequence of the whole context fits; the mixed batch does not
SHORTS = 72  # short prompts in the mixed batch: more than SEQS
LONG = 64  # tokens above which the reference model takes a prompt by itself

STRESSED = {
    "max_num_batched_tokens": BUDGET,
    "max_num_seqs": SEQS,
    "enable_prefix_caching": True,
    "block_size": BLOCK,
    "num_gpu_blocks_override": BLOCKS,
}
# engine: (settings over ministream's offline ones, the batches it runs in this order)
ENGINES = {
    "plain": ({"enable_prefix_caching": False}, ["chunked", "prefix", "mixed", "one at a time"]),
    # the first batch fills the prefix cache the second hits; the third overflows the KV cache and max_num_seqs
    "stressed": (STRESSED, ["chunked", "prefix", "mixed"]),
    "one at a time": ({"max_num_seqs": 1, "enable_prefix_caching": False}, ["one at a time"]),
}
# make test-full: three engine starts per case and the reference's long prompts (~100 s on 2 cores) do not fit
# make test's 25 minutes, which runs the stressed engine alone (the last test) and verify's far-from-position-0
# prompts (test_verify.py)
CASES = [
    pytest.param("patched wheel", "tiny_gqa_hf", marks=pytest.mark.full),
    pytest.param("plugin", "tiny_gqa_hf", marks=pytest.mark.full),
    pytest.param("patched wheel", "tiny_hf", marks=pytest.mark.full),
]


def batches_of(folder: Path) -> tuple[dict[str, list[list[int]]], dict[str, dict]]:
    """The batches' prompt ids, by name, from verify's prompts far from position 0 (context_prompts, the
    model's own max_position_embeddings) and short ones; and those long prompts' rows, by label."""
    positions = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    tok = folder_tokenizer(folder.resolve() / "tokenizer.json")
    rows = {r["label"]: r for r in context_prompts(tok, positions, MAX_TOKENS)}
    long = {label: tok.encode(r["prompt"]).ids for label, r in rows.items()}
    short = tokenize(
        folder, [f"{p} {i}" for i in range(math.ceil(SHORTS / len(DEFAULT_PROMPTS))) for p in DEFAULT_PROMPTS]
    )
    batches = {
        "chunked": [long[THE_END]],
        "prefix": [long[THE_END], long[SHARING]],  # the same long prompt again, and one sharing its prefix
        "mixed": [long["two thirds"], long["a quarter"], *short[:SHORTS]],
        "one at a time": [long[THE_END], long["a quarter"], *short[:3]],
    }
    return batches, rows


@dataclass
class Run:
    batches: dict[str, list[list[int]]]
    rows: dict[str, dict]  # the long prompts' rows (context_prompts), by label
    engines: dict[str, dict]  # engine -> {"config": vLLM's resolved settings, batch name -> its results}
    reference: dict[str, list[dict]]  # batch name -> the reference model's outputs

    def got(self, engine: str, batch: str) -> dict:
        return self.engines[engine][batch]


def run_engines(
    python: Path, env: dict, folder: Path, batches: dict, work: Path, which: dict = ENGINES
) -> dict[str, dict]:
    """`which` engines (ENGINES') through scheduler_engine.py in one process of `python`: engine -> {"config",
    batch name -> its results}; the engines' log in work/engines.log."""
    engines = [{"name": n, "settings": s, "batches": [batches[b] for b in names]} for n, (s, names) in which.items()]
    spec = {"model": str(folder), "dtype": "float32", "max_tokens": MAX_TOKENS, "top_k": TOP_K, "engines": engines}
    (work / "spec.json").write_text(json.dumps(spec))
    command = [str(python), str(SCRIPT), str(work / "spec.json"), str(work / "out.json")]
    r = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    (work / "engines.log").write_text(r.stdout + r.stderr)
    assert r.returncode == 0, r.stderr[-5000:]
    out = json.loads((work / "out.json").read_text())
    return {n: {"config": out[n]["config"], **dict(zip(names, out[n]["batches"]))} for n, (_, names) in which.items()}


def reference_of(folder: Path, batches: dict) -> dict[str, list[dict]]:
    """The reference model's outputs per batch, each distinct prompt generated once (a long one by itself)."""
    distinct = list(dict.fromkeys(tuple(p) for batch in batches.values() for p in batch))
    alone = {i for i, p in enumerate(distinct) if len(p) > LONG}
    outputs = reference_outputs(folder, [list(p) for p in distinct], "float32", MAX_TOKENS, TOP_K, alone)
    want = dict(zip(distinct, outputs))
    return {name: [want[tuple(p)] for p in batch] for name, batch in batches.items()}


@pytest.fixture(scope="module")
def runs(request, route_python, tmp_path_factory):
    """runs(route, folder fixture) -> Run: the three engines started once per route and model."""
    done: dict = {}

    def get(route: str, folder_name: str) -> Run:
        if (route, folder_name) not in done:
            folder = request.getfixturevalue(folder_name)
            batches, rows = batches_of(folder)
            python, env = route_python(route)
            engines = run_engines(python, env, folder, batches, tmp_path_factory.mktemp("scheduler"))
            done[route, folder_name] = Run(batches, rows, engines, reference_of(folder, batches))
        return done[route, folder_name]

    return get


@pytest.fixture(scope="module")
def stressed(tiny_gqa_hf, tmp_path_factory) -> Run:
    """make test's proof: the stressed engine alone, on the patched wheel and the GQA model, and the reference's
    outputs for its batches."""
    batches, rows = batches_of(tiny_gqa_hf)
    which = {"stressed": ENGINES["stressed"]}
    work = tmp_path_factory.mktemp("stressed")
    engines = run_engines(Path(sys.executable), {**os.environ}, tiny_gqa_hf, batches, work, which)
    reference = reference_of(tiny_gqa_hf, {b: batches[b] for b in ENGINES["stressed"][1]})
    return Run(batches, rows, engines, reference)


def assert_same_tokens(run: Run, engine: str, batch: str) -> None:
    """fp32: the engine's token ids are the plain run's (where it ran) and the reference model's, prompt by prompt,
    and their logprobs agree to 1e-3 (a path that fed the model other keys or positions would move them further)."""
    got = run.got(engine, batch)["outputs"]
    plain = [("plain", run.got("plain", batch)["outputs"])] if "plain" in run.engines else []
    for other, want in (*plain, ("reference", run.reference[batch])):
        passed, rows = compare(want, got, exact=True, names=(other, engine))
        report = "\n".join(f"{batch} prompt {r.prompt}: identical={r.identical} {r.detail}" for r in rows)
        assert passed, report
        assert max(r.max_logprob_diff for r in rows) < 1e-3, report


def lengths(run: Run, batch: str) -> list[int]:
    return [len(p) for p in run.batches[batch]]


def scheduled_tokens(run: Run, engine: str, batch: str) -> tuple[int, int]:
    """(the tokens the engine's steps took for the batch, what every prompt once and every new token but the
    last make): more means some were computed again, fewer that a cache served some."""
    sizes = lengths(run, batch)
    return sum(ctx + gen for _, ctx, _, gen in run.got(engine, batch)["steps"]), sum(sizes) + len(sizes) * (
        MAX_TOKENS - 1
    )


def prefilled_whole(steps: list[list[int]], sizes: list[int]) -> bool:
    """Each step's context requests are the next prompts in order (vLLM schedules first come, first served),
    each whole: its context tokens are their lengths' sum. A chunked prompt would cut a sum."""
    done = 0
    for ctx_reqs, ctx, _, _ in steps:
        if ctx != sum(sizes[done : done + ctx_reqs]):
            return False
        done += ctx_reqs
    return done == len(sizes)


def beside(run: Run, engine: str, batch: str, i: int) -> int:
    """How many of the batch's other prompts were running while prompt i was: from its first scheduling to its
    last token (engine-core clock)."""
    spans = [(o["scheduled"], o["last_token"]) for o in run.got(engine, batch)["outputs"]]
    start, end = spans[i]
    return sum(1 for j, (s, e) in enumerate(spans) if j != i and s < end and start < e)


@pytest.mark.parametrize("route, folder", CASES)
def test_the_plain_run_prefills_each_batch_whole_and_gives_the_reference_models_tokens(route, folder, runs):
    run = runs(route, folder)
    config = run.engines["plain"]["config"]
    assert not config["enable_prefix_caching"] and config["max_num_batched_tokens"] >= sum(lengths(run, "mixed"))
    for batch in ENGINES["plain"][1]:
        got = run.got("plain", batch)
        # every prompt prefilled whole in one step (as many in a step as had arrived): no chunk, no cache hit,
        # no preemption, each token computed once
        assert prefilled_whole(got["steps"], lengths(run, batch)), got["steps"][:4]
        assert all(o["cached"] == 0 and o["preemptions"] == 0 for o in got["outputs"])
        assert got["counters"]["vllm:num_preemptions"] == 0
        taken, once = scheduled_tokens(run, "plain", batch)
        assert taken == once
        passed, rows = compare(run.reference[batch], got["outputs"], exact=True)
        assert passed, "\n".join(f"{batch} prompt {r.prompt}: {r.detail}" for r in rows if not r.identical)
        assert max(r.max_logprob_diff for r in rows) < 1e-3


def assert_chunked(run: Run) -> None:
    """The end prompt, longer than the step budget, prefilled in budget-sized chunks, all of it."""
    config = run.engines["stressed"]["config"]
    assert config["enable_chunked_prefill"] and config["max_num_batched_tokens"] == BUDGET
    (prompt,) = lengths(run, "chunked")
    steps = run.got("stressed", "chunked")["steps"]
    assert prompt > BUDGET and all(ctx + gen <= BUDGET for _, ctx, _, gen in steps), steps
    prefill = [ctx for _, ctx, _, _ in steps if ctx]
    assert len(prefill) == math.ceil(prompt / BUDGET) and sum(prefill) == prompt, prefill  # in chunks, all of it


def assert_prefix_hit(run: Run) -> None:
    """The end prompt again (its blocks cached by the batch before), and the prompt that shares its first two
    thirds: each hits the cache in whole blocks, and only the rest is computed."""
    assert run.engines["stressed"]["config"]["enable_prefix_caching"]
    got = run.got("stressed", "prefix")
    again, sharer = lengths(run, "prefix")
    shared = run.rows[SHARING]["shared_tokens"]
    want = [(again - 1) // BLOCK * BLOCK, min(shared, sharer - 1) // BLOCK * BLOCK]  # vLLM computes the last token
    assert [o["cached"] for o in got["outputs"]] == want and min(want) > 0
    assert got["counters"]["vllm:prefix_cache_hits"] == sum(want)
    assert sum(ctx for _, ctx, _, _ in got["steps"]) == again + sharer - sum(want)


def assert_preempted(run: Run) -> None:
    """The mixed batch overflows the small KV cache: requests preempted, and their tokens computed again."""
    assert run.engines["stressed"]["config"]["num_blocks"] == BLOCKS
    assert sum(math.ceil((n + MAX_TOKENS) / BLOCK) for n in lengths(run, "mixed")) > BLOCKS  # too small for the batch
    got = run.got("stressed", "mixed")
    preempted = [i for i, o in enumerate(got["outputs"]) if o["preemptions"]]
    assert preempted and got["counters"]["vllm:num_preemptions"] >= len(preempted), got["counters"]
    # recomputed: the steps took more tokens than every prompt and new token once (vLLM's iteration log
    # counts a resumed request's recomputed tokens as generation tokens)
    taken, once = scheduled_tokens(run, "stressed", "mixed")
    assert taken > once


def assert_at_most_64_sequences(run: Run) -> None:
    assert run.engines["stressed"]["config"]["max_num_seqs"] == SEQS < len(run.batches["mixed"])
    running = [ctx_reqs + gen_reqs for ctx_reqs, _, gen_reqs, _ in run.got("stressed", "mixed")["steps"]]
    assert max(running) == SEQS, running  # reached, never passed: the rest waited


@pytest.mark.parametrize("route, folder", CASES)
def test_chunked_prefill_under_a_small_step_budget_gives_the_plain_tokens(route, folder, runs):
    run = runs(route, folder)
    assert_chunked(run)
    assert_same_tokens(run, "stressed", "chunked")


@pytest.mark.parametrize("route, folder", CASES)
def test_a_prefix_cache_hit_gives_the_plain_tokens(route, folder, runs):
    run = runs(route, folder)
    assert_prefix_hit(run)
    assert_same_tokens(run, "stressed", "prefix")


@pytest.mark.parametrize("route, folder", CASES)
def test_preemption_and_recompute_under_a_small_kv_cache_give_the_plain_tokens(route, folder, runs):
    run = runs(route, folder)
    assert_preempted(run)
    assert_same_tokens(run, "stressed", "mixed")


@pytest.mark.parametrize("route, folder", CASES)
def test_a_batch_of_long_and_short_prompts_gives_the_reference_models_tokens(route, folder, runs):
    """The two long prompts (first in the batch) run beside short ones in both engines; in the stressed one,
    steps hold chunks of prefill beside decoding sequences."""
    run = runs(route, folder)
    sizes = lengths(run, "mixed")
    assert min(sizes[:2]) >= 4 * BLOCK and max(sizes[2:]) < BLOCK
    assert all(beside(run, engine, "mixed", i) >= 8 for engine in ("plain", "stressed") for i in (0, 1))
    assert any(ctx_reqs and gen_reqs for ctx_reqs, _, gen_reqs, _ in run.got("stressed", "mixed")["steps"])
    assert_same_tokens(run, "stressed", "mixed")


@pytest.mark.parametrize("route, folder", CASES)
def test_max_num_seqs_64_holds_the_batch_to_64_sequences(route, folder, runs):
    run = runs(route, folder)
    assert_at_most_64_sequences(run)
    assert_same_tokens(run, "stressed", "mixed")


@pytest.mark.parametrize("route, folder", CASES)
def test_max_num_seqs_1_runs_one_sequence_at_a_time(route, folder, runs):
    run = runs(route, folder)
    assert run.engines["one at a time"]["config"]["max_num_seqs"] == 1
    got = run.got("one at a time", "one at a time")
    assert all(ctx_reqs + gen_reqs == 1 for ctx_reqs, _, gen_reqs, _ in got["steps"]), got["steps"]
    spans = sorted((o["scheduled"], o["last_token"]) for o in got["outputs"])
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans  # none overlaps another
    assert_same_tokens(run, "one at a time", "one at a time")


def test_one_stressed_engine_takes_chunked_prefill_a_prefix_hit_preemption_and_max_num_seqs_and_keeps_the_tokens(
    stressed,
):
    """make test's proof of every scheduler path at once: one engine (step budget, prefix cache, small KV cache,
    max_num_seqs 64) on the patched wheel, each path shown taken by vLLM's own iteration log, request stats and
    counters, and every batch's tokens the reference model's (fp32, logprobs within 1e-3)."""
    assert_chunked(stressed)
    assert_prefix_hit(stressed)
    assert_preempted(stressed)
    assert_at_most_64_sequences(stressed)
    for batch in ENGINES["stressed"][1]:
        assert_same_tokens(stressed, "stressed", batch)
