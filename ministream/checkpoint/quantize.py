"""Quantize a converted folder's linear weights into compressed-tensors' format, the one vLLM reads on CPU and
GPU (`quantization_config` in config.json, quant_method compressed-tensors): round to nearest, no calibration.

    w8a8    int8 weights, one scale per output row; vLLM quantizes the activations to int8 per token at run time
    w4a16   int4 weights, one scale per group of 128 inputs (symmetric); activations stay in the model's dtype
    fp8     float8 (e4m3) weights, one scale per output row; activations to fp8 per token at run time (the
            preset FP8_DYNAMIC, llm-compressor's usual recipe for GPUs). vLLM 0.32's CPU build runs it too,
            through torch's scaled matmul (ChannelWiseTorchFP8ScaledMMLinearKernel), in float32 or bfloat16

The scheme, the packing and the config are the compressed-tensors library's own (its presets W8A8 and W4A16 and
its compressors), so what vLLM unpacks is what the library packed. Each projection keeps its own scales, under
its own name (q_proj, k_proj, v_proj, gate_proj, up_proj): vLLM fuses them by the model's
packed_modules_mapping. The embedding and the norms stay as they are; so does the head (`ignore`: lm_head)
unless `--head quantized`: then the head is quantized by the same scheme as a weight of its own, `lm_head.*`
(untied: the embedding stays float for the lookup, which reads one row a token, while the head is read whole
every step: 24.6 MB instead of 49 in bfloat16 for the reference shape's 32000 x 768), and the config's group
targets it. vLLM reads that from the release with PR #37291 (compressed-tensors gives a ParallelLMHead its
linear scheme; 0.32.0 has it); an older vLLM would load the int8 values as float weights, so the folder check
refuses it there.
`weights.FolderTensors` gives back the weights vLLM computes with, for the reference model to be held to.
"""

import json
import math
import shutil
import struct
from pathlib import Path

import torch

from .. import MiniStreamError, spec
from ..atomic import check_output, check_space, disk_full, new_folder
from ..spec import TrainConfig, hf_shapes, train_config_from_hf
from . import fingerprint, gptq, hf_files
from .cast import check_cast
from .convert import llama_twin
from .folder import checked
from .format import read_json
from .scheme import (
    CODE_DTYPES,
    EMBED,
    HEAD,
    HEAD_SCHEMES,
    HEADS,
    LINEAR,
    WEIGHT_FILES,
    check_scheme,
    check_shapes,
    needs_16_bits,
    quantization_config,
    scheme_of,
    stored,
)
from .weights import FolderTensors, safetensors_files

METHODS = ("rtn", "gptq")  # round to nearest (no data), or GPTQ on a calibration text (gptq.py)
RECORD = "ministream-quantize.json"  # beside config.json: the scheme, the source, what the rounding cost


def compress(weight: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """One linear weight [out, in] quantized: the tensors that replace `weight` (local names: weight or
    weight_packed, weight_scale, weight_shape), in float32 scales."""
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme, compressor = scheme_of(name)
    args, w = scheme.weights, weight.float()
    if args.group_size:
        view = w.view(w.shape[0], -1, args.group_size)
        low, high = view.amin(-1), view.amax(-1)
    else:
        low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale, zero = calculate_qparams(low, high, args)
    out = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
    return {k: v.contiguous() for k, v in out.items() if v is not None}


NONFINITE_FIX = "convert an earlier checkpoint, then quantize its folder"  # a NaN or Inf weight: the source's


def held(stem: str, weight: torch.Tensor, parts: dict[str, torch.Tensor], scheme: str) -> dict[str, torch.Tensor]:
    """The folder's tensors that stand for the weight `stem`.weight (local name -> tensor; "": `stem` itself, kept as
    it is), by their full names, each float one's values checked finite (cast.check_cast): a NaN or Inf weight
    makes NaN scales."""
    named = {f"{stem}.{k}" if k else stem: v for k, v in parts.items()}
    source = stem if "" in parts else f"{stem}.weight"
    for name, v in named.items():
        if v.is_floating_point():
            check_cast(name, weight, v.float(), scheme, "keep the folder unquantized", NONFINITE_FIX, source)
    return named


def loss_record(src: Path, out: Path, scheme: str, max_len: int, text: Path | None = None) -> dict:
    """What the rounding cost, measured on the reference model: its perplexity on held-out text with the
    source's weights and with the quantized folder's, dequantized (checkpoint/perplexity.py). verify holds
    vLLM's perplexity on the folder to the source's by the scheme's rule."""
    from .perplexity import chunks, folder_perplexity

    c = chunks(src, text, max_len=max_len)
    source, quantized = folder_perplexity(src, c), folder_perplexity(out, c)
    return {
        "scheme": scheme,
        "source": str(src.resolve()),
        "perplexity": c.record() | {"source": source, "quantized": quantized},
    }


def calibrate(src: Path, tmp: Path, cfg: TrainConfig, scheme: str, python, text, samples, log) -> tuple[dict, dict]:
    """GPTQ's tensors for each linear weight, by stem, as stored() names and shapes them, and what the
    calibration was. The library's scratch folders (inside the output's temporary folder) are removed."""
    from safetensors.torch import load_file

    twin, made = llama_twin(src, tmp / ".gptq-in"), tmp / ".gptq-out"
    seq_len = min(gptq.SEQ_LEN, cfg.max_seq_len)
    try:
        how = gptq.run(python, twin, made, scheme, text, samples or gptq.SAMPLES, seq_len, log)
        produced = load_file(made / "model.safetensors")
    finally:
        for scratch in (twin, made, made.with_suffix(".json"), made.with_suffix(".log"), gptq.offload_folder(made)):
            shutil.rmtree(scratch, ignore_errors=True) if scratch.is_dir() else scratch.unlink(missing_ok=True)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in hf_shapes(cfg).items():
        if LINEAR.match(name):
            stem = name.removesuffix(".weight")
            parts[stem] = {}
            for local, (want, code) in stored(tuple(shape), scheme).items():
                got = produced.get(f"{stem}.{local}")
                if got is not None and got.is_floating_point() and CODE_DTYPES[code] == "float32":
                    got = got.float()  # a bfloat16 model's scales, in the float32 quantize stores (exact)
                if got is None or tuple(got.shape) != want or got.dtype != getattr(torch, CODE_DTYPES[code]):
                    found = "nothing" if got is None else f"{list(got.shape)} {got.dtype}"
                    raise MiniStreamError(
                        f"GPTQ's output has {found} for {stem}.{local}, not {list(want)} {code}: llm-compressor "
                        f"{gptq.LLMCOMPRESSOR} wrote another layout; nothing was written"
                    )
                parts[stem][local] = got.contiguous()
    return how, parts


TORCH_CODES = {
    "int8": "I8",
    "int32": "I32",
    "int64": "I64",
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float8_e4m3fn": "F8_E4M3",
}  # torch dtype name -> safetensors code: what the streaming writer plans and checks


def write_groups(path: Path, groups: list[tuple[str, dict]], make) -> None:
    """Stream tensors into one safetensors file: the header planned from `groups` (stem -> {name: (shape,
    code)}), then group i's tensors made by make(i), each checked against its plan, written and dropped, so
    memory holds one weight's tensors at a time, never the model (safetensors' save_file takes them all)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, planned in groups:
        for name, (shape, code) in planned.items():
            size = math.prod(shape) * SIZES[code]
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for i, (stem, planned) in enumerate(groups):
            made = make(i)
            if set(made) != set(planned):
                raise MiniStreamError(f"quantize made {sorted(made)} for {stem}, planned {sorted(planned)}: a bug")
            for name, (shape, code) in planned.items():
                t = made.pop(name)
                got = (tuple(t.shape), TORCH_CODES.get(str(t.dtype).removeprefix("torch.")))
                if got != (tuple(shape), code):
                    raise MiniStreamError(f"quantize made {name} as {got}, planned {(shape, code)}: a bug")
                if t.numel():
                    f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


SIZES = {"I8": 1, "F8_E4M3": 1, "BF16": 2, "F16": 2, "I32": 4, "F32": 4, "I64": 8}


def read_record(folder: Path) -> dict | None:
    """A quantized folder's loss record (None: quantized elsewhere, or before the record existed)."""
    path = Path(folder) / RECORD
    return read_json(path) if path.is_file() else None


def quantize(
    src: str | Path,
    out: str | Path,
    scheme: str,
    force: bool = False,
    log=print,
    text: Path | None = None,
    method: str = "rtn",
    calibration: Path | None = None,
    samples: int | None = None,
    head: str = "float",
) -> Path:
    """Write `out`: the converted folder `src` with its linear weights quantized by `scheme`, round to nearest
    or (method "gptq") calibrated by GPTQ on `calibration` (gptq.py), and with `head` "quantized" its head too
    (round to nearest, untied); every other file copied as it is. `src` is never written; `out` appears whole
    or not at all (atomic.new_folder)."""
    src, out = Path(src), Path(out)
    check_scheme(scheme)  # the name first: the cheapest refusal
    if method not in METHODS:
        raise MiniStreamError(f"--method {method}: choose one of {', '.join(METHODS)}")
    if head not in HEADS:
        raise MiniStreamError(f"--head {head}: choose one of {', '.join(HEADS)}")
    quantize_head = head == "quantized"
    if quantize_head and scheme not in HEAD_SCHEMES:
        raise MiniStreamError(
            f"--head quantized --scheme {scheme}: a quantized head was run here for {', '.join(HEAD_SCHEMES)} "
            f"only (vLLM's {scheme} kernels on a GPU read attributes a ParallelLMHead lacks, vLLM PR #52543); "
            "leave the head float (--head float)"
        )
    if method == "gptq":
        gptq.check(scheme)
        if calibration is not None and not Path(calibration).is_file():
            raise MiniStreamError(f"--calibration-text {calibration}: no such file")
    if not (src / "config.json").is_file():
        raise MiniStreamError(
            f"{src}: no config.json; quantize takes a converted folder: `ministream convert CHECKPOINT DIR` first"
        )
    config = read_json(src / "config.json")
    if "quantization_config" in config:
        method = (
            config["quantization_config"].get("quant_method", "?")
            if isinstance(config["quantization_config"], dict)
            else "?"
        )
        raise MiniStreamError(
            f"{src}/config.json: the folder is quantized already ({method}); quantize the converted folder it came "
            "from (rounding twice loses more)"
        )
    check_output(out, force, [src])  # before compressed-tensors' imports and the check's reads
    checked(src)  # the one folder check: a folder the server would refuse is not quantized either
    cfg = train_config_from_hf(config, str(src / "config.json"))
    check_shapes(cfg, scheme, str(src / "config.json"))
    files = safetensors_files(src)
    shapes = hf_shapes(cfg)
    tensors = FolderTensors(src, cfg, config)  # read one tensor at a time, never mapped: weights.py
    what = f"quantizing {src} to {out}"
    check_space(out.parent if out.parent.exists() else Path("."), sum(f.stat().st_size for f in files), what)
    python = gptq.environment(log) if method == "gptq" else None  # made once, before anything is written
    try:
        with new_folder(out, force, inputs=[src]) as tmp:
            calibrated = calibrate(src, tmp, cfg, scheme, python, calibration, samples, log) if python else None
            # one weight at a time: planned from shapes, then each computed, written and dropped (issue 56)
            stems = [(name, name.removesuffix(".weight") if LINEAR.match(name) else name) for name in hf_shapes(cfg)]
            if quantize_head:  # the head's own weight, or the embedding it is tied to: rounded to nearest
                stems = [(n, s) for n, s in stems if n != HEAD] + [(EMBED if cfg.tie_embeddings else HEAD, "lm_head")]

            def plan(name: str, stem: str) -> dict[str, tuple[tuple[int, ...], str]]:
                if stem != name:
                    return {f"{stem}.{k}": v for k, v in stored(tuple(shapes[name]), scheme).items()}
                return {name: (tuple(shapes[name]), tensors.code(name))}

            def parts(name: str, stem: str) -> dict[str, torch.Tensor]:
                t = tensors[name]
                if stem == name:  # a tensor kept as it is (a tied head has no tensor of its own: not in hf_shapes)
                    return held(name, t, {"": t.contiguous()}, scheme)
                got = calibrated[1][stem] if calibrated and stem != "lm_head" else compress(t, scheme)
                return held(stem, t, got, scheme)

            write_groups(tmp / "model.safetensors", [(s, plan(n, s)) for n, s in stems], lambda i: parts(*stems[i]))
            for f in sorted(src.iterdir()):
                # not the weights, config.json, nor the tools' own dotfiles (the made-by record, locks)
                if f.is_file() and f.name != "config.json" and not WEIGHT_FILES.match(f.name) and f.name[0] != ".":
                    shutil.copy2(f, tmp / f.name)
            hf_files.write(tmp)  # this version's transformers files, whatever version wrote the source's
            written = {**config, "auto_map": dict(spec.HF_AUTO_MAP)}  # in place when the source has one
            written["quantization_config"] = quantization_config(scheme, quantize_head)
            if quantize_head:
                written["tie_word_embeddings"] = False  # the head is a tensor of its own now
            if needs_16_bits(scheme) and config.get("dtype", config.get("torch_dtype")) == "float32":
                # what vLLM's "auto" runs the folder in: a dtype its int4 kernels take
                written.update({k: "bfloat16" for k in ("dtype", "torch_dtype") if k in config})
            (tmp / "config.json").write_text(json.dumps(written, indent=2) + "\n")
            record = loss_record(src, tmp, scheme, cfg.max_seq_len, text)
            record["method"] = {"method": method, **({"calibration": calibrated[0]} if calibrated else {})}
            record["head"] = head
            (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
            fingerprint.record(tmp, log)  # on the dequantized weights; replaces the source's, copied above
    except OSError as e:
        raise disk_full(e, out, f"while {what}") or e from None
    size = (out / "model.safetensors").stat().st_size
    log(
        f"quantize: wrote {out} ({scheme}: {sum(1 for n in hf_shapes(cfg) if LINEAR.match(n))} linear weights"
        f"{' and the head' if quantize_head else ''}, "
        f"{size / 2**20:.1f} MiB from {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB)"
    )
    ppl = record["perplexity"]
    log(
        f"quantize: the reference model's perplexity on {ppl['scored']} tokens of {Path(ppl['text']).name}: "
        f"{ppl['source']:.4f} -> {ppl['quantized']:.4f} ({ppl['quantized'] / ppl['source'] - 1:+.2%}); "
        f"`ministream verify {out}` holds vLLM to the {scheme} rule (docs/quantize.md)"
    )
    return out
