"""Perplexity on held-out text, computed the way llama.cpp's `llama-perplexity` computes it, so that the
reference model, vLLM (run/vllm_perplexity.py) and llama.cpp (bench/llamacpp.py) are measured alike at every width.

The text is tokenized as a prompt is (the folder's tokenizer.json, BOS where it adds one) and cut into chunks
of n_ctx tokens, the rest dropped; where the tokenizer adds BOS, each chunk's first token is BOS. Of each
chunk the second half is scored: the logits at positions n_ctx/2 .. n_ctx-2 predict the tokens after them,
so every scored token has n_ctx/2 tokens of context or more. Perplexity = exp(mean negative log-likelihood).
(llama.cpp: tools/perplexity/perplexity.cpp, `perplexity()`: first = n_ctx/2, count += n_ctx - first - 1.)
The default text, ministream/data/heldout.txt, is paragraphs in the demo corpus's style that the demo models
never trained on; a user's own model is better judged on text of its own kind (--text).
"""

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import MiniStreamError
from ..paths import HELDOUT

N_CTX = 256  # each chunk, at most the model's context


@dataclass
class Chunks:
    ids: list[list[int]]  # each n_ctx tokens
    first: int  # the first scored logit's position: n_ctx // 2
    text: str  # the text's path

    @property
    def scored(self) -> int:
        return len(self.ids) * (len(self.ids[0]) - self.first - 1)

    def record(self) -> dict:
        """What a perplexity is of, to compare it with another's."""
        text = Path(self.text)
        sha = hashlib.sha256(text.read_bytes()).hexdigest() if text.is_file() else None
        return {"text": self.text, "sha256": sha, "n_ctx": len(self.ids[0]), "scored": self.scored}


def chunks(folder: Path, text: Path | None = None, n_ctx: int = N_CTX, max_len: int | None = None) -> Chunks:
    """The scored chunks of `text` (default: the held-out text) for the folder's tokenizer; n_ctx at most
    max_len (the model's context)."""
    from tokenizers import Tokenizer

    text = Path(text or HELDOUT)
    n_ctx = min(n_ctx, max_len or n_ctx)
    tokenizer = Path(folder) / "tokenizer.json"
    if not tokenizer.is_file():
        raise MiniStreamError(f"{tokenizer}: no such file; perplexity needs the folder's tokenizer")
    tok = Tokenizer.from_file(str(tokenizer))
    body = text.read_text()
    ids, plain = tok.encode(body).ids, tok.encode(body, add_special_tokens=False).ids
    bos = ids[0] if len(ids) > len(plain) and ids[1 : len(plain) + 1] == plain else None
    if len(ids) < 2 * n_ctx:  # llama-perplexity's own floor
        raise MiniStreamError(
            f"{text}: {len(ids)} tokens, fewer than 2 x n_ctx = {2 * n_ctx} for perplexity: give a longer text"
        )
    out = [ids[i : i + n_ctx] for i in range(0, len(ids) - n_ctx + 1, n_ctx)]
    return Chunks([[bos, *c[1:]] for c in out] if bos is not None else out, n_ctx // 2, str(text))


def from_logprobs(per_chunk: list[list[float]]) -> float:
    """Perplexity from each chunk's scored tokens' log-probabilities."""
    lps = [lp for c in per_chunk for lp in c]
    return math.exp(-sum(lps) / len(lps))


def reference_perplexity(model: torch.nn.Module, c: Chunks) -> float:
    """The reference model's (checkpoint.reference.MiniStream, in its dtype) on the chunks; log-softmax in fp32."""
    per_chunk = []
    with torch.no_grad():
        for ids in c.ids:
            x = torch.tensor([ids])
            logprobs = torch.log_softmax(model(x)[0].float(), dim=-1)
            per_chunk.append(logprobs[c.first : -1].gather(1, x[0, c.first + 1 :, None])[:, 0].tolist())
    return from_logprobs(per_chunk)


def folder_perplexity(folder: Path, c: Chunks, dtype: torch.dtype = torch.float32) -> float:
    """The reference model on a converted folder's weights (a quantized folder's dequantized, as vLLM computes
    with them), run one block at a time over every chunk: memory holds one block's weights in `dtype` and the
    chunks' hidden states, never the model (issue 56). The same math as reference_perplexity on the whole model:
    each chunk on its own, so each matmul has the shapes it has there."""
    from ..spec import EMBEDDING, FINAL_NORM, HEAD, block_index, table, train_config_from_hf
    from .folder import checked
    from .format import read_json
    from .reference import Block, rmsnorm, rope_tables
    from .weights import FolderTensors

    folder = Path(folder)
    checked(folder)  # the one folder check: the perplexities read what the server runs
    cfg = train_config_from_hf(read_json(folder / "config.json"), str(folder / "config.json"))
    tensors = FolderTensors(folder, cfg, read_json(folder / "config.json"))
    rows = table(cfg)

    def weights(layer: int | None) -> dict[str, torch.Tensor]:  # training name -> tensor, in `dtype`
        return {r.raw: tensors.raw(r).to(dtype) for r in rows if block_index(r.raw) == layer}

    T = len(c.ids[0])
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    cos, sin = rope_tables(torch.arange(T).expand(1, T), cfg.head_dim, cfg.rope_theta)
    ids = [torch.tensor([chunk]) for chunk in c.ids]
    with torch.no_grad():
        embedding = weights(None)[EMBEDDING]
        hidden = [torch.nn.functional.embedding(x, embedding) for x in ids]
        for layer in range(cfg.n_layers):
            with torch.device("meta"):  # no random initialisation of weights the block's own replace
                block = Block(cfg)
            prefix = f"blocks.{layer}."
            block.load_state_dict({k.removeprefix(prefix): v for k, v in weights(layer).items()}, assign=True)
            hidden = [block(x, cos, sin, mask, None, layer) for x in hidden]
            del block
        final = weights(None)
        head = final[EMBEDDING] if cfg.tie_embeddings else final[HEAD]
        per_chunk = []
        for x, h in zip(ids, hidden):
            logits = (rmsnorm(h, final[FINAL_NORM], cfg.norm_eps) @ head.T).float()
            logprobs = torch.log_softmax(logits[0], dim=-1)
            per_chunk.append(logprobs[c.first : -1].gather(1, x[0, c.first + 1 :, None])[:, 0].tolist())
    return from_logprobs(per_chunk)
