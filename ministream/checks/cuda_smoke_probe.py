"""What `cuda-smoke` runs inside its fresh environment, by that environment's Python: nothing of ministream
is there, only the vLLM it installed (or, for the negative control, the stock release first on PYTHONPATH).

    python -P cuda_smoke_probe.py EXPECTED_VERSION FOLDER OUT.json

Each check is recorded, passed or not, with what it saw, and none needs a device: vLLM's own subprocess
inspection of the architecture (VLLM_CACHE_ROOT is a fresh folder, so its model-info cache cannot answer),
the model module imported, the config class for model_type ministream, a converted folder to a ModelConfig.
"sanity" checks concern LLaMA only: they pass on the stock release too, so a negative control that fails
has failed for MiniStream's sake, not for a broken environment.
"""

import dataclasses
import importlib
import importlib.metadata
import json
import os
import sys
import time
import traceback

ARCH, LLAMA = "MiniStreamForCausalLM", "LlamaForCausalLM"
MODULE, LLAMA_MODULE = "vllm.model_executor.models.ministream", "vllm.model_executor.models.llama"
CONFIG, MODEL_TYPE = "MiniStreamConfig", "ministream"
# vLLM's interface predicates, compared between our class and LLaMA's (those a release lacks are left out)
INTERFACES = (
    "is_text_generation_model",
    "is_pooling_model",
    "supports_lora",
    "supports_pp",
    "supports_multimodal",
    "has_inner_state",
    "is_attention_free",
    "is_hybrid",
)

results: dict[str, dict] = {}


def check(name: str, sanity: bool = False):
    """Record fn()'s (ok, detail) under `name`; an exception is a failure with its last line."""

    def run(fn):
        start = time.monotonic()
        try:
            ok, detail = fn()
        except BaseException as e:  # noqa: B036 - a check that dies is a failed check, whatever it raised
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            ok, detail = False, last[:800]
        results[name] = {
            "ok": bool(ok),
            "detail": detail,
            "sanity": sanity,
            "seconds": round(time.monotonic() - start, 1),
        }
        return fn

    return run


def main(expected: str, folder: str, out: str) -> None:
    @check("import")
    def _():
        import vllm

        said = (vllm.__version__, importlib.metadata.version("vllm"))
        ok = said == (expected, expected)
        return ok, f"import vllm -> {vllm.__file__}: vllm.__version__ {said[0]}, distribution {said[1]}"

    @check("registered")
    def _():
        from vllm.model_executor.models import ModelRegistry

        archs = ModelRegistry.get_supported_archs()
        return ARCH in archs and LLAMA in archs, f"{ARCH} {'in' if ARCH in archs else 'not in'} {len(archs)} archs"

    infos: dict[str, dict] = {}

    def inspect(arch: str) -> tuple[bool, str]:
        from vllm.model_executor.models import ModelRegistry

        registered = ModelRegistry.models.get(arch)
        if registered is None:
            return False, f"{arch} is not registered"
        cache = os.path.join(os.environ.get("VLLM_CACHE_ROOT", ""), "modelinfos")
        before = set(os.listdir(cache)) if os.path.isdir(cache) else set()
        info = ModelRegistry._try_inspect_model_cls(arch)
        if info is None:
            return False, f"vLLM's inspection of {arch} failed (its log above says why)"
        after = set(os.listdir(cache)) if os.path.isdir(cache) else set()
        infos[arch] = dataclasses.asdict(info)
        how = type(registered).__name__
        fresh = bool(after - before)
        where = "in vLLM's subprocess (cache was empty)" if fresh else "(no new model-info cache entry)"
        return how == "_LazyRegisteredModel" and fresh, f"{how} inspected {where}"

    check("llama inspected", sanity=True)(lambda: inspect(LLAMA))

    @check("inspection")
    def _():
        ok, detail = inspect(ARCH)
        if not ok or LLAMA not in infos:
            return False, detail
        ours, theirs = ({k: v for k, v in infos[a].items() if k != "architecture"} for a in (ARCH, LLAMA))
        differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        same = "every field equal to LlamaForCausalLM's" if not differ else f"differs from LLaMA's in {differ}"
        flags = ", ".join(k for k in ("is_text_generation_model", "supports_pp") if ours.get(k))
        return not differ, f"{detail}; {len(ours)} fields, {same} (true: {flags})"

    classes: dict[str, type] = {}

    @check("llama module", sanity=True)
    def _():
        classes[LLAMA] = getattr(importlib.import_module(LLAMA_MODULE), LLAMA)
        return True, f"{LLAMA_MODULE}.{LLAMA}"

    @check("module")
    def _():
        mod = importlib.import_module(MODULE)
        classes[ARCH] = getattr(mod, ARCH)
        site = os.path.dirname(os.path.dirname(importlib.import_module("vllm").__file__ or ""))
        inside = (mod.__file__ or "").startswith(site)
        return inside, f"{MODULE} from {mod.__file__}"

    @check("interfaces")
    def _():
        from vllm.model_executor.models import interfaces, interfaces_base

        ours, theirs = classes[ARCH], classes[LLAMA]
        seen, differ = {}, []
        for name in INTERFACES:
            fn = getattr(interfaces, name, None) or getattr(interfaces_base, name, None)
            if fn is None:
                continue
            seen[name] = bool(fn(ours))
            if seen[name] != bool(fn(theirs)):
                differ.append(name)
        for attr in ("packed_modules_mapping", "embedding_modules"):
            if getattr(ours, attr, None) != getattr(theirs, attr, None):
                differ.append(attr)
        true = ", ".join(k for k, v in seen.items() if v)
        return not differ, (f"as LLaMA's: {true}" if not differ else f"differ from LLaMA's: {differ}")

    @check("config")
    def _():
        from vllm.transformers_utils.config import get_config

        config = get_config(folder, trust_remote_code=False)
        ok = type(config).__name__ == CONFIG and config.model_type == MODEL_TYPE
        return ok, f"get_config: model_type {config.model_type} -> {type(config).__module__}.{type(config).__name__}"

    @check("model config")
    def _():
        from vllm.engine.arg_utils import EngineArgs

        mc = EngineArgs(model=folder).create_model_config()
        ok = list(mc.architectures) == [ARCH] and type(mc.hf_config).__name__ == CONFIG
        return ok, (
            f"EngineArgs(model=folder).create_model_config(): architectures {list(mc.architectures)}, "
            f"hf_config {type(mc.hf_config).__name__}, dtype {mc.dtype}, max_model_len {mc.max_model_len}"
        )

    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
