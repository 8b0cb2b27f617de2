"""Convert a MiniStream training checkpoint (format 1) into an HF-style folder that the patched vLLM loads.

The folder uses Hugging Face LLaMA's tensor names and config keys under model_type "ministream":
the math is LLaMA's, so every tool that reads LLaMA folders understands the tensors, while the
architecture name keeps the model ours. The tensor table is ministream.spec's, read forwards here to
convert and backwards (read_folder) to restore, so raw -> HF -> raw is provably lossless.
"""

import json
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm import tqdm

from .. import MiniStreamError, __version__
from ..atomic import check_output, check_space, disk_full, new_folder, pause_point
from ..spec import (
    ARCH,
    HEAD,
    TORCH_DTYPES,
    TrainConfig,
    hf_config,
    hf_names,
    raw_to_hf,
    table,
)
from . import fingerprint, hf_files
from .format import CONFIG_KEYS, Checkpoint, checkpoint_inputs, load_checkpoint, resolve_config, stored_dtype
from .tokenizer import tokenizer_config
from .weights import write_safetensors

DEFAULT_SHARD_SIZE = "2GB"


def shards(tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype, max_shard_size: int | str) -> dict:
    """{file name: [(name, tensor)]} as huggingface_hub splits a checkpoint, sized in the output dtype
    (planned on meta tensors: the views of one fused tensor would otherwise count as one shared tensor)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    if isinstance(max_shard_size, str) and max_shard_size.strip().isdigit():
        max_shard_size = int(max_shard_size)  # plain bytes
    try:
        plan = split_torch_state_dict_into_shards(
            {name: torch.empty(t.shape, dtype=dtype, device="meta") for name, t in tensors},
            max_shard_size=max_shard_size,
        )
    except ValueError as e:
        raise MiniStreamError(f"--max-shard-size {max_shard_size}: {e} (e.g. 500MB, 2GB, or bytes)") from None
    by_name = dict(tensors)
    order = {name: i for i, (name, _) in enumerate(tensors)}
    return {
        file: [(n, by_name[n]) for n in sorted(names, key=order.__getitem__)]
        for file, names in plan.filename_to_tensors.items()
    }


def write_folder(
    tmp: Path,
    raw_dir: Path,
    cfg: TrainConfig,
    state: dict,
    dtype: str,
    chat_template: str | None,
    max_shard_size: int | str,
    allow_nonfinite: bool = False,
    release=None,
) -> None:
    tok_config = tokenizer_config(raw_dir / "tokenizer.json", cfg, chat_template)  # before the heavy part
    torch_dtype = TORCH_DTYPES[dtype]
    tensors = list(raw_to_hf(cfg, state))
    total = sum(t.numel() for _, t in tensors) * torch_dtype.itemsize
    files = shards(tensors, torch_dtype, max_shard_size)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="convert", file=sys.stderr, disable=None, mininterval=0.5
    ) as progress:
        for name, part in files.items():
            write_safetensors(tmp / name, part, torch_dtype, progress, allow_nonfinite, release)
            pause_point("convert:weights")
    if len(files) > 1:
        weight_map = {k: name for name, part in files.items() for k, _ in part}
        _write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(tmp / "config.json", hf_config(cfg, dtype, converter=__version__))
    _write_json(tmp / "generation_config.json", {"bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id})
    _write_json(tmp / "tokenizer_config.json", tok_config)
    shutil.copyfile(raw_dir / "tokenizer.json", tmp / "tokenizer.json")
    hf_files.write(tmp)  # MiniStream in transformers, which config.json's auto_map names


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def dry_run(ckpt: Checkpoint, overrides: dict, log=print, ignore_config_keys: Iterable[str] = ()) -> int:
    """Print the mapping table and both key-set differences; write nothing. Exit 0 when all match."""
    try:
        cfg = resolve_config(ckpt, overrides, ignore_config_keys)
        problem = None
    except MiniStreamError as e:
        problem = str(e)
        known = {k: v for k, v in (ckpt.config or {}).items() if k in CONFIG_KEYS}  # the table, despite the rest
        values = {**{k: v for k, v in overrides.items() if v is not None}, **known}
        try:
            cfg = TrainConfig.from_dict(values)
        except MiniStreamError:
            log(f"error: {problem}")
            return 1
    for note in ckpt.notes:
        log(f"note: {note}")
    rows = table(cfg)
    width = max(len(r.raw) for r in rows)
    log(f"{'training checkpoint':<{width}}  {'shape':<14}  HF folder")
    for r in rows:
        shape = list(ckpt.state[r.raw].shape) if r.raw in ckpt.state else "MISSING"
        log(f"{r.raw:<{width}}  {str(shape):<14}  {', '.join(r.hf)}" + (f"  (rows {list(r.split)})" if r.split else ""))
    have, want = set(ckpt.state), {r.raw for r in rows}
    written = {h for r in rows for h in r.hf}
    model_keys = _model_param_names(cfg)
    diffs = [
        ("in the checkpoint, not in the mapping", have - want),
        ("in the mapping, not in the checkpoint", want - have),
        (f"written, not a {ARCH} parameter", written - model_keys),
        (f"{ARCH} parameters not written", model_keys - written),
    ]
    for title, keys in diffs:
        log(f"{title}: {', '.join(sorted(keys)) if keys else 'none'}")
    if problem:
        log(f"error: {problem}")
    return 1 if problem or any(keys for _, keys in diffs) else 0


def _model_param_names(cfg: TrainConfig) -> set[str]:
    """The transformers-side model's own parameter names (tied lm_head excluded), built on the meta device."""
    from .hf import MiniStreamForCausalLM, config_from_train

    with torch.device("meta"):
        model = MiniStreamForCausalLM(config_from_train(cfg))
    names = set(model.state_dict())
    if cfg.tie_embeddings:
        names -= set(hf_names(HEAD))
    return names


def convert(
    raw_dir: str | Path,
    out: str | Path,
    dtype: str | None = None,
    force: bool = False,
    chat_template: str | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    overrides: dict | None = None,
    allow_nonfinite: bool = False,
    log=print,
    ignore_config_keys: Iterable[str] = (),
) -> TrainConfig:
    """`dtype`: the folder's (spec.DTYPES); None: the dtype the checkpoint's weights are stored in (float32 for
    mixed ones, said in a note). `ignore_config_keys`: train config keys format 1 does not define that the user
    says do not change the math (--ignore-config-key); any other such key is refused by name."""
    raw_dir, out = Path(raw_dir), Path(out)
    inputs = checkpoint_inputs(raw_dir)  # the folder and the files it names (any may be a symlink elsewhere)
    check_output(out, force, inputs)  # before the (possibly long) load
    ckpt = load_checkpoint(raw_dir)
    cfg = resolve_config(ckpt, overrides, ignore_config_keys)
    dtype = dtype or stored_dtype(ckpt)
    for note in ckpt.notes:  # what loading and resolving changed
        log(f"note: {note}")
    what = f"converting {raw_dir} to {out}"  # "... needs about N GB free", "filled up while ..."
    # the weights in the output dtype and the tokenizer; an old folder --force replaces stays until the new is whole
    weights = sum(t.numel() for t in ckpt.state.values() if isinstance(t, torch.Tensor)) * TORCH_DTYPES[dtype].itemsize
    tok = ckpt.path.parent / "tokenizer.json"
    check_space(out.parent, weights + (tok.stat().st_size if tok.is_file() else 0), what)
    try:
        with new_folder(out, force, inputs) as tmp:
            write_folder(
                tmp,
                ckpt.path.parent,
                cfg,
                ckpt.state,
                dtype,
                chat_template,
                max_shard_size,
                allow_nonfinite,
                release=ckpt.release,
            )
            # the fingerprint's reference model reads the folder just written: the checkpoint's weights (read into
            # memory from a sharded one, mapped from model.pt) go first, so the two are never held together
            ckpt.state.clear()
            fingerprint.record(tmp, log)  # what a server of the folder must compute (run/fingerprint.py)
    except OSError as e:
        raise disk_full(e, out, f"while {what}") or e from None
    log(
        f"convert: wrote {out} ({cfg.n_layers} layers, d_model {cfg.d_model}, heads {cfg.n_heads}/{cfg.n_kv_heads}, "
        f"head_dim {cfg.head_dim}, vocab {cfg.vocab_size}, {'tied' if cfg.tie_embeddings else 'untied'}, {dtype})"
    )
    return cfg


def llama_twin(hf: Path, out: Path) -> Path:
    """`out`: the converted folder `hf` as vLLM's own LLaMA: its files linked (the same safetensors), config.json
    naming LlamaForCausalLM and model_type llama. The benchmarks' and the GPU proof's "same weights, stock model"."""
    with new_folder(out, force=True) as tmp:
        for f in hf.iterdir():
            if f.name != "config.json":
                (tmp / f.name).symlink_to(f.resolve())
        config = json.loads((hf / "config.json").read_text())
        config.update(architectures=["LlamaForCausalLM"], model_type="llama")
        config.pop("auto_map", None)  # transformers' own LLaMA: no code of the folder's
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
