"""prompts: the serving benchmarks' prompt set, made from the held-in corpus (ministream/data/corpus.txt).

Deterministic by seed, of mixed lengths (log-uniform), some opening with one of a few long shared passages
(as system prompts do), each asking its own output length. Every other passage opens unlike any other, so a
prefix cache (vLLM's) can serve the shared passages and nothing else. bench-serve and serve-bench send it
with vLLM's benchmark client, which reads it as its custom JSONL dataset (write_jsonl).
"""

import json
import math
import random
import statistics
from pathlib import Path

from .. import MiniStreamError
from ..atomic import write_text
from ..paths import CORPUS

# Shared passages fill at least one block of vLLM's KV cache (128 tokens on the CPU), the unit its prefix cache
# reuses; no two passages open with the same BLOCK tokens (the smallest block vLLM uses, on GPUs).
BLOCK = 16
PROMPT_TOKENS = (16, 256)  # a prompt's length, <|bos|> and a shared passage included, in tokens
PREFIX_TOKENS = (160, 200)  # a shared passage's


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi], as many short ones as long ones per doubling."""
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def build_prompts(
    tok,
    counts: list[int],
    seed: int,
    prompt_tokens=PROMPT_TOKENS,
    output_tokens=(16, 128),
    prefix_groups: int = 4,
    prefix_tokens=PREFIX_TOKENS,
    shared_fraction: float = 0.5,
    max_model_len: int = 2048,
    corpus: Path = CORPUS,
) -> dict:
    """Prompts from the corpus, one list of rows per entry of `counts`; deterministic for a seed.

    tok: the folder's tokenizers.Tokenizer (its encode adds <|bos|>, as vLLM's endpoint does). A row is
    {"prompt", "output_tokens", "prompt_tokens" (with <|bos|>), "group" (its shared passage, or None)}.
    Unshared prompts are corpus passages of log-uniform length in prompt_tokens; a shared_fraction of rows
    open with one of prefix_groups passages (prefix_tokens long), then a passage of their own. No two
    passages (shared ones included) open with the same BLOCK tokens, so a prefix cache serves the shared
    passages and nothing else. Output lengths are log-uniform in output_tokens."""
    text = Path(corpus).read_text()
    offsets = tok.encode(text, add_special_tokens=False).offsets
    longest = max(prompt_tokens[1], prefix_tokens[1])
    # a passage starts at a token that begins a word (byte-level BPE: the token holds the space before it)
    starts = [i for i in range(len(offsets) - longest) if i == 0 or text[offsets[i][0]].isspace()]
    needed = sum(counts) + prefix_groups
    if needed > len(starts):
        raise MiniStreamError(
            f"{needed} prompts asked, but {corpus} has {len(starts)} places to start one: "
            "ask for fewer (--num-prompts, --rates)"
        )
    rng = random.Random(seed)
    free, opened = starts[:], set()
    rng.shuffle(free)

    def passage(n: int) -> str:
        """n tokens of the corpus from a fresh start (its leading space stripped), opening unlike any before."""
        while free:
            s = free.pop()
            found = text[offsets[s][0] : offsets[s + n - 1][1]].strip()
            first = tuple(tok.encode(found, add_special_tokens=False).ids[:BLOCK])
            if first not in opened:
                opened.add(first)
                return found
        raise MiniStreamError(
            f"{corpus} has no more passages that open unlike the {len(opened)} taken: "
            "ask for fewer prompts (--num-prompts, --rates)"
        )

    def length(prompt: str) -> int:
        return len(tok.encode(prompt).ids)

    prefixes = [passage(rng.randint(*prefix_tokens)) for _ in range(prefix_groups)]
    sets = []
    for count in counts:
        rows = []
        for _ in range(count):
            out = _log_uniform(rng, *output_tokens)
            group = rng.randrange(prefix_groups) if prefix_groups and rng.random() < shared_fraction else None
            if group is None:
                prompt = passage(_log_uniform(rng, *prompt_tokens) - 1)  # - 1: <|bos|>
            else:
                room = max(prompt_tokens[0], prompt_tokens[1] - length(prefixes[group]))
                prompt = prefixes[group] + "\n\n" + passage(_log_uniform(rng, prompt_tokens[0], room))
            n = length(prompt)
            if n + out > max_model_len:
                raise MiniStreamError(
                    f"a prompt of {n} tokens + {out} new ones exceeds the model's {max_model_len}: "
                    "lower prompt_tokens/output_tokens in benchserve's settings"
                )
            rows.append({"prompt": prompt, "output_tokens": out, "prompt_tokens": n, "group": group})
        sets.append(rows)
    return {"sets": sets, "prefixes": prefixes, "prefix_tokens": [length(p) for p in prefixes]}


def _spread(xs: list[int]) -> dict:
    return (
        {
            "min": min(xs),
            "median": statistics.median(xs),
            "mean": statistics.fmean(xs),
            "max": max(xs),
            "total": sum(xs),
        }
        if xs
        else {}
    )


def dataset_stats(rows: list[dict]) -> dict:
    groups = [r["group"] for r in rows if r["group"] is not None]
    return {
        "requests": len(rows),
        "prompt_tokens": _spread([r["prompt_tokens"] for r in rows]),
        "output_tokens": _spread([r["output_tokens"] for r in rows]),
        "shared_prefix_requests": len(groups),
        "requests_per_group": {str(g): groups.count(g) for g in sorted(set(groups))},
    }


def write_jsonl(rows: list[dict], path: Path) -> Path:
    """The rows as vLLM's custom dataset reads them: {"prompt", "output_tokens"} per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(
        path, "".join(json.dumps({"prompt": r["prompt"], "output_tokens": r["output_tokens"]}) + "\n" for r in rows)
    )
