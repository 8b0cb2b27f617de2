"""prompts: prompt sets made from the held-in corpus (ministream/data/corpus.txt).

The serving benchmarks' set (build_prompts): deterministic by seed, of mixed lengths (log-uniform), some
opening with one of a few long shared passages (as system prompts do), each asking its own output length.
Every other passage opens unlike any other, so a prefix cache (vLLM's) can serve the shared passages and
nothing else. bench-serve and serve-bench send it with vLLM's benchmark client, which reads it as its custom
JSONL dataset (write_jsonl).

verify's prompts far from position 0 (context_prompts): passages that end a quarter, two thirds and all the
way into a model's context, and one that shares the longest one's first two thirds, for the bugs that show
only on long sequences (RoPE at large positions, the KV cache's blocks, long attention).
"""

import bisect
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

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
                    "lower prompt_tokens/output_tokens in bench-serve's settings"
                )
            rows.append({"prompt": prompt, "output_tokens": out, "prompt_tokens": n, "group": group})
        sets.append(rows)
    return {"sets": sets, "prefixes": prefixes, "prefix_tokens": [length(p) for p in prefixes]}


# verify's prompts far from position 0: (label, fraction of the context its tokens reach); the end is the whole
# context less the new tokens, so that the last new token takes the last position
CONTEXT_PARTS = (("a quarter", 1 / 4), ("two thirds", 2 / 3))
THE_END = "the end"
SHARING = "the end, sharing a prefix"  # its first SHARED_PART of tokens are the end prompt's, then other text
SHARED_PART = 2 / 3
MIN_ROOM = 16  # tokens a context must leave for a prompt, after the new ones


def context_prompts(tok, positions: int, new_tokens: int, corpus: Path = CORPUS) -> list[dict]:
    """Prompts of real text that reach far into a context of `positions` tokens, `new_tokens` generated after
    each: rows {"label", "prompt", "tokens" (with what tok.encode adds, <|bos|>), "shares_prefix_with" (the
    label of the prompt whose first "shared_tokens" tokens it repeats, or None)}, in the order a quarter, two
    thirds, the end, the end's sharer.

    tok: the folder's tokenizers.Tokenizer. Each passage starts at a paragraph of the corpus (read from its
    start, and round again as often as a long context needs) and ends where its tokens number what it asks,
    at a word's end where the text allows: the same prompts, and the same ids, on every run. The end prompt
    is positions - new_tokens long; the sharer repeats its first two thirds, then goes on with text of its
    own to the same length (a prefix cache serves the shared part twice)."""
    room = positions - new_tokens
    if room < MIN_ROOM:
        raise MiniStreamError(
            f"a context of {positions} positions leaves {room} tokens for a prompt after {new_tokens} new ones: "
            f"ask for fewer new tokens (--max-tokens {max(1, positions - MIN_ROOM)} or less)"
        )
    source = _Passages(tok, Path(corpus).read_text().strip(), 4 * positions)
    end, end_at = source.passage("", 0, room)
    head, _ = source.passage("", 0, round(room * SHARED_PART))
    sharer, at = source.passage(head + "\n\n", source.after(end_at), room)
    texts = {THE_END: end, SHARING: sharer}
    for label, part in reversed(CONTEXT_PARTS):  # two thirds first, then a quarter, each from text of its own
        texts[label], at = source.passage("", source.after(at), min(room, round(positions * part)))
    ids = {label: tok.encode(text).ids for label, text in texts.items()}
    rows: list[dict[str, Any]] = [
        {"label": label, "prompt": texts[label], "tokens": len(ids[label]), "shares_prefix_with": None}
        for label in [label for label, _ in CONTEXT_PARTS] + [THE_END, SHARING]
    ]
    a, b = ids[SHARING], ids[THE_END]
    shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    rows[-1] |= {"shares_prefix_with": THE_END, "shared_tokens": shared}
    return rows


class _Passages:
    """The corpus as one long text (repeated until it holds `tokens` tokens) and its paragraphs' starts."""

    def __init__(self, tok, text: str, tokens: int):
        self.tok, self.text = tok, text
        while len(tok.encode(self.text, add_special_tokens=False).ids) < tokens:
            self.text += "\n\n" + text
        self.offsets = tok.encode(self.text, add_special_tokens=False).offsets
        self.token_starts = [o[0] for o in self.offsets]
        self.paragraphs = [0] + [i + 2 for i in range(len(self.text) - 2) if self.text[i : i + 2] == "\n\n"]

    def after(self, at: int) -> int:
        """Where the first paragraph after the character `at` starts."""
        return self.paragraphs[bisect.bisect_right(self.paragraphs, at)]

    def passage(self, head: str, start: int, n: int) -> tuple[str, int]:
        """head + the text from `start` that encodes to n tokens, ending at a word's end if any such end does,
        else anywhere (the longest under n if no end gives n exactly); and where in the text it ends."""
        first = bisect.bisect_left(self.token_starts, start)
        guess = first + n - len(self.tok.encode(head).ids) - 1  # the last token, if head joins cleanly
        lo = self.offsets[max(first, guess - 8)][0] + 1
        hi = self.offsets[min(len(self.offsets) - 1, max(first, guess + 8))][1]
        exact, under = None, None
        for end in range(hi, lo - 1, -1):
            count = len(self.tok.encode(head + self.text[start:end]).ids)
            if count == n and (end == len(self.text) or self.text[end].isspace()):
                return head + self.text[start:end], end
            if count == n and exact is None:
                exact = end
            if count < n and under is None:
                under = end
        end = exact or under or lo
        return head + self.text[start:end], end


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
