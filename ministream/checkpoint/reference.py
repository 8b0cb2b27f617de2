"""The MiniStream reference model: format 1's math in plain PyTorch, with a KV cache and batched generation.

This is the definition every other stage is checked against (docs/format.md, "The math"),
and the stand-in for the team's original single-request inference script. Read top to bottom:
RMSNorm, RoPE, attention, MLP, block, model, generation.

Weights are used in whatever dtype they are stored in, each cast to the compute dtype (the activations')
only as its layer runs: a model kept as the checkpoint stores it (`stream=True`, mmap'd from model.pt)
computes in float32 without ever holding a float32 copy of all its weights.

Shapes: B batch, T new tokens, S cached + new tokens, H d_model, Nq/Nkv heads, D head_dim, V vocab.
"""

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..spec import TrainConfig
from .format import load
from .lora import load_for, updates
from .weights import OnDisk, Packed


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # in float32 (weight included), then back to the input dtype, exactly as the format says
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of p*theta_i for each position, theta_i = theta^(-2i/D), repeated over both halves: (B, T, D)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (D/2,)
    angles = positions.double()[..., None] * inv_freq  # (B, T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, T, D)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, heads, T, D); cos/sin: (B, T, D), broadcast over heads
    xf = x.float()
    return (xf * cos[:, None] + rotate_half(xf) * sin[:, None]).to(x.dtype)


class KVCache:
    """Preallocated keys and values for every layer: (B, Nkv, max_len, D) each; `length` columns filled."""

    def __init__(self, cfg: TrainConfig, batch: int, max_len: int, dtype: torch.dtype, device="cpu"):
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, weight(x, layer))


def weight(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    # the weight in x's dtype for this product only (a no-op where it is stored so): the same values as a model
    # cast whole up front, with one weight's copy alive at a time; one kept with its folder (weights.Packed: the
    # folder's bytes, dequantized; weights.OnDisk: read from its file; set by from_state) made now
    return stored_weight(layer).to(x.dtype)


def stored_weight(layer: nn.Linear) -> torch.Tensor:
    """The layer's weight as stored: its parameter, or made now from what keeps it with its folder."""
    kept = getattr(layer, "kept", None)
    return layer.weight if kept is None else kept.tensor()


HEAD_SLICE = 4096  # vocabulary rows of the head cast at a time


def head_logits(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """x @ head.T in float32 (B, T, V), the head cast to x's dtype a slice of the vocabulary at a time, whatever its
    dtype, so that a streamed model and one cast whole compute alike: the head is the largest tensor, and its float32
    copy at every step (twice a bfloat16 embedding's bytes) was the streamed reference model's largest allocation."""
    logits = torch.empty((*x.shape[:-1], head.shape[0]), dtype=torch.float32)
    for start in range(0, head.shape[0], HEAD_SLICE):
        part = head[start : start + HEAD_SLICE].to(x.dtype)
        logits[..., start : start + HEAD_SLICE] = x @ part.T
    return logits


def norm_weight(x: torch.Tensor, norm: "NormWeight") -> torch.Tensor:
    return norm.weight.to(x.dtype)  # rounded to the compute dtype first, as a model cast whole would have it


class Attention(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.cfg = cfg
        self.Wqkv = nn.Linear(cfg.d_model, sum(cfg.qkv_sizes), bias=False)
        self.out_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int):
        c = self.cfg
        B, T, _ = x.shape
        q, k, v = linear(x, self.Wqkv).split(c.qkv_sizes, dim=-1)
        q = q.view(B, T, c.n_heads, c.head_dim).transpose(1, 2)  # (B, Nq, T, D)
        k = k.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Nkv, T, D)
        v = v.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Nkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, Nkv, S, D)
        # kv head j serves query heads j*G ... (j+1)*G-1
        G = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, Nq, S, D)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(c.head_dim))
        return linear(o.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim), self.out_proj)


class MLP(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.d_ff = cfg.d_ff
        self.w12 = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)  # rows: gate, then up
        self.w3 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        g, u = linear(x, self.w12).split(self.d_ff, dim=-1)
        return linear(F.silu(g) * u, self.w3)


class NormWeight(nn.Module):
    """An RMSNorm's weight, ones at first (rmsnorm applies it): state-dict key `<name>.weight`."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class Block(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.norm1 = NormWeight(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = NormWeight(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer):
        x = x + self.attn(rmsnorm(x, norm_weight(x, self.norm1), self.eps), cos, sin, mask, cache, layer)
        return x + self.mlp(rmsnorm(x, norm_weight(x, self.norm2), self.eps))


class MiniStream(nn.Module):
    """Parameter names are format 1's state-dict keys, so a training checkpoint loads as it is."""

    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = NormWeight(cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.compute_dtype: torch.dtype | None = None  # None: the weights' own (a model cast whole)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        overrides=None,
        adapter: str | Path | None = None,
        stream: bool = False,
    ) -> "MiniStream":
        """The model of a training checkpoint; with `adapter` (a LoRA adapter.pt or its folder), merged into it.
        stream: see from_state."""
        cfg, ckpt = load(path, overrides)
        model = cls.from_state(cfg, ckpt.state, dtype, stream=True)
        if adapter is not None:  # merged in the stored dtype, then cast
            lora, rows = load_for(adapter, cfg)
            model.merge_lora(updates(lora, rows), lora.scaling)
        return model if stream else model.cast(dtype)

    @classmethod
    def from_state(cls, cfg: TrainConfig, state: dict, dtype: torch.dtype, stream: bool = False) -> "MiniStream":
        """The model on `state`'s tensors themselves (training names), computing in `dtype`. stream=False: the
        weights cast to `dtype` whole; stream=True: kept as they are (model.pt's stay mmap'd, read as they are
        used; a folder's linear weights in its files, read_folder's stream), each cast while its layer runs: the
        same outputs, one weight's copy at a time."""
        with torch.device("meta"):  # no initial weights: the state's replace them (a float32 model's worth)
            model = cls(cfg)
        kept = {k: v for k, v in state.items() if isinstance(v, Packed | OnDisk)}
        if not stream:  # cast whole: a weight kept with its folder read (and dequantized) once, here
            state = {k: v.tensor() if k in kept else v for k, v in state.items()}
            kept = {}
        # a kept weight's parameter is a shape on the meta device; its layer computes from what keeps it (weight())
        meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in kept.items()}
        model.load_state_dict({**state, **meta}, strict=True, assign=True)
        for k, v in kept.items():
            model.get_submodule(k.removesuffix(".weight")).kept = v  # type: ignore[assignment]  # not a Parameter
        model.compute_dtype = dtype
        return model.eval() if stream else model.cast(dtype)

    def cast(self, dtype: torch.dtype) -> "MiniStream":
        """Every weight cast to `dtype` now (a copy where it is stored otherwise); computing in it."""
        self.compute_dtype = None
        return self.to(dtype).eval()

    @torch.no_grad()
    def merge_lora(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """W += scaling * B @ A for each weight named by its training key, A [r, in] and B [out, r]: the
        model a LoRA adapter makes (format.md, "LoRA adapters"), summed in float32. Each weight gets new
        storage: a weight still mapped from model.pt is never written."""
        params = dict(self.named_parameters())
        for name, (a, b) in factors.items():
            w = params[name]
            w.data = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the activations', the KV cache's."""
        return self.compute_dtype or self.embedding.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `ids` (B, T) -> (B, T, H) in the compute dtype: only their rows are read and cast."""
        return F.embedding(ids, self.embedding.weight).to(self.dtype)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        cache: KVCache | None = None,
        hidden_states: list | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) in float32 for `ids` (B, T).

        positions (B, T): RoPE positions, default 0..T-1 after the cache. key_valid (B, S): False for
        padding among the cached + new keys. hidden_states: if a list, each block's output is appended.
        """
        B, T = ids.shape
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + T).expand(B, T)
        causal = torch.ones(T, past + T, dtype=torch.bool).tril(past)  # (T, S): key s visible to query t
        mask = causal[None, None]  # (1, 1, T, S)
        if key_valid is not None:
            mask = mask & key_valid[:, None, None, : past + T]
            # a padding query sees no key at all; let it see itself so softmax stays finite (its output is unused)
            mask = mask | (torch.arange(past + T)[None, :] == past + torch.arange(T)[:, None])[None, None]
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)

        x = self.embed(ids)  # (B, T, H)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask, cache, i)
            if hidden_states is not None:
                hidden_states.append(x.detach().clone())
        if cache is not None:
            cache.length += T
        x = rmsnorm(x, norm_weight(x, self.norm_f), self.cfg.norm_eps)
        head = self.embedding.weight if self.lm_head is None else stored_weight(self.lm_head)
        return head_logits(x, head)  # (B, T, V)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_ids=(),
        logprobs: int = 0,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[dict]:
        """Batched generation with a KV cache; temperature 0 is greedy.

        Prompts are left-padded to a common length so every sequence writes the same cache column each
        step; RoPE positions count only real tokens. Returns one dict per prompt: `ids` (new token ids,
        ending at the first stop id) and, with logprobs=k, `logprobs`: per new token the top-k
        {token id: logprob} of the float32 log-softmax. on_token(b, id), if given, is called as each new
        token of prompt b is chosen (a server streams with it).
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        B, P = len(prompts), max(len(p) for p in prompts)
        total = P + max_new_tokens
        if total > self.cfg.max_seq_len:
            raise ValueError(f"prompt + new tokens = {total} exceeds max_seq_len {self.cfg.max_seq_len}")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None

        ids = torch.zeros(B, P, dtype=torch.long)
        key_valid = torch.zeros(B, total, dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, P - len(p) :] = torch.tensor(p)
            key_valid[b, P - len(p) :] = True
        key_valid[:, P:] = True  # generated tokens
        positions = (key_valid[:, :P].long().cumsum(-1) - 1).clamp(min=0)  # (B, P)
        next_pos = key_valid[:, :P].sum(-1)  # (B,)

        cache = KVCache(self.cfg, B, total, self.dtype)
        logits = self(ids, positions, key_valid, cache)[:, -1]  # (B, V)
        out: list[dict[str, list]] = [{"ids": [], "logprobs": []} for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        for step in range(max_new_tokens):
            lp = torch.log_softmax(logits, dim=-1)
            token = self._pick(logits, temperature, top_k, top_p, gen)  # (B,)
            for b in range(B):
                if done[b]:
                    continue
                out[b]["ids"].append(int(token[b]))
                if on_token is not None:
                    on_token(b, int(token[b]))
                if logprobs:
                    top = lp[b].topk(logprobs)
                    out[b]["logprobs"].append({int(i): float(v) for i, v in zip(top.indices, top.values)})
                if int(token[b]) in stop_ids:
                    done[b] = True
            if done.all() or step == max_new_tokens - 1:
                break
            logits = self(token[:, None], next_pos[:, None] + step, key_valid, cache)[:, -1]
        return out

    @staticmethod
    def _pick(logits, temperature, top_k, top_p, gen) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        logits = logits / temperature
        if top_k:
            kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest prefix reaching top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=gen)[:, 0]
