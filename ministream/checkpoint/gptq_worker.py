"""GPTQ by llm-compressor, run by gptq.py in llm-compressor's own environment (its pins are not vLLM's):

    python gptq_worker.py SPEC.json

SPEC: model (a folder transformers loads: the LLaMA-named twin of a converted folder), out, text, samples,
seq_len, scheme (a compressed-tensors preset). The calibration set is the text's tokens cut into `samples`
windows of `seq_len`, consecutive from the start. Imports only the standard library at module level: the
package's fresh-import test runs it where llm-compressor is absent.
"""

import json
import sys
import time
from pathlib import Path


def main(spec_file: str) -> int:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_file).read_text())
    ids = Tokenizer.from_file(str(Path(spec["model"]) / "tokenizer.json")).encode(Path(spec["text"]).read_text()).ids
    seq = spec["seq_len"]
    windows = [ids[i : i + seq] for i in range(0, len(ids) - seq + 1, seq)][: spec["samples"]]
    if not windows:
        print(f"error: {spec['text']} has {len(ids)} tokens, fewer than one window of {seq}", file=sys.stderr)
        return 2
    data = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * seq for _ in windows]})
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    t = time.perf_counter()
    recipe = GPTQModifier(targets="Linear", scheme=spec["scheme"], ignore=["lm_head"])
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=seq, num_calibration_samples=len(windows))
    model.save_pretrained(spec["out"], save_compressed=True)
    done = {"samples": len(windows), "seq_len": seq, "text_tokens": len(ids), "seconds": time.perf_counter() - t}
    (Path(spec["out"]) / "gptq.json").write_text(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
