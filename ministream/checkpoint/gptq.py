"""Calibrated 4-bit weights: GPTQ by llm-compressor (`quantize --scheme w4a16 --method gptq`).

llm-compressor pins its own transformers and compressed-tensors (0.14.0.1: transformers <= 5.17,
compressed-tensors 0.19), which are not vLLM's (0.32: compressed-tensors 0.17). So it runs in an environment of
its own, made once under build/llmcompressor/ with the torch this one has, and is handed the LLaMA-named twin of
the converted folder (the same safetensors, an architecture transformers knows). GPTQ chooses each group's int4
values column by column against the calibration set's activations. The calibration set is windows of a text of
the model's own kind: the training corpus by default. What it stores is the W4A16 layout round-to-nearest writes
(int4 packed into int32, one scale per 128 inputs, no group index: actorder "static" keeps the columns in place),
so quantize keeps its own tensors' names and shapes and config.json's quantization_config, which vLLM reads
with its compressed-tensors release. Layer by layer: the worker loads the model to disk (a scratch folder beside
its output) and llm-compressor's sequential pipeline brings one layer at a time into memory, so its peak does not
grow with the model's size; the quantized bytes are those of the model held whole.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from .. import MiniStreamError
from ..cpuinfo import BF16, CPUINFO, has_any
from ..paths import BUILD, CORPUS

LLMCOMPRESSOR = "0.14.0.1"
ENV = BUILD / "llmcompressor" / LLMCOMPRESSOR
PRESETS = {"w4a16": "W4A16"}  # --scheme -> the preset GPTQ quantizes to (the same as round-to-nearest's)
SAMPLES, SEQ_LEN = 128, 512  # calibration windows: llm-compressor's examples use 512 of 2048 tokens
WORKER = Path(__file__).with_name("gptq_worker.py")
TIMEOUT = 4 * 3600


def check(scheme: str) -> None:
    if scheme not in PRESETS:
        raise MiniStreamError(
            f"--method gptq calibrates {', '.join(PRESETS)} only; --scheme {scheme} is round to nearest (drop --method)"
        )


def environment(log=print) -> Path:
    """The python of llm-compressor's environment, made once (a folder without its `.ready` mark is made
    again: an install that was cut off)."""
    python = ENV / "venv" / "bin" / "python"
    if (ENV / ".ready").is_file() and python.is_file():
        return python
    import torch

    shutil.rmtree(ENV, ignore_errors=True)
    ENV.mkdir(parents=True)
    log(f"quantize: making llm-compressor {LLMCOMPRESSOR}'s environment in {ENV} (once; a few minutes)")
    torch_pin = f"torch=={torch.__version__}"
    install = [str(python), "-m", "pip", "install", "-q", torch_pin, f"llmcompressor=={LLMCOMPRESSOR}"]
    done = _step([sys.executable, "-m", "venv", str(ENV / "venv")])
    if done.returncode == 0:
        done = _step(install)
    if done.returncode != 0 and "+cpu" in torch.__version__:  # as scripts/setup.sh: then PyTorch's CPU index
        done = _step([*install, "--extra-index-url", "https://download.pytorch.org/whl/cpu"])
    if done.returncode != 0:
        shutil.rmtree(ENV, ignore_errors=True)
        raise MiniStreamError(
            f"making llm-compressor's environment failed ({' '.join(done.args[:6])} ...: exit {done.returncode}: "
            f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}); check the network to PyPI and run again, "
            "or quantize without --method gptq (round to nearest)"
        )
    (ENV / ".ready").write_text(json.dumps({"llmcompressor": LLMCOMPRESSOR, "torch": torch_pin}) + "\n")
    return python


def load_dtype(folder: Path, cpuinfo: Path = CPUINFO, available: int | None = None) -> str:
    """The dtype GPTQ's worker loads the folder's model in: its own ("auto") where the CPU multiplies bfloat16
    natively (AVX512-BF16, AMX) or where a float32 copy would not fit beside the calibration; float32 elsewhere, as
    it always loaded: on a CPU without them torch's bfloat16 products run at a fraction of float32's (bench-kernels:
    0.6 GB/s at batch 32 on an AVX2 EPYC), so the folder's dtype costs time there, and is taken for memory only."""
    import psutil

    config = json.loads((folder / "config.json").read_text())
    own = config.get("dtype") or config.get("torch_dtype") or "float32"
    if own == "float32" or has_any(BF16, cpuinfo):
        return "auto"
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    free = psutil.virtual_memory().available if available is None else available
    return "float32" if 2 * weights * 1.5 + 2**30 < free else "auto"  # float32: twice a 16-bit folder's bytes


def offload_folder(out: Path) -> Path:
    """Where the worker puts the model it calibrates a layer at a time: beside `out`, removed with it."""
    return out.with_suffix(".offload")


def _step(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


def run(
    python: Path, twin: Path, out: Path, scheme: str, text: Path | None, samples: int, seq_len: int, log=print
) -> dict:
    """GPTQ of the folder `twin` (transformers can load it) into `out` (llm-compressor's compressed folder);
    what the calibration was (windows, tokens, seconds). Its log is out.log beside `out`."""
    text = Path(text or CORPUS)
    spec = {
        "model": str(twin.resolve()),
        "out": str(out.resolve()),
        "text": str(text.resolve()),
        "samples": samples,
        "seq_len": seq_len,
        "scheme": PRESETS[scheme],
        "dtype": load_dtype(twin),
        "offload": str(offload_folder(out).resolve()),  # layer by layer (gptq_worker.py)
    }
    spec_file, log_file = out.with_suffix(".json"), out.with_suffix(".log")
    spec_file.write_text(json.dumps(spec))
    log(f"quantize: GPTQ by llm-compressor {LLMCOMPRESSOR} on {text.name}, up to {samples} windows of {seq_len} tokens")
    with open(log_file, "w") as f:
        try:
            done = subprocess.run(
                [str(python), str(WORKER), str(spec_file)], stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT
            )
        except subprocess.TimeoutExpired:
            raise MiniStreamError(f"GPTQ ran past {TIMEOUT} s (log {log_file}): nothing was written") from None
    result = out / "gptq.json"
    if done.returncode != 0 or not result.is_file():
        tail = log_file.read_text(errors="replace").strip().splitlines()[-3:]
        raise MiniStreamError(f"GPTQ failed (exit {done.returncode}): {' | '.join(tail)}; nothing was written")
    how = {"library": f"llmcompressor {LLMCOMPRESSOR}", **json.loads(result.read_text()), "text": str(text)}
    log(f"quantize: GPTQ calibrated on {how['samples']} windows ({how['text_tokens']} tokens in the text)")
    return how
