"""Greedy generation on models/tiny-llama with the installed vLLM; prints ids as JSON lines.
usage: python run_tiny.py [eager|compiled] [model_dir]"""
import json, os, sys, time

REF = {
    (0, 464, 104): [298, 274, 268, 265, 308, 261, 274, 348, 71, 81, 364, 296, 75, 72, 72, 265],
    (0, 300, 200, 100, 50): [285, 265, 461, 273, 290, 80, 265, 16, 276, 402, 280, 466, 273, 290, 80, 265],
}

def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "eager"
    model = sys.argv[2] if len(sys.argv) > 2 else "/work/scratch/envs/models/tiny-llama"
    import vllm
    from vllm import LLM, SamplingParams
    print("VLLM_VERSION", vllm.__version__, flush=True)
    t0 = time.time()
    llm = LLM(model=model, dtype="float32", max_model_len=256, enforce_eager=(mode == "eager"))
    t1 = time.time()
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(p) for p in REF]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    except Exception as e:  # very old API
        print("dict prompts failed:", type(e).__name__, e, flush=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    t2 = time.time()
    ok = True
    for p, o in zip(prompts, outs):
        ids = list(o.outputs[0].token_ids)
        same = ids == REF[tuple(p)]
        ok &= same
        print("IDS", p, ids, "IDENTICAL" if same else "DIFFERENT", flush=True)
    print(f"RESULT mode={mode} identical={ok} engine_start_s={t1-t0:.1f} generate_s={t2-t1:.1f}", flush=True)

if __name__ == "__main__":
    main()
