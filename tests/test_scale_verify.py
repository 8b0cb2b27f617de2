"""verify at any size a machine can serve: the reference model streams its stored weights (each layer's cast to
the compute dtype only while it runs) and makes the golden file in a process of its own, gone before vLLM starts;
the outputs, and so the golden file, are those of a model cast whole up front."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ministream.checkpoint.format import TrainConfig, load_checkpoint, save_checkpoint
from ministream.checkpoint.reference import MiniStream
from ministream.run.generate import DEFAULT_PROMPTS, tokenize
from ministream.run.verify import golden_for, make_golden

PROMPTS = [[5, 17, 42, 7], [9, 3], [11, 12, 13, 14, 15, 16]]


def stored_as(raw: Path, dtype: torch.dtype, out: Path) -> Path:
    """A copy of the training checkpoint `raw` with its weights stored in `dtype`."""
    ckpt = load_checkpoint(raw)
    out.mkdir()
    state = {k: v.to(dtype) for k, v in ckpt.state.items()}
    torch.save({"model": state, "config": json.loads(json.dumps(ckpt.config))}, out / "model.pt")
    return out


# quick: the GQA model with an untied head, bfloat16 weights in float32 (verify --raw's default on a bf16 checkpoint)
QUICK = {("tiny_gqa", "bfloat16", "float32")}
CASES = [
    pytest.param(model, stored, compute, marks=() if (model, stored, compute) in QUICK else pytest.mark.full)
    for model in ("tiny", "tiny_gqa")  # tied MHA; GQA with an untied head, head_dim != d/h
    for stored, compute in [("float32", "float32"), ("bfloat16", "float32"), ("float32", "bfloat16")]
]


@pytest.mark.parametrize("model, stored, compute", CASES)
def test_a_streamed_reference_gives_the_ids_and_logprobs_of_one_cast_whole_bit_for_bit(
    model, stored, compute, request, tmp_path
):
    raw = request.getfixturevalue(model)
    if stored != "float32":
        raw = stored_as(raw, getattr(torch, stored), tmp_path / "raw")
    cast = MiniStream.from_checkpoint(raw, getattr(torch, compute))
    streamed = MiniStream.from_checkpoint(raw, getattr(torch, compute), stream=True)
    assert {p.dtype for p in streamed.parameters()} == {getattr(torch, stored)}  # kept as stored: no copy made
    assert streamed.generate(PROMPTS, 8, logprobs=5) == cast.generate(PROMPTS, 8, logprobs=5)


@pytest.mark.full  # verify's quick CLI test makes its golden file the same way
def test_verify_s_golden_file_made_in_its_own_process_has_the_same_bytes(tiny, tiny_hf, tmp_path):
    prompts = DEFAULT_PROMPTS[:3]
    path = tmp_path / "golden.json"
    golden_for(tiny_hf, tiny, prompts, "float32", 6, 5, path, tmp_path, log=lambda *_: None)
    here = make_golden(tiny_hf, tiny, prompts, "float32", 6, 5)
    assert path.read_text() == json.dumps(here, indent=1)
    assert here["prompt_ids"] == tokenize(tiny_hf, prompts)


# The reference phase of a float32 verify on bfloat16 weights, in a fresh process: its peak RSS over its RSS after
# the same run on one block of the same shapes (which pages in torch's code and the kernels' and allocator's caches
# for these shapes, ~150-300 MB that do not grow with the model). Kept as stored, it holds the weights' pages (mmap'd,
# touched once), one linear's float32 copy at a time and the KV cache: bounded by 1.25x the stored bytes plus one
# block in float32 (measured: ~310 MB of 404 allowed for 270 MB of weights). A model cast whole up front holds the
# stored pages and a float32 copy of all of them: 3x (807 MB).
MEASURE = """
import json, resource, sys
from pathlib import Path
from ministream.run.verify import reference_outputs

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

reference_outputs(Path(sys.argv[1]), json.loads(sys.argv[3]), "float32", 3, 5)
base = rss()
reference_outputs(Path(sys.argv[2]), json.loads(sys.argv[3]), "float32", 3, 5)
# VmHWM, the peak since exec: ru_maxrss keeps the forking pytest worker's own peak across the exec
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"base": base, "peak": int(hwm.split()[1]) * 1024}))
"""
BOUND = 1.25
BLOCK = 1024 * 3 * 1024 + 1024 * 1024 + 3 * 1024 * 4096  # random_checkpoint's block: Wqkv, out_proj, w12, w3


def random_checkpoint(out: Path, d_model: int = 1024, d_ff: int = 4096, n_layers: int = 8) -> int:
    """A random model.pt of bfloat16 weights, by default 270 MB (a float32 copy would show: +540 MB); their bytes."""
    cfg = TrainConfig(
        vocab_size=512, d_model=d_model, n_layers=n_layers, n_heads=8, d_ff=d_ff, max_seq_len=64,
        norm_eps=1e-5, rope_theta=10000.0, bos_id=0, eos_id=1,
    )  # fmt: skip
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in MiniStream(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    out.mkdir()
    save_checkpoint(out / "model.pt", state, cfg)
    return sum(t.numel() * t.element_size() for t in state.values())


def test_a_float32_reference_on_bfloat16_weights_holds_about_the_stored_weights_not_a_float32_copy(tmp_path):
    random_checkpoint(tmp_path / "small", n_layers=1)
    stored = random_checkpoint(tmp_path / "raw")
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path / "small"), str(tmp_path / "raw"), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        check=True,
    )
    rss = json.loads(run.stdout.splitlines()[-1])
    grew = rss["peak"] - rss["base"]
    assert grew < BOUND * stored + 4 * BLOCK, (
        f"the reference grew by {grew / 1e6:.0f} MB for {stored / 1e6:.0f} MB of weights"
    )
