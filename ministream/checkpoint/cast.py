"""The one check of every writer that narrows a tensor's dtype (convert's safetensors, gguf's f16, bf16, q8_0 and
q4_0, quantize's scales and values): the values the output will hold are finite, or the tensor is refused by name
and width. Each writer calls it before the tensor's bytes go out, into atomic.new_folder's or new_file's
temporary, so a refusal leaves no output behind.

What is held is what the output holds, not what was given: a float16 cast overflows above 65504, and a block
format's float16 scale (gguf's q8_0 and q4_0: the block's largest |value| / 127 or / 8) overflows long before its
values would, so gguf hands over its blocks dequantized.
"""

import torch

from .. import MiniStreamError


def check_cast(
    name: str,
    source: torch.Tensor,
    written: torch.Tensor,
    width: str,
    wider: str,
    nonfinite: str | None,
    source_name: str | None = None,
) -> None:
    """Refuse the tensor `name` unless every value `source` (`source_name`, default `name`) becomes in the output
    (`written`, at `width`) is finite. NaN or Inf already in `source` are the source's fault (`nonfinite`: what to
    do; None: the user has allowed them); otherwise the width overflowed (`wider`: the widths that hold it)."""
    if bool(torch.isfinite(written).all()):
        return
    if not bool(torch.isfinite(source).all()):
        if nonfinite is None:
            return
        raise MiniStreamError(
            f"{source_name or name} holds NaN or Inf values: the run diverged, or the file is damaged; {nonfinite}"
        )
    bad = int((~torch.isfinite(written)).sum())
    big = float(source.abs().max())
    raise MiniStreamError(
        f"{name}: {width} overflows ({bad} values become NaN or Inf; |value| up to {big:.4g}, beyond what "
        f"{width} holds): {wider}"
    )
