"""LoRA adapters, from the trainer to the server: the trainer's `adapter.pt` (format.md, "LoRA adapters"), read
by model.pt's own reader and checked against its base model, written as a PEFT adapter folder
(adapter_config.json + adapter_model.safetensors) that vLLM serves beside the base model
(`vllm serve BASE --enable-lora --lora-modules name=DIR`, `ministream serve BASE --lora name=DIR`, `LoRARequest`).

The names are ministream.spec's LORA_TABLE. A fused weight's B splits by rows as the weight does (Wqkv: q, k,
v; w12: gate, up) and each part keeps the whole A, which is exact: vLLM adds the same (alpha / r) * B @ A.
"""

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .. import MiniStreamError
from ..atomic import check_output, check_space, disk_full, new_folder, pause_point
from ..spec import (
    LORA_TABLE,
    LoraRow,
    TrainConfig,
    check_lora,
    lora_to_peft,
    peft_modules,
    peft_shapes,
    train_config_from_hf,
)
from .folder import checked
from .format import (
    ADAPTER_FILE,
    is_training_checkpoint,
    load_checkpoint,
    named_tensors,
    read_json,
    read_pt,
    resolve_config,
)
from .weights import write_safetensors

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # a PEFT adapter folder's files
CONFIG_KEYS = ("r", "alpha")  # the adapter's config: rank, and alpha of the scale alpha / r


@dataclass
class Adapter:
    path: Path  # adapter.pt
    state: dict[str, torch.Tensor]  # the trainer's keys: no prefixes, blocks numbered from 0
    r: int
    alpha: float
    notes: list[str]  # what reading changed (prefixes stripped, blocks renumbered, entries ignored)

    @property
    def scaling(self) -> float:
        """The update is W += scaling * B @ A."""
        return self.alpha / self.r


def load_adapter(path: str | Path, ignore_keys: Iterable[str] = ()) -> Adapter:
    """Read a trainer's adapter.pt (a file, or the folder holding it) without executing code from it:
    {"lora": {name: tensor}, "config": {"r": int, "alpha": float}}, as model.pt is read (format.read_pt)."""
    path = Path(path)
    if path.is_dir():
        path = path / ADAPTER_FILE
    if not path.is_file():
        raise MiniStreamError(f"{path}: no such file; a MiniStream LoRA adapter folder holds {ADAPTER_FILE}")
    notes: list[str] = []
    obj = read_pt(path, notes)
    if not isinstance(obj, dict) or not isinstance(obj.get("lora"), dict):
        what = "a training checkpoint ('model')" if isinstance(obj, dict) and "model" in obj else _kind(obj)
        raise MiniStreamError(
            f"{path}: holds {what}, not a LoRA adapter: expected "
            "{'lora': {name: tensor}, 'config': {'r': int, 'alpha': float}} (format.md, 'LoRA adapters')"
        )
    ignored = sorted(str(k) for k in obj if k not in ("lora", "config"))
    if ignored:
        notes.append(f"ignored entries: {', '.join(ignored)}")
    r, alpha = _config(path, obj.get("config"), set(ignore_keys), notes)
    state = named_tensors(path, obj["lora"], notes, "'lora'")
    for k, v in state.items():
        if not bool(torch.isfinite(v).all()):
            raise MiniStreamError(
                f"{path}: {k} holds NaN or Inf values: the run diverged, or the file is damaged; "
                "convert an earlier adapter"
            )
    return Adapter(path, state, r, alpha, notes)


def _kind(obj) -> str:
    return f"a dict with {', '.join(map(repr, list(obj)[:4]))}" if isinstance(obj, dict) else f"a {type(obj).__name__}"


def _config(path: Path, config, ignore: set[str], notes: list[str]) -> tuple[int, float]:
    """r and alpha, checked; a key the format does not define is refused unless ignored (--ignore-config-key):
    dropped in silence, a key such as use_rslora would change the scale."""
    if not isinstance(config, dict) or not all(k in config for k in CONFIG_KEYS):
        have = f"its config has {', '.join(map(repr, config))}" if isinstance(config, dict) else "it has no config"
        raise MiniStreamError(
            f"{path}: {have}; an adapter's config gives r and alpha (the update is W += alpha / r * B @ A): "
            "save {'r': r, 'alpha': alpha} as its 'config'"
        )
    unknown = [str(k) for k in config if k not in CONFIG_KEYS]
    refused = [k for k in unknown if k not in ignore]
    if refused:
        raise MiniStreamError(
            f"{path}: the adapter's config has {refused[0]!r} = {config[refused[0]]!r}, which the format does not "
            "define (only r and alpha): converting without it could serve another update. If it does not change "
            "the math (dropout, say), say so: " + " ".join(f"--ignore-config-key {k}" for k in refused)
        )
    if unknown:
        notes.append(f"ignored adapter config keys (--ignore-config-key): {', '.join(unknown)}")
    r, alpha = config["r"], config["alpha"]
    check_r_alpha(r, alpha, f"{path}: the adapter's config")
    return r, float(alpha)


def check_r_alpha(r, alpha, where: str) -> None:
    """The format's rule for an adapter's config, one for its writer (`ministream checkpoint --adapter`) and its
    reader (convert-lora): r a positive integer, alpha a finite number. MiniStreamError naming `where`."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise MiniStreamError(f"{where} r={r!r}: must be a positive integer (the rank)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise MiniStreamError(f"{where} alpha={alpha!r}: must be a finite number")


def check_adapter(adapter: Adapter, cfg: TrainConfig) -> list[LoraRow]:
    """The adapter's tensors against the base model's config (spec.check_lora): the rows it holds."""
    return check_lora(adapter.state, cfg, adapter.r, str(adapter.path))


def base_config(base: str | Path, ignore_keys: Iterable[str] = ()) -> TrainConfig:
    """The base model's train config: from a converted folder's config.json, or a training checkpoint's own."""
    base = Path(base)
    if not base.exists():
        raise MiniStreamError(
            f"{base}: no such folder; give the base model: its converted folder (make convert) or its training "
            "checkpoint"
        )
    if (base / "config.json").is_file() and not is_training_checkpoint(base):  # a sharded checkpoint has one too
        checked(base)  # the one folder check: an adapter is served on the base the server would run
        return train_config_from_hf(read_json(base / "config.json"), str(base / "config.json"))
    ckpt = load_checkpoint(base)
    if ckpt.config is None:
        raise MiniStreamError(
            f"{ckpt.path} is a bare state dict, with no train config to check the adapter against: "
            "give the converted folder as the base instead (make convert)"
        )
    return resolve_config(ckpt, None, ignore_keys)


def updates(adapter: Adapter, rows: list[LoraRow]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{training key of a weight: (A, B)}: what the reference model merges (reference.merge_lora)."""
    return {row.base: (adapter.state[row.a], adapter.state[row.b]) for row in rows}


def load_for(adapter_path: str | Path, cfg: TrainConfig) -> tuple[Adapter, list[LoraRow]]:
    """An adapter read and checked against the base model's config."""
    adapter = load_adapter(adapter_path)
    return adapter, check_adapter(adapter, cfg)


def peft_config(adapter: Adapter, rows: list[LoraRow], base: Path) -> dict:
    """adapter_config.json: PEFT's LoraConfig for the same update (scale lora_alpha / r, no rsLoRA, no bias).
    LoraConfig's keys only: on any other, PeftModel.from_pretrained warns the user to upgrade PEFT (issue 53),
    so the folder names its maker in its made record (.ministream-made.json), not here."""
    targets = [t for t in LORA_TABLE if any(row.target == t for row in rows)]
    alpha = int(adapter.alpha) if adapter.alpha.is_integer() else adapter.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(Path(base).resolve()),
        "r": adapter.r,
        "lora_alpha": alpha,
        "target_modules": peft_modules(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def out_dtype(adapter: Adapter) -> torch.dtype:
    """The adapter's own dtype where it is one of the format's (float32, bfloat16); float32 otherwise: when its
    tensors mix them, and for float16 (a trainer's mixed precision), whose every value float32 holds exactly
    (docs/format.md, "LoRA adapters")."""
    dtypes = {t.dtype for t in adapter.state.values()}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.float32, torch.bfloat16} else torch.float32


def convert_lora(
    adapter_dir: str | Path,
    out: str | Path,
    base: str | Path,
    force: bool = False,
    log=print,
    ignore_config_keys: Iterable[str] = (),
) -> list[LoraRow]:
    """`ministream convert-lora`: the trainer's adapter -> a PEFT adapter folder, every shape checked against
    the base model (a converted folder or the training checkpoint) before anything is written."""
    adapter_dir, out, base = Path(adapter_dir), Path(out), Path(base)
    folder = adapter_dir.parent if adapter_dir.is_file() else adapter_dir
    inputs = [folder, folder / ADAPTER_FILE, base, *(base.iterdir() if base.is_dir() else [])]
    check_output(out, force, inputs)  # before any reading
    cfg = base_config(base, ignore_config_keys)
    adapter = load_adapter(adapter_dir, ignore_config_keys)
    rows = check_adapter(adapter, cfg)
    for note in adapter.notes:
        log(f"note: {note}")
    dtype = out_dtype(adapter)
    tensors = list(lora_to_peft(rows, adapter.state))
    what = f"converting {adapter.path} to {out}"
    check_space(out.parent, sum(t.numel() for _, t in tensors) * dtype.itemsize, what)
    try:
        with new_folder(out, force, inputs) as tmp, tqdm(disable=True) as progress:
            write_safetensors(tmp / PEFT_WEIGHTS, tensors, dtype, progress)
            pause_point("convert-lora:weights")
            (tmp / PEFT_CONFIG).write_text(json.dumps(peft_config(adapter, rows, base), indent=2) + "\n")
    except OSError as e:
        raise disk_full(e, out, f"while {what}") or e from None
    targets = sorted({row.target for row in rows}, key=list(LORA_TABLE).index)
    log(
        f"convert-lora: wrote {out} (r {adapter.r}, alpha {adapter.alpha:g}, {', '.join(targets)} in "
        f"{cfg.n_layers} blocks, {str(dtype).removeprefix('torch.')}) for the base {base}"
    )
    return rows


# --- a PEFT adapter folder, for the server's pre-flight check --------------------------------------


def check_peft(folder: str | Path, cfg: TrainConfig, shapes: dict[str, tuple[int, ...]]) -> int:
    """A PEFT adapter folder (its config and its tensors' `shapes`, read from the safetensors header) against
    the base model it is served with: every tensor one the base's weights take, of the shape r implies. Its r."""
    folder = Path(folder)
    try:
        config: object = read_json(folder / PEFT_CONFIG)
    except UnicodeDecodeError:
        raise MiniStreamError(f"{folder / PEFT_CONFIG}: not text (not UTF-8): convert the adapter again") from None
    if not isinstance(config, dict):
        raise MiniStreamError(
            f"{folder / PEFT_CONFIG}: holds a JSON {type(config).__name__}, not PEFT's LoraConfig (an object with "
            f"r, lora_alpha, target_modules): convert the adapter again, ministream convert-lora ADAPTER {folder}"
        )
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise MiniStreamError(f"{folder / PEFT_CONFIG}: r={r!r}; a LoRA adapter's rank is a positive integer")
    # what vLLM's PEFTHelper reads for the update's scale (lora_alpha / r) and its layers: else a traceback there
    alpha, targets = config.get("lora_alpha"), config.get("target_modules")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise MiniStreamError(f"{folder / PEFT_CONFIG}: lora_alpha={alpha!r}; the update's scale is a finite number")
    if not isinstance(targets, str) and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise MiniStreamError(
            f"{folder / PEFT_CONFIG}: target_modules={targets!r}; PEFT names the layers as a list of names"
        )
    want = peft_shapes(cfg, r)
    for name, got in shapes.items():
        if name not in want:
            raise MiniStreamError(
                f"{folder / PEFT_WEIGHTS}: {name!r} is not a factor of a weight the base model's LoRA layers take "
                f"({', '.join(peft_modules(LORA_TABLE))}, in {cfg.n_layers} blocks): is it for another model?"
            )
        if tuple(got) != want[name]:
            raise MiniStreamError(
                f"{folder / PEFT_WEIGHTS}: {name} has shape {list(got)}, but r={r} and the base model imply "
                f"{list(want[name])}: is the adapter for another base model? (convert-lora --base checks this)"
            )
    if not shapes:
        raise MiniStreamError(f"{folder / PEFT_WEIGHTS}: holds no tensors; convert the adapter again")
    return r
