# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MiniStream's debug dump for `ministream verify`, called from ministream.py.

MINISTREAM_DUMP_HIDDEN=dir (eager mode only): a forward pass holding a prompt's
first token (position 0) saves its input ids, positions, the embeddings and
every layer's output to dir/forward-<pid>-<n>.pt, and the logits computed after
it to dir/logits-<pid>-<n>.pt. A layer's output is the residual stream,
hidden_states + residual: the reference model's block output.

DUMP_DIR is read once, at import: unset, it is None, start() returns None and
the model's `if dump is not None` branches are never taken (torch.compile sees
a constant), so the dump costs nothing.
"""

from __future__ import annotations  # the annotations below on Python 3.8 (vLLM 0.6)

import os

import torch

DUMP_DIR = os.environ.get("MINISTREAM_DUMP_HIDDEN") or None
# n: the dumped forward passes so far; pending: whether the last forward pass
# was dumped, so that the logits computed after it are too
_dumped = {"n": 0, "pending": False}


def start(hidden_states: torch.Tensor) -> list[torch.Tensor] | None:
    """The list a forward pass collects its layers' outputs in, the embeddings
    first; None when not dumping."""
    if not DUMP_DIR:
        return None
    # cloned: the first layer's fused add-norm writes into the embeddings in place
    return [hidden_states.clone()]


def save_forward(
    input_ids: torch.Tensor | None,
    positions: torch.Tensor,
    hidden: list[torch.Tensor],
) -> None:
    _dumped["pending"] = bool((positions == 0).any())
    _dumped["n"] += _dumped["pending"]
    _save("forward", input_ids=input_ids, positions=positions, hidden=hidden)


def save_logits(logits: torch.Tensor) -> None:
    _save("logits", logits=logits)


def _save(kind: str, **tensors) -> None:
    if not _dumped["pending"]:
        return
    os.makedirs(DUMP_DIR, exist_ok=True)
    saved = {
        k: [t.float().cpu() for t in v] if isinstance(v, list) else v.float().cpu()
        for k, v in tensors.items()
        if v is not None
    }
    torch.save(saved, f"{DUMP_DIR}/{kind}-{os.getpid()}-{_dumped['n']}.pt")
