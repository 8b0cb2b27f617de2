"""Generate with the reference model and with the installed (patched) vLLM, from the same token ids.

Both engines get identical prompt token ids (tokenized once with the folder's tokenizer.json),
so any difference in the outputs is the models', never the tokenizers'.
"""

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

from .. import MiniStreamError
from ..spec import DTYPES, TORCH_DTYPES

DEFAULT_PROMPTS = [
    "The river runs through",
    "Once upon a time",
    "The baker wakes up",
    "A compiler reads a program",
    "The first train leaves the station",
    "In the garden the",
    "Q: What does a language model predict?",
    "The library is quiet in the",
    "One, two, three,",
    "In the spring the snow",
]


@functools.lru_cache(maxsize=8)
def folder_tokenizer(path: Path):
    """The folder's tokenizer.json, parsed once per file (detokenize runs once per sequence)."""
    from tokenizers import Tokenizer

    if not path.is_file():
        raise MiniStreamError(f"{path}: no such file; convert the checkpoint first (make convert)")
    return Tokenizer.from_file(str(path))


def tokenize(folder: Path, prompts: list[str]) -> list[list[int]]:
    tok = folder_tokenizer(Path(folder).resolve() / "tokenizer.json")
    return [tok.encode(p).ids for p in prompts]


def detokenize(folder: Path, ids: list[int]) -> str:
    return folder_tokenizer(Path(folder).resolve() / "tokenizer.json").decode(ids)


def load_reference(source: Path, dtype: str):
    """The reference model from a training checkpoint folder, or from a converted HF folder."""
    from ..checkpoint.convert import read_folder
    from ..checkpoint.reference import MiniStream

    source = Path(source)
    if (source / "config.json").is_file() and not (source / "model.pt").is_file():
        cfg, state = read_folder(source)
        model = MiniStream(cfg)
        model.load_state_dict(state, strict=True, assign=True)
        return model.to(TORCH_DTYPES[dtype]).eval()
    return MiniStream.from_checkpoint(source, TORCH_DTYPES[dtype])


def reference_generate(source: Path, prompt_ids: list[list[int]], max_tokens: int, dtype: str = "float32",
                       logprobs: int = 0, stop_ids=(), batch: bool = True) -> list[dict]:
    """batch=False serves one request at a time, as the team's original inference script did."""
    model = load_reference(source, dtype)
    if batch:
        return model.generate(prompt_ids, max_tokens, stop_ids=stop_ids, logprobs=logprobs)
    return [model.generate([p], max_tokens, stop_ids=stop_ids, logprobs=logprobs)[0] for p in prompt_ids]


def vllm_env(tp: int = 1, kv_cache_gib: int = 1) -> dict:
    """CPU defaults for vLLM where the user set none: the model gets every core (vLLM keeps one for its
    front end otherwise, about half the speed on 2 cores), one core per rank under tensor parallelism,
    and a KV cache of a fixed size (GiB) instead of a fraction of system memory."""
    if torch.cuda.is_available():
        return {}
    cores = os.sched_getaffinity(0)
    ordered = sorted(cores)
    if tp > 1:
        per = max(1, len(ordered) // tp)
        bind = "|".join(f"{ordered[r * per]}-{ordered[r * per + per - 1]}" if per > 1 else str(ordered[r])
                        for r in range(tp))
    else:
        bind = f"{ordered[0]}-{ordered[-1]}" if len(ordered) > 1 else str(ordered[0])
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


def vllm_engine(model: Path, dtype: str = "float32", tp: int = 1, max_model_len: int | None = None, **kwargs):
    for k, v in vllm_env(tp).items():
        os.environ.setdefault(k, v)
    try:
        from vllm import LLM
    except ImportError:
        raise MiniStreamError("vllm is not installed in this environment: run `make install` first") from None
    config = json.loads((Path(model) / "config.json").read_text())
    max_len = min(config.get("max_position_embeddings", 2048), max_model_len or 2048)
    return LLM(model=str(model), dtype=dtype, tensor_parallel_size=tp, max_model_len=max_len,
               seed=0, enforce_eager=kwargs.pop("enforce_eager", not torch.cuda.is_available()), **kwargs)


def vllm_generate(llm, prompt_ids: list[list[int]], max_tokens: int, logprobs: int = 0,
                  ignore_eos: bool = True) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs or None,
                            ignore_eos=ignore_eos)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    results = []
    for o in outputs:
        c = o.outputs[0]
        lps = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in (c.logprobs or [])]
        results.append({"ids": list(c.token_ids), "logprobs": lps})
    return results


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="greedy text from the reference model and the installed vLLM",
                       description=__doc__)
    p.add_argument("model", type=Path, help="converted HF-style folder")
    p.add_argument("--raw", type=Path, help="training checkpoint folder for the reference model "
                   "(default: the reference model reads the converted folder)")
    p.add_argument("--engine", default="both", choices=["both", "reference", "vllm"])
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: a built-in set)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size")
    p.add_argument("--logprobs", type=int, default=0, help="also record the top-k logprobs of each new token")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at the eos token (default: exactly --max-tokens)")
    p.add_argument("--json", type=Path, help="write token ids, logprobs, texts and timings here")
    p.set_defaults(func=_main)


def _main(a) -> int:
    prompts = a.prompt or DEFAULT_PROMPTS
    ids = tokenize(a.model, prompts)
    eos = json.loads((a.model / "config.json").read_text())["eos_token_id"]
    results = {"prompts": prompts, "prompt_ids": ids, "dtype": a.dtype, "max_tokens": a.max_tokens}
    if a.engine in ("both", "reference"):
        t = time.time()
        results["reference"] = reference_generate(a.raw or a.model, ids, a.max_tokens, a.dtype, a.logprobs,
                                                  stop_ids=(eos,) if a.stop_at_eos else ())
        results["reference_seconds"] = time.time() - t
    if a.engine in ("both", "vllm"):
        t = time.time()
        llm = vllm_engine(a.model, a.dtype, a.tp)
        results["vllm_start_seconds"] = time.time() - t
        t = time.time()
        results["vllm"] = vllm_generate(llm, ids, a.max_tokens, a.logprobs, ignore_eos=not a.stop_at_eos)
        results["vllm_seconds"] = time.time() - t
    for engine in ("reference", "vllm"):
        for r in results.get(engine, []):
            r["text"] = detokenize(a.model, r["ids"])
    for i, prompt in enumerate(prompts):
        print(f"prompt: {prompt!r}")
        for engine in ("reference", "vllm"):
            if engine in results:
                print(f"  {engine:<9}: {results[engine][i]['text']!r}")
    if "reference" in results and "vllm" in results:
        same = sum(r["ids"] == v["ids"] for r, v in zip(results["reference"], results["vllm"]))
        print(f"identical token ids: {same}/{len(prompts)} prompts ({a.dtype})")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    return 0
