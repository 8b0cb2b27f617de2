"""GPTQ by llm-compressor, run by gptq.py in llm-compressor's own environment (its pins are not vLLM's):

    python gptq_worker.py SPEC.json

SPEC: model (a folder transformers loads: the LLaMA-named twin of a converted folder), out, text, samples,
seq_len, scheme (a compressed-tensors preset), dtype, offload (a scratch folder). The calibration set is the
text's tokens cut into `samples` windows of `seq_len`, consecutive from the start. The model is loaded to disk
(compressed-tensors' offload, into `offload`), and llm-compressor's sequential pipeline brings one layer at a
time into memory to calibrate and quantize it: the process never holds the model, whatever its size. Imports only
the standard library at module level: the package's fresh-import test runs it where llm-compressor is absent.
"""

import json
import sys
import time
from pathlib import Path


def peak() -> int:
    """This process's peak resident memory so far, in bytes (VmHWM)."""
    return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024


def main(spec_file: str) -> int:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    imported = peak()
    spec = json.loads(Path(spec_file).read_text())
    ids = Tokenizer.from_file(str(Path(spec["model"]) / "tokenizer.json")).encode(Path(spec["text"]).read_text()).ids
    seq = spec["seq_len"]
    windows = [ids[i : i + seq] for i in range(0, len(ids) - seq + 1, seq)][: spec["samples"]]
    if not windows:
        print(f"error: {spec['text']} has {len(ids)} tokens, fewer than one window of {seq}", file=sys.stderr)
        return 2
    data = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * seq for _ in windows]})
    # float32, or the folder's own ("auto") where float32 would not fit or the CPU multiplies bfloat16 natively
    # (gptq.load_dtype); GPTQ's own arithmetic, the Hessians and the rounding, is float32 whatever it is
    load = dict(dtype=spec.get("dtype", "float32"))
    if spec.get("offload"):  # every tensor to disk: no memory is given to the model itself
        from compressed_tensors.offload import load_offloaded_model

        load |= dict(device_map="auto_offload", max_memory={"cpu": 1}, offload_folder=spec["offload"])
        with load_offloaded_model():
            model = AutoModelForCausalLM.from_pretrained(spec["model"], **load)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec["model"], **load)
    loaded = peak()
    t = time.perf_counter()
    recipe = GPTQModifier(targets="Linear", scheme=spec["scheme"], ignore=["lm_head"])
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=seq, num_calibration_samples=len(windows))
    calibrated = peak()
    model.save_pretrained(spec["out"], save_compressed=True)
    done = {"samples": len(windows), "seq_len": seq, "text_tokens": len(ids), "seconds": time.perf_counter() - t}
    # the peak resident memory after the imports, with the model loaded, calibrated, and at the end (bytes)
    done |= {"dtype": str(model.dtype).removeprefix("torch."), "offload": "disk" if spec.get("offload") else None}
    done |= {"peak_rss_imported": imported, "peak_rss_loaded": loaded, "peak_rss_calibrated": calibrated}
    done |= {"peak_rss": peak()}
    (Path(spec["out"]) / "gptq.json").write_text(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
