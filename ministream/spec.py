"""MiniStream stated once: its names, the train config and its HF-config map, the tensor table and its
inverse, and the shapes a config implies. The contract is docs/format.md.

Every other module asks this one; it imports nothing of the package but the error class. One tensor
table, read forwards to convert and backwards to restore (torchtitan's adapter, llama.cpp's table),
so `raw -> HF -> raw` is provably lossless.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import MiniStreamError

if TYPE_CHECKING:  # torch is imported where a tensor is touched: doctor, patch and matrix never need it (1.5 s)
    import torch

# --- names --------------------------------------------------------------------------------------
ARCH = "MiniStreamForCausalLM"  # config.json architectures[0]; vLLM's and transformers' class
MODEL_TYPE = "ministream"  # config.json model_type; also the model's module name in vLLM
CONFIG_CLASS = "MiniStreamConfig"  # the config class registered for MODEL_TYPE
MODEL_CLASS = "MiniStreamModel"  # transformers' model without the head: what its AutoModel loads
# The two files every converted folder carries for transformers (checkpoint/hf_files.py), named as transformers
# names a model's own, and config.json's auto_map, which points transformers' Auto classes at them
HF_CONFIG_MODULE = f"configuration_{MODEL_TYPE}"
HF_MODEL_MODULE = f"modeling_{MODEL_TYPE}"
HF_AUTO_MAP = {
    "AutoConfig": f"{HF_CONFIG_MODULE}.{CONFIG_CLASS}",
    "AutoModel": f"{HF_MODEL_MODULE}.{MODEL_CLASS}",
    "AutoModelForCausalLM": f"{HF_MODEL_MODULE}.{ARCH}",
}
MODEL_FILE_IN_TREE = f"vllm/model_executor/models/{MODEL_TYPE}.py"  # where the model file goes in a vLLM tree
FORMAT_VERSION = 1  # the training checkpoint format this package reads

# dtype name -> safetensors code; TORCH_DTYPES (name -> torch dtype) and SAFETENSORS_CODES (torch dtype -> code)
# are made on first use, below
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def __getattr__(name: str) -> Any:
    if name not in ("TORCH_DTYPES", "SAFETENSORS_CODES"):  # the import system asks for __path__ and others
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    if name == "TORCH_DTYPES":
        return {n: getattr(torch, n) for n in DTYPES}
    return {getattr(torch, n): code for n, code in DTYPES.items()}


# --- the train config ---------------------------------------------------------------------------


@dataclass
class TrainConfig:
    vocab_size: int  # rows of embedding.weight; may exceed the tokenizer's size (padding)
    d_model: int  # hidden size H
    n_layers: int  # number of blocks L
    n_heads: int  # query heads Nq
    d_ff: int  # MLP inner size F
    max_seq_len: int  # trained context length
    norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base
    bos_id: int
    eos_id: int
    # None: the default, filled in by __post_init__, so an instance always has ints (hence the ignores)
    n_kv_heads: int = None  # type: ignore[assignment]  # key/value heads Nkv; divides n_heads; default n_heads
    head_dim: int = None  # type: ignore[assignment]  # per-head size D; default d_model // n_heads (need not be equal)
    tie_embeddings: bool = True  # output head shares embedding.weight

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                setattr(self, f.name, _checked_value(f.name, getattr(self, f.name), "train config"))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.n_heads <= 0 or self.d_model % self.n_heads:
                raise MiniStreamError(
                    f"head_dim is not set and d_model={self.d_model} is not a multiple of "
                    f"n_heads={self.n_heads}: give head_dim explicitly"
                )
            self.head_dim = self.d_model // self.n_heads
        for name in INT_FIELDS[:-2]:
            if getattr(self, name) <= 0:
                raise MiniStreamError(f"train config {name}={getattr(self, name)!r}: must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise MiniStreamError(
                f"train config n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: "
                "each key/value head must serve a whole group of query heads"
            )
        if self.head_dim % 2:
            raise MiniStreamError(
                f"train config head_dim={self.head_dim} is odd: rotate-half RoPE needs an even head_dim"
            )
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise MiniStreamError(
                f"train config norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must both be positive"
            )
        for name in ("bos_id", "eos_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise MiniStreamError(
                    f"train config {name}={getattr(self, name)} is outside the vocabulary [0, {self.vocab_size})"
                )

    @classmethod
    def from_dict(cls, d: dict, source: str = "train config") -> TrainConfig:
        """Checked value by value, each error naming its key, before anything is sized from them."""
        missing = sorted(REQUIRED_FIELDS - {k for k, v in d.items() if v is not None})
        if missing:
            raise MiniStreamError(
                f"{source} lacks {', '.join(missing)}: pass them as flags (e.g. --{missing[0].replace('_', '-')} N)"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in d if k not in known]
        if unknown:  # never dropped in silence: a key the format lacks may change the math
            raise MiniStreamError(
                f"{source}: {', '.join(map(repr, unknown[:3]))} {'is' if len(unknown) == 1 else 'are'} not a key "
                "of format 1's train config"
            )
        kwargs = {k: _checked_value(k, v, source) for k, v in d.items() if v is not None}
        try:
            return cls(**kwargs)
        except MiniStreamError as e:  # a rule between values: say whose values they are
            raise MiniStreamError(f"{source}: {e}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def qkv_sizes(self) -> list[int]:
        """Row split of Wqkv: all query heads, then all key heads, then all value heads."""
        return [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim]

    @property
    def w12_sizes(self) -> list[int]:
        """Row split of w12: gate, then up."""
        return [self.d_ff, self.d_ff]


INT_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "d_ff",
    "max_seq_len",
    "bos_id",
    "eos_id",
)
REQUIRED_FIELDS = {f.name for f in dataclasses.fields(TrainConfig) if f.default is dataclasses.MISSING}
# Beyond these a value is a typo or an attack, not a model: refused before anything is sized from it.
MAX_INT = 2**31 - 1  # a tensor dimension
MAX_LAYERS = 4096


def _checked_value(key: str, value, source: str):
    """`value` as the type `key` needs: ints (an integral float such as 768.0 is accepted), finite positive
    reals, a bool; anything else is refused in one line that names the key."""
    if key == "tie_embeddings":
        if not isinstance(value, bool):
            raise MiniStreamError(f"{source} {key}={value!r}: must be true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MiniStreamError(f"{source} {key}={value!r}: must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise MiniStreamError(f"{source} {key}={value!r}: must be finite")
    if key in INT_FIELDS:
        if value != int(value):
            raise MiniStreamError(f"{source} {key}={value!r}: must be an integer")
        value = int(value)
        limit = MAX_LAYERS if key == "n_layers" else MAX_INT
        if abs(value) > limit:
            raise MiniStreamError(f"{source} {key}={value}: absurdly large (over {limit}); check the config")
        return value
    return float(value)


# TrainConfig field -> config.json key (LLaMA's names); read backwards to restore the train config.
CONFIG_MAP = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
    "bos_id": "bos_token_id",
    "eos_id": "eos_token_id",
}


# config.json keys with the one value format 1's math has: vLLM applies any other (another activation, biases)
HF_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def hf_rope_parameters(rope_theta: float) -> dict:
    """config.json's rope_parameters for plain RoPE; any other rope_type, or a key more, is another RoPE."""
    return {"rope_type": "default", "rope_theta": rope_theta}


def hf_config(cfg: TrainConfig, dtype: str, converter: str = "") -> dict:
    """config.json for a converted folder: every value explicit, under LLaMA's keys."""
    # auto_map: the folder's own files, for transformers where ministream is not installed (trust_remote_code);
    # vLLM, patched or with the plugin, registers MODEL_TYPE's config class itself and never reads it
    config: dict[str, Any] = {"architectures": [ARCH], "model_type": MODEL_TYPE, "auto_map": dict(HF_AUTO_MAP)}
    config.update({hf: getattr(cfg, f) for f, hf in CONFIG_MAP.items()})
    config.update(
        {
            # transformers >= 5 reads rope_parameters, older releases rope_theta: write both
            "rope_parameters": hf_rope_parameters(cfg.rope_theta),
            **HF_FIXED,
            "initializer_range": 0.02,
            "dtype": dtype,
            "torch_dtype": dtype,
        }
    )
    if converter:
        config["ministream_converter"] = converter
    return config


def train_config_from_hf(config: dict, source: str = "config.json") -> TrainConfig:
    return TrainConfig.from_dict({f: config.get(hf) for f, hf in CONFIG_MAP.items()}, source)


# --- the tensor table ---------------------------------------------------------------------------

# Roles other modules ask for by name; the strings themselves live only in the table below.
EMBEDDING, HEAD, FINAL_NORM = "embedding.weight", "lm_head.weight", "norm_f.weight"
QKV, W12 = "blocks.{i}.attn.Wqkv.weight", "blocks.{i}.mlp.w12.weight"
OUT_PROJ, W3 = "blocks.{i}.attn.out_proj.weight", "blocks.{i}.mlp.w3.weight"

# training name                        HF names (LLaMA's)                                    row split      shape
LAYER_TABLE = [
    ("blocks.{i}.norm1.weight", ["model.layers.{i}.input_layernorm.weight"], None, lambda c: (c.d_model,)),
    # Wqkv rows: all query heads, then all key heads, then all value heads
    (
        QKV,
        [
            "model.layers.{i}.self_attn.q_proj.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        ],
        "qkv_sizes",
        lambda c: (sum(c.qkv_sizes), c.d_model),
    ),
    (
        OUT_PROJ,
        ["model.layers.{i}.self_attn.o_proj.weight"],
        None,
        lambda c: (c.d_model, c.n_heads * c.head_dim),
    ),
    ("blocks.{i}.norm2.weight", ["model.layers.{i}.post_attention_layernorm.weight"], None, lambda c: (c.d_model,)),
    # w12 rows: gate, then up (silu applies to the gate)
    (
        W12,
        ["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"],
        "w12_sizes",
        lambda c: (2 * c.d_ff, c.d_model),
    ),
    (W3, ["model.layers.{i}.mlp.down_proj.weight"], None, lambda c: (c.d_model, c.d_ff)),
]
GLOBAL_TABLE = [
    (EMBEDDING, ["model.embed_tokens.weight"], None, lambda c: (c.vocab_size, c.d_model)),
    (FINAL_NORM, ["model.norm.weight"], None, lambda c: (c.d_model,)),
    (
        HEAD,
        ["lm_head.weight"],
        None,  # untied only
        lambda c: (c.vocab_size, c.d_model),
    ),
]
# HF name -> llama.cpp's name for it (its LLaMA architecture, llama-arch.cpp), for the GGUF export
GGUF_NAMES = {
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# llama.cpp's LLaMA rotates adjacent pairs (x[2j], x[2j+1]); the format rotates halves (x[j], x[j+D/2]).
# Reordering each head's rows of q and k from halves to pairs makes the two the same math (what
# llama.cpp's convert_hf_to_gguf.py does for LLaMA); the value is the config field with the head count.
GGUF_ROPE_ROWS = {"blk.{i}.attn_q.weight": "n_heads", "blk.{i}.attn_k.weight": "n_kv_heads"}
# what each shape is made of, for errors that explain a mismatch
_SHAPE_WORDS = {
    QKV: "(n_heads + 2*n_kv_heads)*head_dim = ({n_heads} + 2*{n_kv_heads})*{head_dim} rows, d_model={d_model} columns",
    OUT_PROJ: "d_model={d_model} rows, n_heads*head_dim = {n_heads}*{head_dim} columns",
    W12: "2*d_ff = 2*{d_ff} rows, d_model={d_model} columns",
    W3: "d_model={d_model} rows, d_ff={d_ff} columns",
    EMBEDDING: "vocab_size={vocab_size} rows, d_model={d_model} columns",
    HEAD: "vocab_size={vocab_size} rows, d_model={d_model} columns",
}
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


@dataclass(frozen=True)
class Row:
    raw: str  # the training checkpoint's key
    hf: tuple[str, ...]  # the HF folder's keys, in row order
    split: tuple[int, ...] | None  # rows of `raw` that go to each HF key; None: one key, unchanged
    shape: tuple[int, ...]  # shape of `raw`
    template: str  # the table's key, {i} unfilled


def table(cfg: TrainConfig) -> list[Row]:
    """The table instantiated for a config, in file order (layers, then embedding, final norm, head)."""
    rows = []
    for i in range(cfg.n_layers):
        for raw, hf, split, shape in LAYER_TABLE:
            rows.append(
                Row(
                    raw.format(i=i),
                    tuple(h.format(i=i) for h in hf),
                    tuple(getattr(cfg, split)) if split else None,
                    shape(cfg),
                    raw,
                )
            )
    for raw, hf, _split, shape in GLOBAL_TABLE:
        if raw != HEAD or not cfg.tie_embeddings:
            rows.append(Row(raw, tuple(hf), None, shape(cfg), raw))
    return rows


def hf_names(template: str, layer: int | None = None) -> list[str]:
    """The HF keys a training key becomes: hf_names(QKV, 0) -> layer 0's q_proj, k_proj, v_proj."""
    for raw, hf, _, _ in LAYER_TABLE + GLOBAL_TABLE:
        if raw == template:
            return [h.format(i=layer) for h in hf]
    raise KeyError(template)


def raw_to_hf(cfg: TrainConfig, state: dict):
    """Yield (HF name, tensor) in file order; splits are views, so nothing is copied here."""
    for row in table(cfg):
        parts = state[row.raw].split(list(row.split), dim=0) if row.split else [state[row.raw]]
        yield from zip(row.hf, parts)


def gguf_tensors(cfg: TrainConfig, hf_state):
    """Yield (llama.cpp name, tensor) in file order from HF-named tensors (a dict or a lazy mapping), one at a
    time: q and k rows reordered for llama.cpp's RoPE."""
    templates = {raw: hf for raw, hf, _, _ in LAYER_TABLE + GLOBAL_TABLE}
    for row in table(cfg):
        layer = block_index(row.raw)
        for hf, template in zip(row.hf, templates[row.template]):
            name = GGUF_NAMES[template]
            t = hf_state[hf]
            if name in GGUF_ROPE_ROWS:  # each head's rows: [halves 2, D/2, H] -> [D/2, pairs 2, H]
                heads = getattr(cfg, GGUF_ROPE_ROWS[name])
                t = t.reshape(heads, 2, cfg.head_dim // 2, -1).transpose(1, 2).reshape(t.shape)
            yield name.format(i=layer), t


def raw_shapes(cfg: TrainConfig) -> dict[str, tuple[int, ...]]:
    """Every training tensor the config implies, with its shape."""
    return {row.raw: row.shape for row in table(cfg)}


def hf_shapes(cfg: TrainConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a converted folder the config implies, with its shape."""
    shapes = {}
    for row in table(cfg):
        sizes = row.split or (row.shape[0],)
        shapes.update({h: (n, *row.shape[1:]) for h, n in zip(row.hf, sizes)})
    return shapes


def block_index(key: str) -> int | None:
    """The block number of a training key (blocks.3.norm1.weight -> 3), None for a global tensor."""
    m = _BLOCK.match(key)
    return int(m.group(1)) if m else None


def renumber_block(key: str, shift: int) -> str:
    return _BLOCK.sub(lambda m: f"blocks.{int(m.group(1)) + shift}.", key)


def infer_shapes(state: dict) -> dict:
    """What the tensor shapes say about the config (to help a user whose checkpoint has none)."""
    got = {}
    if EMBEDDING in state:
        got["vocab_size"], got["d_model"] = state[EMBEDDING].shape
    ids = {i for k in state if (i := block_index(k)) is not None}
    if ids:
        got["n_layers"] = max(ids) + 1
    w3 = LAYER_TABLE[-1][0].format(i=0)
    if w3 in state:
        got["d_ff"] = state[w3].shape[1]
    got["tie_embeddings"] = HEAD not in state
    return got


def drop_tied_head(state: dict, cfg: TrainConfig) -> tuple[dict, str | None]:
    """A tied checkpoint saved the ordinary way (state_dict() of a model whose head shares the embedding's
    storage) holds lm_head.weight too: when it is the embedding, the same storage or equal bit for bit, it
    is dropped (the tied model is the same math), with a note saying so. A head that differs stays, for
    check_state to refuse."""
    if not cfg.tie_embeddings or HEAD not in state or EMBEDDING not in state:
        return state, None
    head, emb = state[HEAD], state[EMBEDDING]
    if _same_storage(head, emb):
        how = "the same storage"
    elif _difference(head, emb) is None:
        how = "equal bit for bit"
    else:
        return state, None
    note = f"{HEAD} is {EMBEDDING} ({how}), as tie_embeddings=true says: dropped {HEAD}, the head is the embedding"
    return {k: v for k, v in state.items() if k != HEAD}, note


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    def where(t: torch.Tensor) -> tuple:
        return t.untyped_storage().data_ptr(), t.storage_offset(), t.stride(), t.shape, t.dtype

    return where(a) == where(b)


def _difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """How two tensors differ, None when they are equal bit for bit."""
    import torch

    if a.shape != b.shape:
        return f"shape {list(a.shape)} against {list(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} against {b.dtype}"
    if a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
        return None
    diff = (a.float() - b.float()).abs().nan_to_num(nan=float("inf")).max()
    return f"max abs difference {float(diff):.4g}"


def check_stored_dtype(where: object, key: str, dtype) -> None:
    """A weight's dtype is one format 1 stores (a name of DTYPES): the one rule for model.pt's tensors and, before
    a byte of them is read, a sharded checkpoint's entries."""
    if str(dtype).removeprefix("torch.") not in DTYPES:
        raise MiniStreamError(f"{where}: {key} has dtype {dtype}; format 1 holds float32 or bfloat16 tensors")


def check_state(state: dict, cfg: TrainConfig, source: str) -> None:
    """Every tensor the config implies is there with its shape, and nothing else is."""
    want = {row.raw: row for row in table(cfg)}
    missing = [k for k in want if k not in state]
    extra = [k for k in state if k not in want]
    if HEAD in extra and cfg.tie_embeddings:  # drop_tied_head kept it: it is not the embedding
        how = _difference(state[HEAD], state[EMBEDDING]) if EMBEDDING in state else f"no {EMBEDDING} to compare"
        raise MiniStreamError(
            f"{source}: has {HEAD}, which differs from {EMBEDDING} ({how}), but the config says "
            "tie_embeddings=true: if the head was trained separately, set tie_embeddings false in the "
            "checkpoint's config (--untied for a checkpoint without one); if it is tied, save the model "
            f"whose {HEAD} is its {EMBEDDING}"
        )
    if missing:
        hint = ""
        if missing == [HEAD]:
            hint = "; the config says tie_embeddings=false: set it true (--tied) if the head shares the embedding"
        raise MiniStreamError(
            f"{source}: missing {len(missing)} tensor(s) the config implies, first {missing[0]!r}{hint} "
            f"(n_layers={cfg.n_layers}; keys present: {_summarize(state)})"
        )
    if extra:
        raise MiniStreamError(
            f"{source}: {len(extra)} unexpected tensor(s), first {extra[0]!r}: "
            "not part of MiniStream format 1 (biases? another architecture? wrong n_layers?)"
        )
    for k, row in want.items():
        got = tuple(state[k].shape)
        if got != row.shape:
            words = _SHAPE_WORDS.get(row.template, "d_model={d_model}").format(**cfg.to_dict())
            raise MiniStreamError(
                f"{source}: {k} has shape {list(got)} but the config implies {list(row.shape)} "
                f"({words}); fix the config values or the checkpoint"
            )


def _summarize(state: dict) -> str:
    keys = sorted(state)
    return ", ".join(keys[:4]) + (f", ... ({len(keys)} in all)" if len(keys) > 4 else "")


# --- LoRA adapters ------------------------------------------------------------------------------

# The trainer's adapter (format.md, "LoRA adapters") adds (alpha / r) * B @ A to some of a block's matrices,
# A [r, in] and B [out, r]; its keys are the weight's own with lora_A / lora_B in place of "weight". A PEFT
# adapter (what vLLM loads) names the same factors after each HF weight, under PEFT's prefix. A fused weight's
# B splits by rows as the weight does (q, k, v; gate, up) and every part keeps the whole A: the rows of B @ A
# are the rows of B times A, so the split is exact, and concatenating the parts of B restores it.

# target      the trainer's key (f: A or B)                 the weight it updates
LORA_TABLE = {
    "Wqkv": ("blocks.{i}.attn.Wqkv.lora_{f}.weight", QKV),
    "out_proj": ("blocks.{i}.attn.out_proj.lora_{f}.weight", OUT_PROJ),
    "w12": ("blocks.{i}.mlp.w12.lora_{f}.weight", W12),
    "w3": ("blocks.{i}.mlp.w3.lora_{f}.weight", W3),
}
PEFT_PREFIX = "base_model.model."  # PeftModel's wrapper, before the model's own names


def _peft_name(hf: str, factor: str) -> str:
    """model.layers.0.self_attn.q_proj.weight -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"""
    return PEFT_PREFIX + hf.removesuffix(".weight") + f".lora_{factor}.weight"


@dataclass(frozen=True)
class LoraRow:
    target: str  # LORA_TABLE's key
    a: str  # the trainer's key of A
    b: str  # the trainer's key of B
    base: str  # the training key of the weight it updates
    peft_a: tuple[str, ...]  # PEFT's keys of A, one per HF weight: each holds the whole A
    peft_b: tuple[str, ...]  # PEFT's keys of B, one per row block of the split
    split: tuple[int, ...] | None  # the weight's row split (Row.split), which B's rows follow
    a_shape: tuple[int, ...]  # [r, in]
    b_shape: tuple[int, ...]  # [out, r]


def lora_table(cfg: TrainConfig, r: int, targets=None) -> list[LoraRow]:
    """LORA_TABLE instantiated for a base config and rank: every (layer, target) pair, in file order;
    `targets`: only these (LORA_TABLE's keys)."""
    rows = {row.raw: row for row in table(cfg)}
    out = []
    for i in range(cfg.n_layers):
        for target, (key, weight) in LORA_TABLE.items():
            if targets is not None and target not in targets:
                continue
            row = rows[weight.format(i=i)]
            rows_out, cols_in = row.shape
            out.append(
                LoraRow(
                    target,
                    key.format(i=i, f="A"),
                    key.format(i=i, f="B"),
                    row.raw,
                    tuple(_peft_name(h, "A") for h in row.hf),
                    tuple(_peft_name(h, "B") for h in row.hf),
                    row.split,
                    (r, cols_in),
                    (rows_out, r),
                )
            )
    return out


def peft_modules(targets) -> list[str]:
    """PEFT's target_modules for some of LORA_TABLE's targets: the HF modules they update (q_proj, ...)."""
    return [h.split(".")[-2] for t in LORA_TABLE if t in targets for h in hf_names(LORA_TABLE[t][1])]


def peft_shapes(cfg: TrainConfig, r: int) -> dict[str, tuple[int, ...]]:
    """Every tensor a PEFT adapter of rank r for this base may hold, with its shape (lora_to_peft's output)."""
    shapes = {}
    for row in lora_table(cfg, r):
        shapes.update({name: row.a_shape for name in row.peft_a})
        outs = row.split or (row.b_shape[0],)
        shapes.update({name: (n, r) for name, n in zip(row.peft_b, outs)})
    return shapes


def lora_to_peft(rows: list[LoraRow], state: dict):
    """Yield (PEFT name, tensor) in file order: A once per HF weight, B's rows split as the weight's (views)."""
    for row in rows:
        a, b = state[row.a], state[row.b]
        parts = b.split(list(row.split), dim=0) if row.split else [b]
        for name_a, name_b, part in zip(row.peft_a, row.peft_b, parts):
            yield name_a, a
            yield name_b, part


def peft_to_lora(rows: list[LoraRow], peft: dict) -> dict:
    """The inverse of lora_to_peft for the rows `peft` holds: B's parts concatenated, the one A they share."""
    import torch

    state = {}
    for row in rows:
        if row.peft_a[0] not in peft:
            continue
        a = peft[row.peft_a[0]]
        if any(not torch.equal(peft[n], a) for n in row.peft_a[1:]):
            raise MiniStreamError(
                f"{', '.join(row.peft_a)} differ: the trainer's {row.a} is one A for all of {row.base}'s parts"
            )
        state[row.a], state[row.b] = a, torch.cat([peft[n] for n in row.peft_b], dim=0)
    return state


def check_lora(state: dict, cfg: TrainConfig, r: int, source: str) -> list[LoraRow]:
    """An adapter's tensors against the base model's config and the rank: every key one of the table's, each
    target present in every block with both factors, every shape the one r and the weight imply. The rows
    present, in file order."""
    rows = lora_table(cfg, r)
    known = {name: row for row in rows for name in (row.a, row.b)}
    block_0 = {key.format(i=0, f=f) for key, _ in LORA_TABLE.values() for f in "AB"}
    for key in state:
        if key in known:
            continue
        i = block_index(key)
        if i is not None and renumber_block(key, -i) in block_0:  # a factor of a block the base lacks
            raise MiniStreamError(
                f"{source}: {key} is for block {i}, but the base model has n_layers={cfg.n_layers}: "
                "is the adapter for another base model? Give the one it was trained on"
            )
        raise MiniStreamError(
            f"{source}: {key!r} is not a LoRA factor of format 1's adapters, which update "
            f"{', '.join(LORA_TABLE)} (keys like {LORA_TABLE['Wqkv'][0].format(i=0, f='A')})"
        )
    targets = {known[k].target for k in state}
    present = [row for row in rows if row.target in targets]
    missing = [name for row in present for name in (row.a, row.b) if name not in state]
    if missing:
        raise MiniStreamError(
            f"{source}: missing {len(missing)} tensor(s), first {missing[0]!r}: an adapter updates each of its "
            f"targets ({', '.join(sorted(targets))}) in all {cfg.n_layers} blocks with lora_A and lora_B; is the "
            "file cut short, or for another base model?"
        )
    for row in present:
        for name, want, what in ((row.a, row.a_shape, "[r, in]"), (row.b, row.b_shape, "[out, r]")):
            got = tuple(state[name].shape)
            if got != want:
                raise MiniStreamError(
                    f"{source}: {name} has shape {list(got)}, but r={r} and the base model's {row.base} "
                    f"{list(row.b_shape[:1] + row.a_shape[1:])} imply {what} = {list(want)}: is the adapter for "
                    "another base model, or its config's r wrong?"
                )
    return present
