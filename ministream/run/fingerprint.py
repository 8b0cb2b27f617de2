"""Hold a running server to a folder's fingerprint (checkpoint/fingerprint.py): "ready" means it computes this model.

The server gets the fingerprint's prompt as token ids, greedy, NEW_TOKENS new tokens with the top-k logprobs
(vLLM's /v1/completions, tokens as ids), and its tokens are held to the fingerprint's by the rule for the width
it serves (verify.py's RULES, for the short run):

    float32                       identical token ids; a first difference at a near-tie of the reference's
                                  top two (NEAR_TIE) passes, as bench-accuracy counts it (faults.md row 134)
    bfloat16, float16, w8a8, fp8  vLLM's rule: at the first difference each side's token is among the
                                  other's top-k; the continuations after it are not compared
    w4a16                         the same top-k rule. verify holds 4-bit to a perplexity bound instead,
                                  because rounding the weights to 4 bits moves the tokens of the full-
                                  precision model; the fingerprint is computed on the dequantized weights,
                                  what vLLM multiplies by, so what is left is the activations' rounding
                                  (bf16, or int8 on an AMX CPU), as for w8a8. Eight greedy tokens could not
                                  measure a perplexity anyway.

Nothing heavier than urllib and json is imported: `ministream ready`, a probe, runs this every few seconds.
"""

import math
import sys
import time
from pathlib import Path

from .. import MiniStreamError
from ..checkpoint import fingerprint
from ..checkpoint.fingerprint import FILE
from .server import complete, json_headers

NEAR_TIE = 1e-3  # nats between the reference's top two below which float32's order of sums may pick either
EXACT = "identical token ids"
TOP_K_RULE = "first difference within each other's top-k"


def served_width(config: dict, dtype: str | None) -> str:
    """What a server runs the folder in: its quantize scheme, else the engine's --dtype, else config.json's
    dtype (vLLM's "auto")."""
    from ..checkpoint.scheme import scheme_name

    if "quantization_config" in config:
        return scheme_name(config, "config.json")
    if dtype not in (None, "auto"):
        return str(dtype)
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def rule(width: str | None) -> str:
    """The short check's rule for a width (None: not known, the loosest of them)."""
    return EXACT if width == "float32" else TOP_K_RULE


def for_serving(folder: Path) -> dict | None:
    """The fingerprint a server of `folder` is held to, checked before vLLM starts: None where the folder has
    none (serve warns and serves); MiniStreamError where it is another folder's (its weight files differ)."""
    fp = fingerprint.read(folder)
    if fp is not None and (why := fingerprint.stale(folder, fp)):
        raise MiniStreamError(why)
    return fp


def missing_warning(folder: Path) -> str:
    return (
        f'{Path(folder) / FILE} is missing (a folder written before fingerprints): "ready" will mean the server '
        f"answers, not that it computes this folder's model; record one with `ministream fingerprint {folder}`"
    )


def unchecked(folder: Path, fp: dict | None, max_model_len: int | None) -> str | None:
    """Why a server of `folder` cannot be held to its fingerprint `fp` (None: it can): the folder has none (one
    written before fingerprints), or the context asked is shorter than its prompt and new tokens."""
    if fp is None:
        return missing_warning(folder)
    need = len(fp["prompt_ids"]) + len(fp["ids"])
    if max_model_len is not None and max_model_len < need:
        return (
            f'--max-model-len {max_model_len} is shorter than the fingerprint\'s {need} tokens: "ready" will mean '
            "the server answers, not that it computes this folder's model"
        )
    return None


def ask(url: str, name: str, fp: dict, key: str | None, timeout: float) -> dict:
    """The server's greedy tokens and top-k logprobs for the fingerprint's prompt ids: {"ids", "logprobs"};
    MiniStreamError saying what the server answered instead."""
    url = url.rstrip("/")
    what = f"the fingerprint's prompt ({len(fp['prompt_ids'])} token ids) at {url}/v1/completions"
    try:
        status, body = complete(
            url,
            name,
            fp["prompt_ids"],
            len(fp["ids"]),
            timeout=timeout,
            headers=json_headers(key),
            logprobs=fp["top_k"],
            return_tokens_as_token_ids=True,
        )
    except (OSError, ValueError) as e:  # no answer in time, a connection dropped, a body that is not JSON
        raise MiniStreamError(f"{what} failed ({e})") from None
    if status != 200:
        raise MiniStreamError(f"{what} answered HTTP {status}: {str(body)[:200]}")
    try:
        lp = body["choices"][0]["logprobs"]
        ids = [_token_id(t) for t in lp["tokens"]]
        steps = [{_token_id(t): float(v) for t, v in (step or {}).items()} for step in lp["top_logprobs"]]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise MiniStreamError(f"{what} answered without token ids and logprobs: {str(body)[:200]}") from None
    return {"ids": ids, "logprobs": steps}


def _token_id(token: str) -> int:
    """vLLM's token with return_tokens_as_token_ids: "token_id:123"."""
    prefix, _, number = token.partition(":")
    if prefix != "token_id":
        raise ValueError(token)
    return int(number)


def difference(fp: dict, got: dict, width: str | None) -> str | None:
    """Where the server's tokens break the rule for `width` against the fingerprint's (None: they keep it)."""
    want, have = fp["ids"], got["ids"]
    ref = [{int(t): v for t, v in step.items()} for step in fp["logprobs"]]
    srv = got["logprobs"]
    first = next((t for t in range(min(len(want), len(have))) if want[t] != have[t]), None)
    if first is None:
        return None if len(want) == len(have) else f"the server gave {len(have)} new tokens, not {len(want)}"
    a, b = want[first], have[first]
    mine, theirs = ref[first], srv[first] if first < len(srv) else {}
    if width == "float32":
        if b in mine and mine[a] - mine[b] < NEAR_TIE:  # two choices the float32 sums may order either way
            return None
        why = f"not the folder's (rule for float32: {EXACT})"
    elif a in theirs and b in mine:
        return None
    else:
        k = fp["top_k"]
        why = (
            f"the folder's token {'is' if a in theirs else 'is not'} in the server's top-{k}, the server's "
            f"{'is' if b in mine else 'is not'} in the folder's (rule for {width or 'any width'}: {TOP_K_RULE})"
        )
    return f"new token {first} of the fingerprint's prompt: the folder's model gives id {a}, the server id {b}; {why}"


def check_server(url: str, name: str, folder: Path, fp: dict, width: str | None, key=None, timeout=30.0) -> str | None:
    """None when the server at `url` serving `name` computes `folder`'s model by the rule for `width`; else one
    line saying it does not and what differed (the first differing token, or what the server answered)."""
    try:
        got = ask(url, name, fp, key, timeout)
    except MiniStreamError as e:
        return f"the served model {name!r} is not shown to compute {folder}'s: {e}"
    why = difference(fp, got, width)
    if why is None:
        return None
    return f"the served model {name!r} is not {folder}'s: {why}"


def refresh(folder: Path, log=print) -> int:
    """`ministream fingerprint FOLDER`: record the fingerprint of a folder the folder check accepts, written
    whole or not at all."""
    from ..atomic import write_json
    from .folder import check_servable

    folder = Path(folder)
    check_servable(folder, memory=False)  # what serve would refuse has no fingerprint to record (memory: no engine)
    started = time.monotonic()
    fp = fingerprint.compute(folder)
    if not all(math.isfinite(v) for step in fp["logprobs"] for v in step.values()):
        raise MiniStreamError(
            f"{folder}: the reference model's logprobs are not finite (NaN or Inf weights): no fingerprint to "
            "record; convert an earlier checkpoint"
        )
    write_json(folder / FILE, fp)
    log(
        f"fingerprint: wrote {folder / FILE} ({len(fp['prompt_ids'])} prompt tokens, {len(fp['ids'])} new, top-"
        f"{fp['top_k']}, the reference model in float32{' on the dequantized weights' if fp['quantized'] else ''}; "
        f"{time.monotonic() - started:.2f} s)"
    )
    sys.stdout.flush()
    return 0


def finding(folder: Path):
    """doctor's line on the folder's fingerprint: ok, missing (warn: serve serves, unchecked) or another folder's
    (error: serve refuses it)."""
    from .folder import Finding

    fix = f"ministream fingerprint {folder}"
    try:
        fp = fingerprint.read(folder)
        why = fingerprint.stale(folder, fp) if fp is not None else None
    except MiniStreamError as e:
        return Finding("error", "fingerprint", str(e).split(": record it")[0], fix)
    if fp is None:
        return Finding("warn", "fingerprint", missing_warning(folder).split("; record one")[0], fix)
    if why:
        return Finding("error", "fingerprint", why.split("; if these")[0], f"if these are the weights you mean, {fix}")
    return Finding(
        "ok",
        "fingerprint",
        f"recorded for these weights ({len(fp['ids'])} tokens of the reference model): serve says ready only when "
        "vLLM computes them",
    )
