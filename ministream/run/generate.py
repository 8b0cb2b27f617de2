"""Generate with the reference model and with the installed (patched) vLLM, from the same token ids.

Both engines get identical prompt token ids (tokenized once with the folder's tokenizer.json),
so any difference in the outputs is the models', never the tokenizers'.
"""

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from .. import MiniStreamError
from ..spec import TORCH_DTYPES
from . import engine
from .folder import check_servable

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


def load_reference(source: Path, dtype: str, stream: bool = False):
    """The reference model from a training checkpoint folder, or from a converted HF folder. stream: its weights
    kept as stored (model.pt's mmap'd), each block's cast to `dtype` only while it runs (MiniStream.from_state)."""
    from ..checkpoint.format import is_training_checkpoint
    from ..checkpoint.reference import MiniStream
    from ..checkpoint.weights import read_folder

    source = Path(source)
    if (source / "config.json").is_file() and not is_training_checkpoint(source):  # a sharded one has config.json
        cfg, state = read_folder(source, stream=stream)  # streamed: each linear weight read as its layer runs
        return MiniStream.from_state(cfg, state, TORCH_DTYPES[dtype], stream)
    return MiniStream.from_checkpoint(source, TORCH_DTYPES[dtype], stream=stream)


def reference_generate(
    source: Path,
    prompt_ids: list[list[int]],
    max_tokens: int,
    dtype: str = "float32",
    logprobs: int = 0,
    stop_ids=(),
    batch: bool = True,
) -> list[dict]:
    """batch=False serves one request at a time, as the team's original inference script did."""
    model = load_reference(source, dtype)
    if batch:
        return model.generate(prompt_ids, max_tokens, stop_ids=stop_ids, logprobs=logprobs)
    return [model.generate([p], max_tokens, stop_ids=stop_ids, logprobs=logprobs)[0] for p in prompt_ids]


def vllm_engine(model: Path, settings: engine.EngineSettings, **overrides):
    """The installed vLLM's offline engine on a converted folder, run as `settings` say, on this machine's
    defaults (engine.py); overrides: LLM(...)'s arguments for a caller's reason."""
    engine.use_defaults(settings.tp, settings.pp)
    try:
        from vllm import LLM
    except ImportError:
        raise MiniStreamError("vllm is not installed in this environment: run `make install` first") from None
    return LLM(**engine.llm_kwargs(model, settings, **overrides))


def vllm_generate(
    llm,
    prompt_ids: list[list[int]],
    max_tokens: int,
    logprobs: int = 0,
    ignore_eos: bool = True,
    adapters: list[Path | None] | None = None,
) -> list[dict]:
    """adapters: per prompt, the PEFT adapter folder to serve it with (None: the base model), all in one batch;
    the engine needs enable_lora=True and max_loras at least the number of distinct folders."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs or None, ignore_eos=ignore_eos)
    lora = lora_requests(adapters) if adapters is not None else None
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False, lora_request=lora)
    results = []
    for o in outputs:
        c = o.outputs[0]
        lps = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in (c.logprobs or [])]
        results.append({"ids": list(c.token_ids), "logprobs": lps})
    return results


def lora_requests(adapters: list[Path | None]) -> list:
    """vLLM's LoRARequest per prompt, None for the base model; each adapter folder gets its own id (1, 2, ...)
    and its path as its name (vLLM tells adapters apart by name)."""
    from vllm.lora.request import LoRARequest

    paths = [str(Path(a).resolve()) if a else None for a in adapters]
    ids = {p: i + 1 for i, p in enumerate(dict.fromkeys(p for p in paths if p))}
    return [LoRARequest(p, ids[p], p) if p else None for p in paths]


def generate(
    model: Path,
    settings: engine.EngineSettings,
    raw: Path | None = None,
    engines: str = "both",
    prompts: list[str] | None = None,
    max_tokens: int = 32,
    logprobs: int = 0,
    stop_at_eos: bool = False,
    json_path: Path | None = None,
) -> dict:
    """`ministream generate`: the same prompt ids through the reference model and/or vLLM, printed side by
    side; engines is "both", "reference" or "vllm". Both run in settings.dtype."""
    dtype = settings.dtype or engine.OFFLINE_DTYPE  # the reference model has no "auto"
    # before the reference model loads or vLLM starts (a minute); its memory only where vLLM runs
    config = check_servable(model, dtype, settings.tp, memory=engines != "reference")
    if engines in ("both", "vllm"):
        engine.check_tp(settings.tp)
    prompts = prompts or DEFAULT_PROMPTS
    ids = tokenize(model, prompts)
    results: dict[str, Any] = {"prompts": prompts, "prompt_ids": ids, "dtype": dtype, "max_tokens": max_tokens}
    if engines in ("both", "reference"):
        eos = config["eos_token_id"]
        t = time.time()
        results["reference"] = reference_generate(
            raw or model, ids, max_tokens, dtype, logprobs, stop_ids=(eos,) if stop_at_eos else ()
        )
        results["reference_seconds"] = time.time() - t
    if engines in ("both", "vllm"):
        with engine.vllm_failures(model):
            t = time.time()
            llm = vllm_engine(model, dataclasses.replace(settings, dtype=dtype))
            results["vllm_start_seconds"] = time.time() - t
            t = time.time()
            results["vllm"] = vllm_generate(llm, ids, max_tokens, logprobs, ignore_eos=not stop_at_eos)
            results["vllm_seconds"] = time.time() - t
    for system in ("reference", "vllm"):
        for r in results.get(system, []):
            r["text"] = detokenize(model, r["ids"])
    print_side_by_side(results)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    return results


def print_side_by_side(results: dict) -> None:
    for i, prompt in enumerate(results["prompts"]):
        print(f"prompt: {prompt!r}")
        for system in ("reference", "vllm"):
            if system in results:
                print(f"  {system:<9}: {results[system][i]['text']!r}")
    if "reference" in results and "vllm" in results:
        same = sum(r["ids"] == v["ids"] for r, v in zip(results["reference"], results["vllm"]))
        print(f"identical token ids: {same}/{len(results['prompts'])} prompts ({results['dtype']})")
