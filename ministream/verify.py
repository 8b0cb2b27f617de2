"""Compare generations of two engines by the rule for the dtype.

fp32: token ids identical. bf16/fp16: vLLM's own rule (tests/models/utils.py check_logprobs_close):
the sequences may part at one token, provided at that first difference each side's token is among
the other side's top-k logprobs; after it the continuations are not compared.
"""

from dataclasses import dataclass


@dataclass
class PromptComparison:
    prompt: int
    identical: bool
    first_difference: int | None  # index of the first differing new token
    within_top_k: bool  # the first difference passes the top-k rule (True when identical)
    max_logprob_diff: float  # over the common prefix, the chosen tokens' logprob differences
    detail: str = ""


def compare(a: list[dict], b: list[dict], exact: bool, names=("reference", "vllm")) -> tuple[bool, list[PromptComparison]]:
    """a, b: per prompt {"ids": [...], "logprobs": [{token: logprob}, ...]}. exact: fp32's rule."""
    results = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        x, y = _int_keys(x), _int_keys(y)
        n = min(len(x["ids"]), len(y["ids"]))
        first = next((t for t in range(n) if x["ids"][t] != y["ids"][t]), None)
        if first is None and len(x["ids"]) != len(y["ids"]):
            first = n
        diffs = [abs(x["logprobs"][t][x["ids"][t]] - y["logprobs"][t][y["ids"][t]])
                 for t in range(first if first is not None else n)
                 if x.get("logprobs") and y.get("logprobs") and t < len(x["logprobs"]) and t < len(y["logprobs"])
                 and x["ids"][t] in x["logprobs"][t] and y["ids"][t] in y["logprobs"][t]]
        ok, detail = first is None, ""
        if first is not None and first < n:
            tx, ty = x["ids"][first], y["ids"][first]
            in_y = bool(y.get("logprobs")) and tx in y["logprobs"][first]
            in_x = bool(x.get("logprobs")) and ty in x["logprobs"][first]
            ok = in_x and in_y
            detail = (f"token {first}: {names[0]} {tx}, {names[1]} {ty}; "
                      f"{names[0]}'s in {names[1]}'s top-k: {in_y}, {names[1]}'s in {names[0]}'s: {in_x}")
        elif first is not None:
            detail = f"lengths differ: {len(x['ids'])} vs {len(y['ids'])}"
        results.append(PromptComparison(i, first is None, first, ok, max(diffs, default=0.0), detail))
    passed = all(r.identical for r in results) if exact else all(r.within_top_k for r in results)
    return passed, results


def _int_keys(r: dict) -> dict:
    """Token ids as ints again: a JSON round trip turns the logprob dicts' keys into strings."""
    return {**r, "logprobs": [{int(t): lp for t, lp in step.items()} for step in r.get("logprobs") or []]}
