"""Prove the installed vLLM computes MiniStream: golden outputs, the rule for the dtype, and layer by layer.

`ministream verify MODEL [--raw RAW]`:
1. golden file: the reference model (on the training checkpoint RAW, else on the converted folder)
   writes greedy tokens and top-k logprobs for a prompt set, with the prompt ids, dtype and the
   sha256 of what it read. The built-in set: ten short prompts, then four of corpus text far from
   position 0 (prompts.context_prompts): a quarter, two thirds and all of the model's context
   (max_position_embeddings) less the new tokens, and one that shares the longest one's first two
   thirds; the golden file records which is which ("context");
2. the installed vLLM generates from the same prompt ids, its debug switch (MINISTREAM_DUMP_HIDDEN)
   saving every layer's output for the prompts;
3. the report: exact matches, first divergence per prompt, the rule for the dtype, max logprob diff.
   Exit 0 only if the rule passes. On failure: the layer-by-layer table (cosine similarity and max
   abs difference of the embeddings, each layer's output and the last prompt token's logits) names the
   first diverging stage, and with RAW the folder's config and tensors are checked against the
   checkpoint, naming each setting or tensor that differs.

The rule for the dtype: fp32: token ids identical. bf16/fp16: vLLM's own rule (tests/models/utils.py
check_logprobs_close): the sequences may part at one token, provided at that first difference each
side's token is among the other side's top-k logprobs; after it the continuations are not compared.
A quantized folder (`ministream quantize`): the reference model on its weights dequantized, what vLLM
multiplies by, under vLLM's rule (w8a8 also rounds the activations, which the reference does not).
"""

import glob
import hashlib
import json
import math
import multiprocessing
import os
import re
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import MiniStreamError, __version__
from ..atomic import check_output, mark_made
from ..checkpoint.folder import EMBED, FINAL_NORM, HEAD, Folder, name_differences, natural, open_folder
from ..checkpoint.perplexity import Chunks
from ..spec import FORMAT_VERSION, QKV, hf_names
from .engine import OFFLINE_DTYPE, OFFLINE_MAX_MODEL_LEN, EngineSettings, vllm_failures
from .folder import check_servable
from .prompts import context_prompts

GOLDEN_VERSION = 1  # the golden file's own layout
# Each width's rule against the full-precision model (docs/quantize.md, "The rules"): identical ids; the first
# difference within each other's top-k; and for the quantized widths a bound on perplexity on held-out text.
PERPLEXITY_BOUND = {"w8a8": 0.02, "w4a16": 0.08, "fp8": 0.02}
TOP_K_WIDTHS = {"bfloat16", "w8a8", "fp8"}  # held to the top-k rule (w4a16 to its perplexity bound only)
RULES = {
    "float32": "identical token ids",
    "bfloat16": "first difference within each other's top-k",
    **{
        w: f"first difference within each other's top-k, perplexity at most {PERPLEXITY_BOUND[w]:.0%} above"
        for w in ("w8a8", "fp8")
    },
    "w4a16": f"perplexity at most {PERPLEXITY_BOUND['w4a16']:.0%} above",
}


def rule_passes(width: str, identical: bool, within_top_k: bool, perplexity_change: float | None) -> bool:
    """RULES[width] on a system's results against the full-precision reference model."""
    if width == "float32":
        return identical
    if width == "bfloat16":
        return within_top_k
    fits = perplexity_change is not None and perplexity_change <= PERPLEXITY_BOUND[width]
    return fits and (within_top_k or width not in TOP_K_WIDTHS)


# cosine similarity below which a stage "diverges": fp32 agrees to ~1e-7; bf16 rounds each layer
THRESHOLDS = {"float32": 0.9999, "bfloat16": 0.99, "float16": 0.995}
DUMP_ENV = "MINISTREAM_DUMP_HIDDEN"
DUMP_FILE = re.compile(r"(forward|logits)-\d+-\d+\.pt")  # what the switch writes, nothing else
# the step budget (tokens) of verify's engine at least: vLLM's own for an offline engine on the CPU
STEP_TOKENS = 4096


# --- the rule for the dtype -----------------------------------------------------------------


@dataclass
class PromptComparison:
    prompt: int
    identical: bool
    first_difference: int | None  # index of the first differing new token
    within_top_k: bool  # the first difference passes the top-k rule (True when identical)
    # over the common prefix, the chosen tokens' logprob differences; inf where a step of it lacks the chosen
    # token's logprob on a side (not compared, so nothing is vouched for), nan where there was nothing to compare
    # (no common prefix, or neither side gave logprobs)
    max_logprob_diff: float
    compared: int = 0  # new tokens held to the rule: the common prefix, and the first difference if any
    detail: str = ""


def compare(
    a: list[dict], b: list[dict], exact: bool, names=("reference", "vllm")
) -> tuple[bool, list[PromptComparison]]:
    """a, b: per prompt {"ids": [...], "logprobs": [{token: logprob}, ...]}. exact: fp32's rule.

    A pass means the rule was applied to every token named: no prompts, a prompt whose reference side has no
    new token, or (the top-k rule) a compared step without its logprobs on either side fails, saying which."""
    if len(a) != len(b):
        raise MiniStreamError(f"{names[0]} has {len(a)} prompts' outputs, {names[1]} {len(b)}: nothing to pair")
    results = []
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = _int_keys(x), _int_keys(y)
        n = min(len(x["ids"]), len(y["ids"]))
        first = next((t for t in range(n) if x["ids"][t] != y["ids"][t]), None)
        if first is None and len(x["ids"]) != len(y["ids"]):
            first = n
        common = first if first is not None else n
        pairs = [(_logprob(x, t), _logprob(y, t)) for t in range(common)]
        missing = [t for t, (p, q) in enumerate(pairs) if p is None or q is None]
        diffs = [abs(p - q) for p, q in pairs if p is not None and q is not None]
        unseen = common == 0 or not (x["logprobs"] or y["logprobs"])
        worst = math.nan if unseen else math.inf if missing else max(diffs)
        ok, detail = first is None, ""
        if first is not None and first < n:
            tx, ty = x["ids"][first], y["ids"][first]
            in_y = first < len(y["logprobs"]) and tx in y["logprobs"][first]
            in_x = first < len(x["logprobs"]) and ty in x["logprobs"][first]
            ok = in_x and in_y
            detail = (
                f"token {first}: {names[0]} {tx}, {names[1]} {ty}; "
                f"{names[0]}'s in {names[1]}'s top-k: {in_y}, {names[1]}'s in {names[0]}'s: {in_x}"
            )
        elif first is not None:
            detail = f"lengths differ: {len(x['ids'])} vs {len(y['ids'])}"
        if not x["ids"]:
            ok, detail = False, f"{names[0]} has no new token for prompt {i}: nothing was compared"
        elif not exact and missing:  # the top-k rule vouches for every step, so each must carry its logprobs
            side = names[0] if _logprob(x, missing[0]) is None else names[1]
            ok, detail = False, f"token {missing[0]}: {side} has no logprob for its chosen token: not compared"
        compared = common + (first is not None and first < n)
        results.append(PromptComparison(i, first is None and bool(x["ids"]), first, ok, worst, compared, detail))
    passed = bool(results) and all(r.identical if exact else r.within_top_k for r in results)
    return passed, results


def _logprob(r: dict, t: int) -> float | None:
    """The logprob side r gave its own chosen token at step t; None where it gave none."""
    steps = r["logprobs"]
    return steps[t].get(r["ids"][t]) if t < len(steps) else None


def _int_keys(r: dict) -> dict:
    """Token ids as ints again: a JSON round trip turns the logprob dicts' keys into strings."""
    return {**r, "logprobs": [{int(t): lp for t, lp in step.items()} for step in r.get("logprobs") or []]}


# --- golden file ----------------------------------------------------------------------------


def read_prompts(path: Path) -> list[str]:
    """A JSON list of strings, or one prompt per line (blank lines skipped)."""
    text = Path(path).read_text()
    if Path(path).suffix == ".json":
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise MiniStreamError(f"{path}: expected a JSON list of prompt strings")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise MiniStreamError(f"{path}: no prompts in it")
    return prompts


def source_digest(source: Path) -> dict:
    """What the reference model read: a training checkpoint's model.pt (or its sharded checkpoint/ folder's
    files) or a folder's safetensors files."""
    from ..checkpoint.format import is_training_checkpoint, weights_path

    source = Path(source)
    weights, trained = weights_path(source), is_training_checkpoint(source)
    if weights.is_dir():  # a sharded checkpoint: its index and every rank's file
        files = {f"{weights.name}/{f.name}": f for f in sorted(weights.iterdir()) if f.is_file()}
    else:
        files = {f.name: f for f in ([weights] if trained else sorted(source.glob("*.safetensors")))}
    if not files:
        raise MiniStreamError(f"{source}: neither model.pt nor *.safetensors in it")
    digests = {}
    for name, f in files.items():
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        digests[name] = h.hexdigest()
    kind = "training checkpoint" if trained else "converted folder"
    return {"path": str(source), "kind": kind, "sha256": digests}


def builtin_prompts(model: Path, max_tokens: int) -> tuple[list[str], dict]:
    """verify's own prompt set: DEFAULT_PROMPTS, then the prompts that reach far into the model's context
    (its max_position_embeddings, max_tokens generated after each); and the golden file's record of the
    latter: {"positions", "new_tokens", "prompts": [{"index", "label", "tokens", "shares_prefix_with" (an
    index), "shared_tokens"}]}."""
    from .generate import DEFAULT_PROMPTS, folder_tokenizer

    positions = open_folder(model).config.get("max_position_embeddings")
    if not isinstance(positions, int):
        raise MiniStreamError(
            f"{model}/config.json: max_position_embeddings is {positions!r}, not a number of positions; "
            "convert again, or give --prompts"
        )
    rows = context_prompts(folder_tokenizer(Path(model).resolve() / "tokenizer.json"), positions, max_tokens)
    index = {r["label"]: len(DEFAULT_PROMPTS) + i for i, r in enumerate(rows)}
    record = [
        {"index": index[r["label"]], "label": r["label"], "tokens": r["tokens"]}
        | (
            {"shares_prefix_with": index[r["shares_prefix_with"]], "shared_tokens": r["shared_tokens"]}
            if r["shares_prefix_with"]
            else {}
        )
        for r in rows
    ]
    context = {"positions": positions, "new_tokens": max_tokens, "prompts": record}
    return DEFAULT_PROMPTS + [r["prompt"] for r in rows], context


def make_golden(
    model: Path,
    source: Path,
    prompts: list[str],
    dtype: str,
    max_tokens: int = 32,
    top_k: int = 5,
    context: dict | None = None,
) -> dict:
    """context: builtin_prompts' record of the prompts far from position 0, kept in the golden file."""
    from .generate import tokenize

    ids = tokenize(model, prompts)
    alone = {c["index"] for c in (context or {}).get("prompts", [])}
    outputs = reference_outputs(source, ids, dtype, max_tokens, top_k, alone)
    return {
        "golden_version": GOLDEN_VERSION,
        "format_version": FORMAT_VERSION,
        "created_by": f"ministream {__version__}",
        "dtype": dtype,
        "max_tokens": max_tokens,
        "top_k": top_k,
        "prompts": prompts,
        "prompt_ids": ids,
        "reference": source_digest(source),
        "outputs": outputs,
    } | ({"context": context} if context else {})


def make_golden_apart(*args) -> dict:
    """make_golden(*args) in a child process that exits before vLLM starts: the reference model's memory (its
    weights' pages, a block cast to the dtype, torch's caches) is the system's again when the engine loads."""
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this one's memory is shared
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as child:
        return child.submit(make_golden, *args).result()


def reference_outputs(
    source: Path, prompt_ids: list[list[int]], dtype: str, max_tokens: int, top_k: int, alone=()
) -> list[dict]:
    """The reference model's greedy tokens and top-k logprobs per prompt: the prompts in one batch, but those
    whose index is in `alone` each by itself (a long prompt, which the batch would pad the others to)."""
    from .generate import load_reference

    reference = load_reference(source, dtype, stream=True)  # never a float32 copy of all the weights
    batch = [i for i in range(len(prompt_ids)) if i not in alone]
    outputs: list[dict] = [{} for _ in prompt_ids]
    for group in ([batch] if batch else []) + [[i] for i in sorted(alone)]:
        for i, out in zip(group, reference.generate([prompt_ids[i] for i in group], max_tokens, logprobs=top_k)):
            outputs[i] = out
    return outputs


def read_golden(path: Path) -> dict:
    golden = json.loads(Path(path).read_text())
    if golden.get("golden_version") != GOLDEN_VERSION:
        raise MiniStreamError(
            f"{path}: golden_version {golden.get('golden_version')!r}, this ministream reads "
            f"{GOLDEN_VERSION}; write it again (drop --golden)"
        )
    return golden


# --- vLLM, with the debug switch on ---------------------------------------------------------


def vllm_outputs(
    model: Path, golden: dict, dump_dir: Path, settings: EngineSettings, chunks: Chunks | None = None
) -> tuple[list[dict], float | None]:
    """The installed vLLM on the golden prompt ids, every prompt's prefill dumped into dump_dir: run as
    `settings` say, in the golden file's dtype, with what the dump needs; and its perplexity of `chunks`
    (held-out text) where given, on the same engine (None where not)."""
    from .generate import vllm_engine, vllm_generate
    from .vllm_perplexity import vllm_perplexity

    if dump_dir.is_dir():  # the last run's dumps go; anything else there is not ours to delete
        if foreign := [p.name for p in dump_dir.iterdir() if not DUMP_FILE.fullmatch(p.name)]:
            raise MiniStreamError(
                f"{dump_dir} holds files verify did not write ({', '.join(sorted(foreign)[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}): choose another --out"
            )
        shutil.rmtree(dump_dir)
    dump_dir.mkdir(parents=True)
    os.environ[DUMP_ENV] = str(dump_dir.resolve())  # inherited by vLLM's engine process
    ids = golden["prompt_ids"]
    try:
        # eager: the switch is Python code in forward(); no prefix caching: each prompt prefills from 0; the
        # context the longest prompt needs; a step budget that takes every prompt whole in the first step, so
        # that the dumped pass holds each prompt's layers (a prompt split across steps is dumped in part)
        llm = vllm_engine(
            model,
            replace(
                settings,
                dtype=golden["dtype"],
                max_model_len=max(
                    max(map(len, ids)) + golden["max_tokens"],
                    OFFLINE_MAX_MODEL_LEN,
                    len(chunks.ids[0]) + 1 if chunks else 0,
                ),
                enforce_eager=True,
            ),
            enable_prefix_caching=False,
            max_num_batched_tokens=max(sum(map(len, ids)), STEP_TOKENS),
        )
        outputs = vllm_generate(llm, ids, golden["max_tokens"], golden["top_k"])
        # after the prompts: the dumps are matched to prompts by their token ids (dumped_states)
        return outputs, vllm_perplexity(llm, chunks) if chunks else None
    finally:
        os.environ.pop(DUMP_ENV, None)


# --- layer by layer -------------------------------------------------------------------------


def reference_states(source: Path, dtype: str, prompt_ids: list[list[int]]) -> list[dict]:
    """Per prompt: "hidden" = [embeddings, block 0 output, ...] (T, H) and "logits" (V,) of the last token."""
    from .generate import load_reference

    model = load_reference(source, dtype, stream=True)
    states = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            hidden: list[torch.Tensor] = []
            logits = model(x, hidden_states=hidden)
            states.append(
                {
                    "hidden": [model.embed(x)[0].float()] + [h[0].float() for h in hidden],
                    "logits": logits[0, -1].float(),
                }
            )
    return states


def dumped_states(dump_dir: Path, prompt_ids: list[list[int]]) -> list[dict | None]:
    """The same per prompt from vLLM's dumps: each dumped forward pass holds one or more prompts' prefills
    back to back (positions restart at 0); the logits dumped after it hold one row per prompt, in order."""
    found: dict[tuple[int, ...], dict] = {}
    for path in sorted(glob.glob(str(dump_dir / "forward-*.pt")), key=_dump_order):
        fwd = torch.load(path, weights_only=True)
        logits_path = Path(path.replace("forward-", "logits-"))
        logits = torch.load(logits_path, weights_only=True)["logits"] if logits_path.exists() else None
        pos, tokens = fwd["positions"].long(), fwd["input_ids"].long()
        starts = (pos == 0).nonzero().flatten().tolist()
        ends = starts[1:] + [len(pos)]
        for j, (s, e) in enumerate(zip(starts, ends)):
            found.setdefault(
                tuple(tokens[s:e].tolist()),
                {
                    "hidden": [h[s:e] for h in fwd["hidden"]],
                    "logits": logits[j] if logits is not None and len(logits) == len(starts) else None,
                },
            )
    return [found.get(tuple(ids)) for ids in prompt_ids]


def _dump_order(path: str) -> tuple[int, int]:
    m = re.search(r"-(\d+)-(\d+)\.pt$", path)
    assert m is not None, path  # the dump hook (ministream_debug.py) names them forward-PID-N.pt
    return int(m[1]), int(m[2])


@dataclass
class Stage:
    name: str  # "embeddings", "layer i", "logits"
    cosine: float  # the smallest over all tokens of all prompts
    max_abs_diff: float


def layer_table(want: list[dict], got: list[dict | None]) -> list[Stage]:
    pairs = [(w, g) for w, g in zip(want, got) if g is not None]
    if not pairs:
        return []
    n = len(pairs[0][0]["hidden"])
    stages = []
    for i in range(n):
        name = "embeddings" if i == 0 else f"layer {i - 1}"
        stages.append(_stage(name, [(w["hidden"][i], g["hidden"][i]) for w, g in pairs if i < len(g["hidden"])]))
    logit_pairs = [
        (w["logits"][None], g["logits"][None, : w["logits"].shape[0]]) for w, g in pairs if g["logits"] is not None
    ]
    if logit_pairs:
        stages.append(_stage("logits", logit_pairs))
    return stages


def _stage(name: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Stage:
    cos, diff = 1.0, 0.0
    for a, b in pairs:
        if a.shape != b.shape:
            return Stage(name, float("nan"), float("inf"))
        a, b = a.double(), b.double()
        norms = a.norm(dim=-1) * b.norm(dim=-1)
        c = torch.where(norms > 0, (a * b).sum(-1) / norms.clamp(min=1e-300), (a == b).all(-1).double())
        cos, diff = min(cos, float(c.min())), max(diff, float((a - b).abs().max()))
    return Stage(name, cos, diff)


def first_divergence(stages: list[Stage], threshold: float) -> Stage | None:
    return next((s for s in stages if not s.cosine >= threshold), None)


HINTS = {
    "embeddings": f"{EMBED} differs, or the prompt ids do",
    "layer 0": "the first block: its weights, or a setting every layer uses (rms_norm_eps, rope_theta, "
    "head_dim and the attention scale, the q/k/v or gate/up order)",
    "layer": "that block's weights (the layers before it agree)",
    "logits": f"the final norm ({FINAL_NORM}, rms_norm_eps) or the output head ({HEAD}, "
    "tie_word_embeddings): every layer agrees",
}


def hint(stage: Stage) -> str:
    return HINTS.get(stage.name) or HINTS["layer"]


# --- the folder against the training checkpoint ---------------------------------------------


def folder_findings(model: Path, raw: Path) -> list[str]:
    """Each setting in config.json and each tensor in the safetensors files that is not what converting
    the training checkpoint gives, in one line with what it looks like (scaled, swapped, zeros)."""
    from ..checkpoint.format import load
    from ..spec import hf_config, raw_to_hf

    cfg, ckpt = load(raw)
    folder = open_folder(model)
    want = hf_config(cfg, "float32")
    expected = dict(raw_to_hf(cfg, ckpt.state))
    return (
        config_findings(folder.config, want, cfg.rope_theta)
        + name_findings(folder, expected, want["tie_word_embeddings"])
        + value_findings(folder, expected, cfg)
    )


def config_findings(have: dict, want: dict, rope_theta: float) -> list[str]:
    """config.json against the config converting the checkpoint writes, key by key."""
    from ..spec import CONFIG_MAP

    findings = []
    for field, key in CONFIG_MAP.items():
        if not _same(have.get(key), want[key]):
            findings.append(
                f"config.json {key}={have.get(key)!r}, but the training checkpoint has "
                f"{field}={want[key]!r}: set {key} to {want[key]!r} (or convert again)"
            )
    rope = (have.get("rope_parameters") or {}).get("rope_theta")
    if "rope_parameters" in have and not _same(rope, rope_theta):
        findings.append(
            f"config.json rope_parameters.rope_theta={rope!r}, but the training checkpoint has "
            f"rope_theta={rope_theta!r}: set it to {rope_theta!r} (vLLM reads rope_parameters)"
        )
    return findings


def name_findings(folder: Folder, expected: dict, tied: bool) -> list[str]:
    missing, unexpected = name_differences(folder.tensors, expected)
    findings = []
    for name in unexpected:
        zeros = " and all zeros" if folder.all_zero(name) else ""
        why = (
            " the checkpoint ties the head to the embeddings" if name == HEAD else " the checkpoint has no such tensor"
        )
        findings.append(f"{name} is in the folder{zeros}, but{why}: convert again (tie_word_embeddings={tied})")
    return findings + [f"{name} is missing from the folder: convert again" for name in missing]


def value_findings(folder: Folder, expected: dict, cfg) -> list[str]:
    """Each tensor both have, compared in the folder's dtype: shape, then values."""
    findings = []
    for name in sorted(set(expected) & set(folder.tensors), key=natural):
        stored = folder.load(name)
        got, exp = stored.float(), expected[name].to(stored.dtype).float()
        if got.shape != exp.shape:
            findings.append(f"{name} has shape {tuple(got.shape)}, the checkpoint gives {tuple(exp.shape)}")
        elif not torch.allclose(got, exp, rtol=1e-5, atol=1e-8):
            findings.append(f"{name} {_looks_like(name, got, exp, expected, stored.dtype, cfg)}")
    return findings


def _looks_like(name, got, exp, expected, dtype, cfg) -> str:
    if not got.any():
        return "is all zeros: the weights were never copied; convert again"
    layer = name.rsplit(".", 2)[0].rsplit(".", 1)[0] + "."  # model.layers.{i}. (or model.)
    for other, t in expected.items():
        if (
            other != name
            and other.startswith(layer)
            and t.shape == got.shape
            and torch.allclose(got, t.to(dtype).float(), rtol=1e-5, atol=1e-8)
        ):
            return f"holds the checkpoint's {other.rsplit('.', 2)[-2]} values: the two are swapped; convert again"
    r = float((got * exp).sum() / (exp * exp).sum().clamp(min=1e-30))
    if torch.allclose(got, r * exp, rtol=1e-2, atol=1e-6 * float(exp.abs().max())):
        why = ""
        queries = {hf_names(QKV, i)[0] for i in range(cfg.n_layers)}
        if name in queries and abs(r * r - cfg.head_dim / cfg.d_model) < 1e-3:
            why = " = sqrt(head_dim / d_model): attention scaled by 1/sqrt(d_model), not 1/sqrt(head_dim)"
        return f"is the checkpoint's values x {r:.4g}{why}; convert again"
    return f"differs from the checkpoint's values (max |diff| {float((got - exp).abs().max()):.3g}); convert again"


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return a == b
    return math.isclose(a, b, rel_tol=1e-9)


# --- the command ----------------------------------------------------------------------------


def verify(
    model: Path,
    raw: Path | None,
    settings: EngineSettings,
    prompts: list[str],
    out: Path,
    max_tokens: int = 32,
    top_k: int = 5,
    golden_path: Path | None = None,
    threshold: float | None = None,
    log=print,
    context: dict | None = None,
) -> bool:
    """Golden file, vLLM's outputs, the rule for the dtype; on failure the layer-by-layer diagnosis. True: pass.
    settings: the engine's, in settings.dtype (the golden file's, where one is read); context: builtin_prompts'
    record of the prompts far from position 0."""
    model, out = Path(model), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = settings.dtype or OFFLINE_DTYPE  # the reference model has no "auto"
    scheme = quantized_scheme(model)
    if scheme:
        if raw:
            raise MiniStreamError(
                f"{model} is quantized ({scheme}): verify holds it to the reference model on its own weights, "
                "dequantized, which is what vLLM computes with; drop --raw (verify the converted folder it came "
                "from with --raw)"
            )
        log(f"{model}: quantized {scheme}: the reference model runs on its weights, dequantized")
    record, held_out = quantized_loss(model, scheme) if scheme else (None, None)
    golden = golden_for(model, raw or model, prompts, dtype, max_tokens, top_k, golden_path, out, log, context)
    golden.setdefault("quantization", scheme)
    got, perplexity = run_vllm(model, golden, out, settings, held_out)
    passed = report_comparison(model, golden, got, log)
    if scheme and record and perplexity is not None:
        passed = report_perplexity(scheme, record, perplexity, log) and passed
    findings = folder_findings(model, raw) if raw else []
    if passed and not findings:
        return True
    if passed:  # a difference these prompts do not feel (eps off by 10x, say) is still another model
        log(f"FAIL: {FOLDER_DIFFERS}")
    else:
        report_layers(raw or model, golden, out / "dump", threshold or THRESHOLDS[golden["dtype"]], log)
    report_folder(model, raw, findings, log)
    return False


# verify's verdict where vLLM's tokens agree with the reference's but the folder is not what converting the checkpoint
# gives: the prompts did not feel the difference (untrained weights, a setting off by a little), the model is another
FOLDER_DIFFERS = (
    "vLLM's tokens equal the reference model's on these prompts, but the folder is not what converting the training "
    "checkpoint gives (below): vLLM serves another model than the checkpoint's; convert again"
)


def quantized_scheme(model: Path) -> str | None:
    """The `ministream quantize` scheme of a folder (check_servable has accepted it), None when not quantized."""
    from ..checkpoint.scheme import scheme_name

    config = json.loads((Path(model) / "config.json").read_text())
    return scheme_name(config, Path(model) / "config.json") if "quantization_config" in config else None


def quantized_loss(model: Path, scheme: str) -> tuple[dict, Chunks]:
    """A quantized folder's record of what the rounding cost (`ministream quantize` writes it) and the chunks of
    the held-out text it names, which must be the text it was measured on."""
    from ..checkpoint.perplexity import chunks
    from ..checkpoint.quantize import RECORD, read_record

    record = read_record(model)
    if record is None or "perplexity" not in record:
        raise MiniStreamError(
            f"{model}/{RECORD}: missing; the {scheme} rule holds vLLM's perplexity to the full-precision model's, "
            "which `ministream quantize` records: quantize the converted folder again"
        )
    ppl = record["perplexity"]
    text = Path(ppl["text"])
    held_out = chunks(model, text, ppl["n_ctx"]) if text.is_file() else None
    if held_out is None or held_out.record()["sha256"] != ppl["sha256"]:
        raise MiniStreamError(
            f"{model}/{RECORD}: the held-out text {text} it was measured on is missing or changed since; quantize "
            "again (--text names the text)"
        )
    return record, held_out


def report_perplexity(scheme: str, record: dict, perplexity: float, log) -> bool:
    """vLLM's perplexity on the folder against the reference model's on the source folder, by the scheme's bound."""
    ppl = record["perplexity"]
    change = perplexity / ppl["source"] - 1
    passed = change <= PERPLEXITY_BOUND[scheme]
    log(
        f"perplexity on {ppl['scored']} tokens of {Path(ppl['text']).name}: vLLM on the {scheme} folder "
        f"{perplexity:.4f}, the reference model on the full-precision folder {ppl['source']:.4f} ({change:+.2%}; "
        f"the reference model on the dequantized weights {ppl['quantized']:.4f})"
    )
    log(f"rule for {scheme} ({RULES[scheme]}): {'PASS' if passed else 'FAIL'} on perplexity")
    return passed


def golden_for(
    model: Path,
    source: Path,
    prompts: list[str],
    dtype: str,
    max_tokens: int,
    top_k: int,
    golden_path: Path | None,
    out: Path,
    log,
    context: dict | None = None,
) -> dict:
    """The golden file at golden_path if it exists; else the reference model writes it (default: in out)."""
    if golden_path and golden_path.exists():
        golden = read_golden(golden_path)
        log(f"golden: {golden_path} (read; reference {golden['reference']['kind']} {golden['reference']['path']})")
        return golden
    golden = make_golden_apart(model, source, prompts, dtype, max_tokens, top_k, context)
    golden_path = golden_path or out / f"golden-{dtype}.json"
    golden_path.write_text(json.dumps(golden, indent=1))
    log(f"golden: {golden_path} (reference model on the {golden['reference']['kind']} {source}, {dtype})")
    return golden


def run_vllm(
    model: Path, golden: dict, out: Path, settings: EngineSettings, chunks: Chunks | None = None
) -> tuple[list[dict], float | None]:
    """vLLM's outputs on the golden prompt ids, also written to out/vllm-<dtype>.json; its perplexity of
    `chunks` where given."""
    with vllm_failures(model):
        got, perplexity = vllm_outputs(model, golden, out / "dump", settings, chunks)
    answer = {"model": str(model), "outputs": got} | ({"perplexity": perplexity} if chunks else {})
    (out / f"vllm-{golden['dtype']}.json").write_text(json.dumps(answer, indent=1))
    return got, perplexity


def report_comparison(model: Path, golden: dict, got: list[dict], log) -> bool:
    """One line per prompt, the totals and the rule's verdict; True if the rule passes."""
    from .generate import detokenize

    exact = golden["dtype"] == "float32" and not golden.get("quantization")
    passed, rows = compare(golden["outputs"], got, exact=exact)
    for r, prompt, want, have in zip(rows, prompt_names(golden), golden["outputs"], got):
        if r.identical:
            log(f"  prompt {r.prompt}: identical ({len(want['ids'])} tokens)  {prompt}")
        elif (t := r.first_difference) is None:  # no new token on the reference's side
            log(f"  prompt {r.prompt}: {r.detail}  {prompt}")
        else:
            words = [repr(detokenize(model, s["ids"][t : t + 1])) if t < len(s["ids"]) else "end" for s in (want, have)]
            log(
                f"  prompt {r.prompt}: first divergence at new token {t}: reference {words[0]}, vllm {words[1]}; "
                f"{'within' if r.within_top_k else 'NOT within'} each other's top-{golden['top_k']}  {prompt}"
            )
    same = sum(r.identical for r in rows)
    worst = [r.max_logprob_diff for r in rows if not math.isnan(r.max_logprob_diff)]
    log(
        f"exact match: {same}/{len(rows)} prompts, {sum(r.compared for r in rows)} new tokens compared; "
        f"max |logprob diff| over the common prefixes: {f'{max(worst):.3g}' if worst else 'none given'}"
    )
    for r in rows:
        if r.detail and not r.within_top_k and r.identical:  # the ids agree, the rule could not be applied
            log(f"  prompt {r.prompt}: {r.detail}")
    rule = "identical token ids" if exact else f"first difference within each other's top-{golden['top_k']}"
    what = " ".join(filter(None, [golden["dtype"], golden.get("quantization")]))
    log(f"rule for {what} ({rule}): {'PASS' if passed else 'FAIL'}")
    return passed


def prompt_names(golden: dict) -> list[str]:
    """How the report names each prompt: its text, or for one far from position 0 where it reaches."""
    names = [repr(p) for p in golden["prompts"]]
    context = golden.get("context") or {}
    for c in context.get("prompts", []):
        shares = (
            f"; its first {c['shared_tokens']} those of prompt {c['shares_prefix_with']}"
            if "shared_tokens" in c
            else ""
        )
        names[c["index"]] = (
            f"[{c['label']}: {c['tokens']} prompt tokens + {context['new_tokens']} new of {context['positions']} "
            f"positions{shares}] {golden['prompts'][c['index']][:32]!r}..."
        )
    return names


def report_layers(source: Path, golden: dict, dump_dir: Path, threshold: float, log) -> None:
    """The layer-by-layer table of the prompts' prefill, and the first stage below the threshold."""
    stages = layer_table(
        reference_states(source, golden["dtype"], golden["prompt_ids"]), dumped_states(dump_dir, golden["prompt_ids"])
    )
    if not stages:
        log(f"layer by layer: no dumps in {dump_dir}: is the installed vLLM built from this patch set? (make install)")
        return
    log(f"layer by layer (prefill of {len(golden['prompts'])} prompts; cosine: the smallest over tokens):")
    log(f"  {'stage':<12} {'cosine':>10} {'max|diff|':>10}")
    for s in stages:
        log(f"  {s.name:<12} {s.cosine:>10.6f} {s.max_abs_diff:>10.3g}")
    first = first_divergence(stages, threshold)
    if first:
        log(f"first diverging: {first.name} (cosine {first.cosine:.6f} < {threshold}): look at {hint(first)}")
    else:
        log(
            f"every stage is above cosine {threshold}: the prompts agree; the divergence is in decoding "
            "(the KV cache, positions after the prompt, or sampling)"
        )


def report_folder(model: Path, raw: Path | None, findings: list[str], log) -> None:
    if not raw:
        log("(give RAW=<training checkpoint> to check the folder's config and tensors against it)")
        return
    log(
        f"{model} against the training checkpoint {raw}: "
        + (f"{len(findings)} difference(s)" if findings else "config and tensors as converting it gives")
    )
    for f in findings:
        log(f"  {f}")


def run_verify(
    model: Path,
    raw: Path | None,
    settings: EngineSettings,
    prompts_file: Path | None,
    out: Path | None,
    max_tokens: int = 32,
    top_k: int = 5,
    golden_path: Path | None = None,
    threshold: float | None = None,
) -> int:
    """`ministream verify`: 0 if the rule for the dtype passes, else 1 (after the diagnosis)."""
    # a folder to verify, and its engine's memory, before the reference model runs
    check_servable(model, settings.dtype or OFFLINE_DTYPE, settings.tp)
    prompts, context = (read_prompts(prompts_file), None) if prompts_file else builtin_prompts(model, max_tokens)
    out = out or Path("out/verify") / Path(model).resolve().name
    # verify rewrites its files in `out` run after run (so a full one is fine) and empties out/dump:
    # never where an input lies, nor around one
    check_output(out, force=True, inputs=[model, *([raw] if raw else [])])
    try:
        ok = verify(model, raw, settings, prompts, out, max_tokens, top_k, golden_path, threshold, context=context)
    finally:
        if Path(out).is_dir():
            mark_made(out)  # verify's results: `make clean` may remove them (fork/clean.py)
    sys.stdout.flush()
    return 0 if ok else 1
