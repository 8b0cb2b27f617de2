"""Sampling and logprobs of the patched vLLM against the reference model (issue 33).

One offline engine (fp32, eager: sampling is the subject, test_vllm.py proves the compiled default's tokens)
runs every request below in one process (ENGINE); each test reads its part. The reference model says in
advance what vLLM must do: its log-softmax is what `logprobs` and `prompt_logprobs` must equal, its greedy
text gives the stop strings and stop token ids, its eos says where generation ends. The engine runs on
`tiny_hf`: its greedy text reaches the format's eos_id within 64 tokens (the GQA model's never does, on the
default prompts or on the corpus's own paragraphs), so the eos tests can fail.

The tolerance for a logprob is TOL (see there); each test prints the largest difference it measured.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ministream.checkpoint.format import load
from ministream.run.generate import DEFAULT_PROMPTS, detokenize, load_reference, reference_generate, tokenize

from conftest import plugin_env_vars

pytestmark = pytest.mark.vllm

# Both sides compute in float32 from the same weights; they differ only in the order of the sums (vLLM's
# CPU GEMMs and attention kernels, RMSNorm and log-softmax vs PyTorch's). Each reordered sum of n terms
# moves a value by about sqrt(n) ulps; the logits here are O(10) (ulp ~1e-6) and pass through 2 layers of
# sums of 128-384 terms, so a logprob may move by some 1e-5. Measured on the tiny model (printed by each
# test): at most 1.5e-5 over the 3200 top-5 logprobs of the greedy tokens, 5.7e-6 over the prompt_logprobs.
# 1e-4 leaves a factor of ~7 over that, and fails the smallest real error measured on the same model by a
# factor of 150: norm_eps 1e-5 for 1e-6 moves a top-5 logprob by 1.5e-2 (bf16 weights by 9e-2, another
# rope_theta by 5.7).
TOL = 1e-4
MAX_TOKENS = 64  # the tiny model's greedy text reaches eos within this on DEFAULT_PROMPTS[8]
TOP_K = 5  # logprobs and prompt_logprobs asked for
SAMPLE_TOKENS = 24
SAMPLE = {"temperature": 1.0, "top_k": 10}  # seeded sampling: each token among the reference's top 10
# The sampler against the reference's distribution: DRAWS samples (n=) of each default prompt's next token, a
# Pearson chi-square test of their counts against the reference's softmax over its top_k (renormalised), summed
# over the prompts, at a false-failure rate of FALSE_FAILURE: a correct sampler fails it once in 10^4 runs (the
# chi-square approximation holds for cells expecting >= MIN_EXPECTED draws, rarer tokens pooled; 2000 simulated
# runs on the tiny model's distributions exceeded the 1e-1, 1e-2, 1e-3 bounds 9.4%, 0.8%, 0.1% of the time).
# Its power, from the same distributions: temperature 0.7 instead of 1 adds some 490 to the statistic's mean
# (its noncentrality), top_k 5 instead of 10 as much, against a bound of 112 over 62 degrees of freedom (mean 62):
# both fail it for certain; temperature 0.9 (+53) about half the time.
# The draws take the engine's generator, not a seed of their own: vLLM 0.32's CPU runner kills the engine on a
# seeded request whose sample it discards (it rewinds the request's torch.Generator by set_offset, which a CPU
# generator lacks: "CPU Generator does not use offset"), as it did on 5000 seeded ones. So they are not the same
# in another engine (TP=2, the plugin route), which same_outputs leaves them out of.
DRAWS = 500
FALSE_FAILURE = 1e-4
MIN_EXPECTED = 5

# One offline engine of the installed vLLM, every request of a spec file in turn; each request's outputs
# and the engine's counters after it (spec decoding's among them) into a JSON file.
ENGINE = """
import json, sys

def steps(logprobs):
    return None if logprobs is None else [
        None if s is None else {str(t): [lp.logprob, lp.rank] for t, lp in s.items()} for s in logprobs
    ]

def counters(llm):  # counters and gauges by name; vectors (accepted tokens per draft position) as lists
    out = {}
    for m in llm.get_metrics():
        if isinstance(getattr(m, "value", None), (int, float)):
            out[m.name] = m.value
        elif isinstance(getattr(m, "values", None), list):
            out[m.name] = list(m.values)
    return out

def result(o):
    outs = [
        {"ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
         "stop_reason": c.stop_reason, "logprobs": steps(c.logprobs)}
        for c in sorted(o.outputs, key=lambda c: c.index)
    ]
    return {"prompt_logprobs": steps(o.prompt_logprobs), "outputs": outs}

if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    from vllm import SamplingParams
    from ministream.run.engine import EngineSettings
    from ministream.run.generate import vllm_engine
    settings = EngineSettings(dtype="float32", tp=spec["tp"])
    llm = vllm_engine(spec["folder"], settings, disable_log_stats=False, **spec["engine"])
    out = {}
    for name, req in spec["requests"].items():
        prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
        if req.get("embed"):
            got = [{"embedding": list(o.outputs.embedding)} for o in llm.embed(prompts, use_tqdm=False)]
        else:
            params = req["params"]
            params = [SamplingParams(**p) for p in params] if isinstance(params, list) else SamplingParams(**params)
            got = [result(o) for o in llm.generate(prompts, params, use_tqdm=False)]
        out[name] = {"results": got, "counters": counters(llm)}
    json.dump(out, open(sys.argv[2], "w"))
"""


def run_engine(
    folder: Path, requests: dict, workdir: Path, tp: int = 1, python=None, env=None, check=True, **engine
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """ENGINE on `folder` in its own process (this interpreter, or another environment's `python`): the
    requests {name: {"prompts": [ids], "params": SamplingParams' keywords (or one per prompt), "embed": bool}},
    engine: LLM(...)'s keywords beyond engine.py's. (the process, {name: {"results", "counters"}} or None)."""
    workdir.mkdir(parents=True, exist_ok=True)
    script, spec, out = workdir / "engine.py", workdir / "spec.json", workdir / "out.json"
    script.write_text(ENGINE)
    spec.write_text(json.dumps({"folder": str(folder), "tp": tp, "engine": engine, "requests": requests}))
    r = subprocess.run(
        [str(python or sys.executable), str(script), str(spec), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r, json.loads(out.read_text()) if out.is_file() else None


def reference_rows(model, ids: list[int]) -> torch.Tensor:
    """The reference model's log-softmax at every position of `ids` (T, V): row t is the distribution of
    token t+1, in float32."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def logprob_diffs(steps: list, rows: torch.Tensor) -> list[float]:
    """|vLLM's logprob - the reference's| for every token vLLM lists at every step (steps[i] against rows[i]).
    Each token's rank must be its rank in the reference's row, unless another token lies within TOL of it
    (fp32 cannot order those): so the top-k vLLM lists are the reference's top-k."""
    diffs = []
    for i, step in enumerate(steps):
        row = rows[i]
        for token, (lp, rank) in step.items():
            t = int(token)
            diffs.append(abs(lp - float(row[t])))
            near = int(((row - row[t]).abs() <= TOL).sum()) > 1
            assert near or rank == int((row > row[t]).sum()) + 1, (i, t, rank)
    return diffs


def report(name: str, diffs: list[float]) -> float:
    worst = max(diffs)
    print(f"{name}: {len(diffs)} logprobs, max |vLLM - reference| = {worst:.3g} (tolerance {TOL:g})")
    return worst


# ---------------------------------------------------------------- the requests and their engine


def first_new_token(ids: list[int], start: int, avoid: int) -> int:
    """The first index >= start whose token appears nowhere before it (and is not `avoid`)."""
    return next(k for k in range(start, len(ids)) if ids[k] not in ids[:k] and ids[k] != avoid)


def stop_string(folder: Path, ids: list[int]) -> str:
    """Five characters of the reference's greedy text that span the boundary after its sixth token."""
    cut = len(detokenize(folder, ids[:6]))
    return detokenize(folder, ids)[cut - 2 : cut + 3]


def sampling_requests(folder: Path, prompts: list[list[int]], greedy: list[dict], eos: int) -> dict:
    """Every request of the module, the stop strings and stop ids read off the reference's greedy text."""
    plain = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    sampled = {**SAMPLE, "max_tokens": SAMPLE_TOKENS, "logprobs": 0, "ignore_eos": True}
    few = prompts[:4]
    return {
        "greedy": {"prompts": prompts, "params": {**plain, "logprobs": TOP_K, "prompt_logprobs": TOP_K}},
        "eos": {"prompts": prompts, "params": {**plain, "ignore_eos": False}},
        "seeded": {"prompts": few, "params": {**sampled, "seed": 1234}},
        # the same requests in another order (other batch places): a request's seed alone decides its tokens
        "seeded_again": {"prompts": few[::-1], "params": {**sampled, "seed": 1234}},
        "seeded_other": {"prompts": few, "params": {**sampled, "seed": 4321}},
        "n": {"prompts": few[:2], "params": {**sampled, "n": 4, "seed": 99}},
        "n_again": {"prompts": few[:2], "params": {**sampled, "n": 4, "seed": 99}},
        "distribution": {"prompts": prompts, "params": {**SAMPLE, "max_tokens": 1, "n": DRAWS}},
        "stop_strings": {
            "prompts": few,
            "params": [{**plain, "stop": [stop_string(folder, g["ids"])]} for g in greedy[:4]],
        },
        "stop_strings_kept": {
            "prompts": few,
            "params": [
                {**plain, "stop": [stop_string(folder, g["ids"])], "include_stop_str_in_output": True}
                for g in greedy[:4]
            ],
        },
        "stop_ids": {
            "prompts": few,
            "params": [{**plain, "stop_token_ids": [g["ids"][first_new_token(g["ids"], 5, eos)]]} for g in greedy[:4]],
        },
    }


@pytest.fixture(scope="module")
def case(tiny, tiny_hf, tmp_path_factory) -> dict:
    """The prompts, the reference's answers, the requests and the TP=1 engine's outputs."""
    eos = load(tiny)[0].eos_id  # the format's eos_id, from the training checkpoint's own config
    prompts = tokenize(tiny_hf, DEFAULT_PROMPTS)
    greedy = reference_generate(tiny_hf, prompts, MAX_TOKENS)
    until_eos = reference_generate(tiny_hf, prompts, MAX_TOKENS, stop_ids=(eos,))
    requests = sampling_requests(tiny_hf, prompts, greedy, eos)
    _, got = run_engine(tiny_hf, requests, tmp_path_factory.mktemp("sampling"), enforce_eager=True)
    return {
        "folder": tiny_hf,
        "model": load_reference(tiny_hf, "float32"),
        "eos": eos,
        "prompts": prompts,
        "greedy": greedy,
        "until_eos": until_eos,
        "requests": requests,
        "vllm": got,
    }


def outputs(case: dict, name: str) -> list[list[dict]]:
    """Per prompt, the completions of request `name` (n of them)."""
    return [r["outputs"] for r in case["vllm"][name]["results"]]


def ids_of(case: dict, name: str) -> list[list[list[int]]]:
    return [[c["ids"] for c in o] for o in outputs(case, name)]


# ---------------------------------------------------------------- logprobs


def test_logprobs_of_greedy_tokens_equal_the_reference_log_softmax(case):
    diffs = []
    for prompt, want, (got,) in zip(case["prompts"], case["greedy"], outputs(case, "greedy")):
        assert got["ids"] == want["ids"]
        rows = reference_rows(case["model"], prompt + got["ids"])[len(prompt) - 1 : -1]
        assert len(got["logprobs"]) == len(got["ids"]) == MAX_TOKENS
        assert all(sorted(r for _, r in step.values())[:TOP_K] == list(range(1, TOP_K + 1)) for step in got["logprobs"])
        diffs += logprob_diffs(got["logprobs"], rows)
    assert report("logprobs", diffs) <= TOL


def test_prompt_logprobs_equal_the_reference_log_softmax(case):
    diffs = []
    for prompt, result in zip(case["prompts"], case["vllm"]["greedy"]["results"]):
        steps = result["prompt_logprobs"]
        assert len(steps) == len(prompt) and steps[0] is None  # nothing predicts the first token
        for t, step in enumerate(steps[1:], 1):
            assert str(prompt[t]) in step  # the prompt's own token, whatever its rank
        diffs += logprob_diffs(steps[1:], reference_rows(case["model"], prompt)[:-1])
    assert report("prompt_logprobs", diffs) <= TOL


# ---------------------------------------------------------------- seeded sampling, n > 1


def check_sampled(case: dict, prompt: list[int], got: dict) -> list[float]:
    """A sampled completion against the reference: each token among the reference's top_k at its place (the
    sampler used the reference's ranking), its logprob the reference's; the differences."""
    rows = reference_rows(case["model"], prompt + got["ids"])[len(prompt) - 1 : -1]
    for t, token in enumerate(got["ids"]):
        allowed = rows[t].topk(SAMPLE["top_k"])
        assert token in allowed.indices.tolist() or float(allowed.values[-1] - rows[t][token]) <= TOL, (t, token)
    return logprob_diffs(got["logprobs"], rows)


def test_seeded_sampling_gives_the_same_tokens_again_and_samples_from_the_reference(case):
    seeded = ids_of(case, "seeded")
    assert ids_of(case, "seeded_again")[::-1] == seeded  # same seed, other batch places: same tokens
    assert ids_of(case, "seeded_other") != seeded  # another seed: other tokens
    assert [s[0] for s in seeded] != [g["ids"][:SAMPLE_TOKENS] for g in case["greedy"][:4]]  # not greedy
    diffs = []
    for prompt, (got,) in zip(case["prompts"], outputs(case, "seeded")):
        assert len(got["ids"]) == SAMPLE_TOKENS
        diffs += check_sampled(case, prompt, got)
    assert report("sampled tokens' logprobs", diffs) <= TOL


def test_n_completions_are_distinct_samples_repeated_by_their_seed(case):
    got = outputs(case, "n")
    assert ids_of(case, "n_again") == ids_of(case, "n")
    diffs = []
    for prompt, completions in zip(case["prompts"], got):
        assert len(completions) == 4
        assert len({tuple(c["ids"]) for c in completions}) > 1  # n samples, not one sample n times
        for c in completions:
            diffs += check_sampled(case, prompt, c)
    assert report("n>1 logprobs", diffs) <= TOL


def sampling_distribution(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """What SAMPLE draws the next token of `prompt` from, by the reference: its top_k tokens and their
    probabilities (the softmax at SAMPLE's temperature over the top_k logits alone), in float64."""
    top = reference_rows(model, prompt)[-1].double().topk(SAMPLE["top_k"])
    return top.indices.tolist(), torch.softmax(top.values / SAMPLE["temperature"], dim=-1)


def chi_square(counts: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` and its degrees of freedom; cells expecting fewer than
    MIN_EXPECTED draws are pooled into one (into the smallest other cell, if the pool still expects too few)."""
    n, pairs = sum(counts), sorted(zip(probs.tolist(), counts), reverse=True)
    cells = [[n * p, c] for p, c in pairs if n * p >= MIN_EXPECTED]
    pool = [sum(n * p for p, c in pairs if n * p < MIN_EXPECTED), sum(c for p, c in pairs if n * p < MIN_EXPECTED)]
    if pool[0] >= MIN_EXPECTED:
        cells.append(pool)
    elif pool[0] > 0:
        cells[-1] = [cells[-1][0] + pool[0], cells[-1][1] + pool[1]]
    return sum((c - e) ** 2 / e for e, c in cells), len(cells) - 1


def chi_square_bound(df: int, p: float) -> float:
    """The value a chi-square variable of `df` degrees of freedom exceeds with probability `p` (its upper tail,
    P(X > x) = Q(df/2, x/2), the regularised upper incomplete gamma, solved by bisection)."""
    lo, hi, a = 0.0, df + 20.0 * df**0.5 + 100.0, torch.tensor(df / 2, dtype=torch.float64)
    for _ in range(100):
        mid = (lo + hi) / 2
        tail = float(torch.special.gammaincc(a, torch.tensor(mid / 2, dtype=torch.float64)))
        lo, hi = (mid, hi) if tail > p else (lo, mid)
    return hi


def test_sampled_tokens_follow_the_reference_distribution_by_a_chi_square_test(case):
    """DRAWS samples of each prompt's next token (temperature 1, top_k 10): counted per token, they fit the
    reference's distribution at FALSE_FAILURE (see there), and none falls outside its top_k."""
    statistic, df = 0.0, 0
    for prompt, completions in zip(case["prompts"], outputs(case, "distribution"), strict=True):
        drawn = [c["ids"][0] for c in completions]
        tokens, probs = sampling_distribution(case["model"], prompt)
        assert len(drawn) == DRAWS and set(drawn) <= set(tokens), (prompt, sorted(set(drawn) - set(tokens)))
        s, d = chi_square([drawn.count(t) for t in tokens], probs)
        statistic, df = statistic + s, df + d
    bound = chi_square_bound(df, FALSE_FAILURE)
    print(f"sampling: chi-square {statistic:.1f}, {df} degrees of freedom, bound {bound:.1f} at p {FALSE_FAILURE:g}")
    assert df >= len(case["prompts"]) and statistic <= bound


# ---------------------------------------------------------------- stop strings, stop token ids, eos


def test_a_stop_string_ends_the_text_before_it_or_after_it_when_kept(case):
    for i, want in enumerate(case["greedy"][:4]):
        stop = case["requests"]["stop_strings"]["params"][i]["stop"][0]
        text = detokenize(case["folder"], want["ids"])
        cut = text.index(stop)
        (got,), (kept,) = outputs(case, "stop_strings")[i], outputs(case, "stop_strings_kept")[i]
        assert got["text"] == text[:cut] and kept["text"] == text[: cut + len(stop)], (stop, text)
        for c in (got, kept):
            assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
            assert c["ids"] == want["ids"][: len(c["ids"])] and len(c["ids"]) < MAX_TOKENS


def test_a_stop_token_id_ends_generation_at_that_token(case):
    for i, want in enumerate(case["greedy"][:4]):
        (stop,) = case["requests"]["stop_ids"]["params"][i]["stop_token_ids"]
        (got,) = outputs(case, "stop_ids")[i]
        assert got["ids"] == want["ids"][: want["ids"].index(stop) + 1]  # through the stop token, no further
        assert got["finish_reason"] == "stop" and got["stop_reason"] == stop


def test_generation_ends_at_the_formats_eos_id_unless_ignore_eos(case):
    eos, until_eos = case["eos"], case["until_eos"]
    config = json.loads((case["folder"] / "config.json").read_text())
    assert config["eos_token_id"] == eos
    ending = [i for i, r in enumerate(until_eos) if r["ids"][-1] == eos]
    assert ending, "the reference reaches eos on no prompt: nothing here could fail"
    for i, ((got,), (ignored,)) in enumerate(zip(outputs(case, "eos"), outputs(case, "greedy"))):
        assert got["ids"] == until_eos[i]["ids"]
        if i in ending:
            assert got["finish_reason"] == "stop" and got["stop_reason"] is None  # eos, not a stop we gave
            # ignore_eos: the same tokens through the eos, and on to max_tokens
            assert (
                len(ignored["ids"]) == MAX_TOKENS > len(got["ids"]) and ignored["ids"][: len(got["ids"])] == got["ids"]
            )
        else:
            assert got["finish_reason"] == "length" and len(got["ids"]) == MAX_TOKENS


# ---------------------------------------------------------------- the slow tier: TP=2, the plugin route


def same_outputs(case: dict, other: dict) -> None:
    """Another engine's outputs of the same requests: the same tokens, stops and reasons for every request
    (seeded sampling included), and logprobs within TOL of the reference."""
    for name in case["requests"].keys() - {"distribution"}:  # unseeded (see DRAWS)
        mine = [
            [{k: c[k] for k in ("ids", "text", "finish_reason", "stop_reason")} for c in r["outputs"]]
            for r in case["vllm"][name]["results"]
        ]
        theirs = [
            [{k: c[k] for k in ("ids", "text", "finish_reason", "stop_reason")} for c in r["outputs"]]
            for r in other[name]["results"]
        ]
        assert theirs == mine, name
    diffs = []
    for prompt, result in zip(case["prompts"], other["greedy"]["results"]):
        (got,) = result["outputs"]
        diffs += logprob_diffs(
            got["logprobs"], reference_rows(case["model"], prompt + got["ids"])[len(prompt) - 1 : -1]
        )
        diffs += logprob_diffs(result["prompt_logprobs"][1:], reference_rows(case["model"], prompt)[:-1])
    assert report("logprobs", diffs) <= TOL


@pytest.mark.full
def test_tensor_parallel_2_samples_the_same_tokens_as_tp_1(case, tmp_path):
    """One core per rank; seeded sampling, n>1, stops and eos as at TP=1, from a second engine (run after run)."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    _, tp2 = run_engine(case["folder"], case["requests"], tmp_path, tp=2, env=env, enforce_eager=True)
    same_outputs(case, tp2)


@pytest.mark.full
def test_the_plugin_route_samples_the_same_tokens(case, plugin_python, tmp_path):
    """Stock vllm-cpu 0.32.0 + the plugin (conftest.py's plugin_python) on the same requests."""
    _, plugin = run_engine(
        case["folder"],
        case["requests"],
        tmp_path,
        python=plugin_python,
        env=plugin_env_vars(),
        enforce_eager=True,
    )
    same_outputs(case, plugin)
