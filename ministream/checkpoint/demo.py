"""Write format-1 training checkpoints, as MiniStream's trainer would, for tests, the demo and benchmarks.

Each preset is a shape plus a short deterministic training run on the text bundled in
ministream/data/corpus.txt. Random weights give near-uniform next-token distributions, whose
greedy choices flip on rounding noise; a few hundred steps of real training make them peaked, so
greedy comparisons between implementations are meaningful. Flags make the variants a real user's
checkpoint may have: GQA, another head_dim, an untied head, a padded vocabulary, DDP/compile key
prefixes, blocks numbered from 1, no config entry, optimizer state, bfloat16 tensors, and the sharded form
that N ranks of an FSDP run save (`ranks`: torch.distributed.checkpoint's folder, written by N real ranks).

`make_adapter` (`ministream checkpoint --adapter BASE`) writes a LoRA adapter.pt for a checkpoint, as the
trainer saves one: random, seeded factors whose update is large enough to change the greedy outputs.
"""

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .. import MiniStreamError, spec
from ..atomic import new_file, new_folder
from ..paths import CORPUS
from ..spec import LORA_TABLE, TrainConfig, lora_table, renumber_block
from . import reference
from .format import ADAPTER_FILE, SHARDED_DIR, load, save_checkpoint
from .lora import check_r_alpha
from .reference import Block, MiniStream
from .sharded import save_sharded

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]  # ids 0, 1, 2

# name: (train config without vocab/bos/eos, tokenizer vocab target, training steps)
TINY = dict(d_model=128, n_layers=2, n_heads=2, d_ff=384, max_seq_len=512)
REFERENCE = dict(d_model=768, n_layers=8, n_heads=12, d_ff=2048, max_seq_len=2048, vocab_size=32000)
PRESETS = {
    # fast tests: head_dim 64 because vLLM's CPU attention kernels do not take 16 or 32
    "tiny": (TINY, 512, 300),
    # GQA, head_dim != d_model / n_heads, untied head, padded vocabulary: every variant in one model
    "tiny-gqa": (dict(TINY, n_heads=4, n_kv_heads=2, head_dim=64, tie_embeddings=False, vocab_size=576), 512, 300),
    "demo": (dict(d_model=192, n_layers=4, n_heads=3, d_ff=512, max_seq_len=1024), 1024, 250),
    # the write-up's ~132M shape, untrained: for speed, which does not depend on the weights
    "reference": (REFERENCE, 32000, 0),
    "reference-gqa": (dict(REFERENCE, n_kv_heads=4), 32000, 0),
    # the same shape trained, for accuracy (a quantized width has a trained model's peaked outputs to keep):
    # about 10 s a step on 2 cores, so made once under --cache
    "reference-trained": (REFERENCE, 32000, 150),
}
COMMON = dict(norm_eps=1e-6, rope_theta=10000.0)
# --prefix: the keys as DistributedDataParallel (module.) and torch.compile (_orig_mod.) save them
KEY_PREFIXES = {"none": "", "ddp": "module.", "compile": "_orig_mod.", "both": "module._orig_mod."}


def train_tokenizer(vocab_size: int, corpus: Path = CORPUS) -> Tokenizer:
    """Byte-level BPE on the bundled text; deterministic for a given corpus and vocab size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus.read_text().split("\n\n"), trainer)
    # prompts start with <|bos|>, as in training
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", 0)]
    )
    return tok


def make_config(preset: str, tok: Tokenizer, **overrides) -> TrainConfig:
    shape, _, _ = PRESETS[preset]
    values = {**COMMON, **shape, **{k: v for k, v in overrides.items() if v is not None}}
    # pad the vocabulary to a multiple of 64, as trainers do for fast matmuls
    values.setdefault("vocab_size", math.ceil(tok.get_vocab_size() / 64) * 64)
    values.setdefault("head_dim", 64)
    return TrainConfig(bos_id=0, eos_id=1, **values)


def train(
    model: MiniStream, tok: Tokenizer, steps: int, seed: int, corpus: Path = CORPUS, log=print
) -> torch.optim.Optimizer:
    """Next-token training on the corpus: every paragraph ends with <|eos|>."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for para in corpus.read_text().split("\n\n"):
        ids += tok.encode(para.strip()).ids + [1]
    data = torch.tensor(ids)
    seq, batch = min(64, model.cfg.max_seq_len - 1), 32
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    t0 = time.time()
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq] for s in starts])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"  step {step + 1}/{steps}  loss {loss.item():.3f}  ({time.time() - t0:.1f}s)")
    model.eval()
    return opt


def init_weights(model: MiniStream, seed: int) -> None:
    """GPT-2's init: N(0, 0.02), the projections that write into the residual stream scaled by 1/sqrt(2L);
    the norms' weights stay ones."""
    g = torch.Generator().manual_seed(seed)
    blocks = [b for b in model.blocks if isinstance(b, Block)]
    into_residual = {id(p) for b in blocks for p in (b.attn.out_proj.weight, b.mlp.w3.weight)}
    for p in model.parameters():
        if p.ndim == 1:
            continue  # a norm's weight
        std = 0.02 / math.sqrt(2 * model.cfg.n_layers) if id(p) in into_residual else 0.02
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def make_checkpoint(
    out: Path,
    preset: str = "tiny",
    steps: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
    prefix: str = "none",
    one_based: bool = False,
    bare: bool = False,
    optimizer: bool = True,
    force: bool = False,
    log=print,
    cache: Path | None = None,
    ranks: int | None = None,
    **overrides,
) -> TrainConfig:
    """Write `out/model.pt` and `out/tokenizer.json`; returns the train config. cache: a folder where the trained
    weights are kept (trained_file) and taken from the next time, instead of training the same model again.
    ranks: instead of model.pt, the sharded form N ranks save (format.md, "Sharded checkpoints"):
    `out/checkpoint/` and `out/config.json` (`bare`: none), the optimizer's moments sharded beside the weights."""
    if ranks is not None and ranks < 1:
        raise MiniStreamError(f"--ranks {ranks}: a sharded checkpoint is written by 1 or more ranks")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    _, tok_vocab, default_steps = PRESETS[preset]
    steps = default_steps if steps is None else steps
    torch.manual_seed(seed)
    tok = train_tokenizer(tok_vocab)
    cfg = make_config(preset, tok, **overrides)
    log(
        f"checkpoint: preset {preset}, {cfg.n_layers} layers, d_model {cfg.d_model}, heads {cfg.n_heads}/"
        f"{cfg.n_kv_heads} (q/kv), head_dim {cfg.head_dim}, vocab {cfg.vocab_size} "
        f"(tokenizer {tok.get_vocab_size()}), {'tied' if cfg.tie_embeddings else 'untied'}; training {steps} steps"
    )
    model = MiniStream(cfg)
    init_weights(model, seed)
    given = {k: v for k, v in overrides.items() if v is not None}  # the CLI passes each option, None when unset
    kept = trained_file(cache, preset, steps, seed, given) if cache is not None and steps else None
    if kept is not None and kept.is_file():
        log(f"checkpoint: the trained weights from {kept}")
        saved = torch.load(kept, weights_only=True)
        model.load_state_dict(saved["model"])
        opt_state = saved["optimizer"]
    else:
        opt = train(model, tok, steps, seed, log=log) if steps else None
        opt_state = opt.state_dict() if opt is not None else None
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            with new_file(kept) as partial:
                torch.save({"model": model.state_dict(), "optimizer": opt_state}, partial)

    state = {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    if one_based:
        state = {renumber_block(k, +1): v for k, v in state.items()}
    key_prefix = KEY_PREFIXES[prefix]
    state = {key_prefix + k: v for k, v in state.items()}
    extra: dict[str, Any] = {"step": steps}
    if optimizer and opt_state is not None:
        extra["optimizer"] = opt_state
    with new_folder(out, force) as tmp:
        if ranks is None:
            save_checkpoint(tmp / "model.pt", state, None if bare else cfg, extra)
        else:
            sharded = {"model": state}
            if "optimizer" in extra:  # as torchtitan saves it: the moments keyed by parameter name
                sharded["optimizer"] = named_optimizer(extra["optimizer"], [n for n, _ in model.named_parameters()])
            save_sharded(tmp / SHARDED_DIR, sharded, ranks)
            if not bare:
                (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        tok.save(str(tmp / "tokenizer.json"))
    written = "model.pt" if ranks is None else f"{SHARDED_DIR}/ ({ranks} ranks)" + ("" if bare else ", config.json")
    log(
        f"checkpoint: wrote {out}/{written} ({sum(v.numel() for v in model.parameters()) / 1e6:.1f}M parameters, "
        f"{dtype}) and tokenizer.json"
    )
    return cfg


def named_optimizer(opt_state: dict, names: list[str]) -> dict:
    """torch.optim's state dict, whose parameters are numbered, keyed by parameter name instead, as FSDP trainers
    save it (torch.distributed.checkpoint.state_dict.get_optimizer_state_dict)."""
    return {
        "state": {names[i]: dict(s) for i, s in opt_state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in opt_state["param_groups"]],
    }


def trained_file(cache: Path, preset: str, steps: int, seed: int, overrides: dict) -> Path:
    """Where `cache` keeps one training run's weights: named by everything the run depends on, the code that
    trains (this module, the reference model, spec), the corpus and torch's version included, so a change to
    any of them trains anew."""
    h = hashlib.sha256(repr((preset, steps, seed, sorted(overrides.items()), torch.__version__)).encode())
    for source in (Path(__file__), Path(reference.__file__), Path(spec.__file__), CORPUS):
        h.update(source.read_bytes())
    return Path(cache) / "trained" / f"{preset}-{h.hexdigest()[:16]}.pt"


def make_adapter(
    base: Path,
    out: Path,
    rank: int = 8,
    alpha: float = 16.0,
    targets=tuple(LORA_TABLE),
    strength: float = 0.5,
    seed: int = 0,
    dtype: str = "float32",
    prefix: str = "none",
    force: bool = False,
    log=print,
) -> None:
    """Write `out/adapter.pt` for the training checkpoint `base` as MiniStream's trainer saves a LoRA adapter
    ({"lora": ..., "config": {"r", "alpha"}}), for `targets` (LORA_TABLE's keys) in every block. Not trained:
    A and B are seeded Gaussians, B scaled so that each update (alpha / r) * B @ A has `strength` times the
    Frobenius norm of the weight it updates: a model whose greedy outputs differ visibly from the base's."""
    check_r_alpha(rank, alpha, "--rank/--alpha: the adapter's config")  # what convert-lora will read back
    unknown = [t for t in targets if t not in LORA_TABLE]
    if unknown or not targets:
        raise MiniStreamError(
            f"adapter targets {list(targets)}, rank {rank}: give a rank of 1 or more and targets among "
            f"{', '.join(LORA_TABLE)}"
        )
    cfg, ckpt = load(base)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for row in lora_table(cfg, rank, targets):
        a = torch.randn(row.a_shape, generator=g) / math.sqrt(row.a_shape[1])
        b = torch.randn(row.b_shape, generator=g)
        b *= strength * ckpt.state[row.base].float().norm() / ((alpha / rank) * (b @ a)).norm()
        state[KEY_PREFIXES[prefix] + row.a] = a.to(getattr(torch, dtype))
        state[KEY_PREFIXES[prefix] + row.b] = b.to(getattr(torch, dtype))
    with new_folder(out, force, [Path(base)]) as tmp:
        torch.save({"lora": state, "config": {"r": rank, "alpha": alpha}}, tmp / ADAPTER_FILE)
    log(
        f"checkpoint: wrote {out}/{ADAPTER_FILE} (LoRA r {rank}, alpha {alpha:g}, {', '.join(targets)} in "
        f"{cfg.n_layers} blocks, strength {strength:g}, {dtype}) for {base}"
    )
