"""A folder's fingerprint: what its model computes for one short fixed prompt, recorded when the folder is written.

`ministream convert` and `ministream quantize` (and `ministream fingerprint` for a folder written before them)
record in the folder FILE: the prompt's token ids, the reference model's greedy new token ids and each step's
top-k logprobs, computed in float32 on the folder's own weights (a quantized folder's dequantized, as vLLM
multiplies by them), and a digest of the weight files it read. A server that answers the same prompt ids with
other tokens computes another model: random weights, an override of the config, another RoPE, a kernel that
fails (run/fingerprint.py holds a server to it, by the rule for the width it serves).

Cheap at any model size: one prompt of a few tokens and NEW_TOKENS steps of the reference model, on weights
read once; the digest reads each safetensors file's header only (names, sizes, the header's sha256), not the
weights, so that a probe may check it every few seconds. It tells a fingerprint of another folder (other
tensors, shapes, dtypes or files: a stale shard) from this one's; weights replaced in place with the same shapes
pass the digest and fail at the engine, which is where their tokens differ.

Nothing here imports torch at module level: `ministream ready` reads and digests fingerprints in a probe.
"""

import hashlib
import json
import math
from pathlib import Path

from .. import MiniStreamError, __version__
from ..spec import FORMAT_VERSION

FILE = "ministream-fingerprint.json"
VERSION = 1  # the file's own layout
PROMPT = "The river runs through"  # tokenized by the folder's own tokenizer.json; the ids are what is sent
NEW_TOKENS = 8
TOP_K = 5  # verify's golden files' k: vLLM's rule compares the first difference against it
DIGEST = "each *.safetensors file's name, size and the sha256 of its header (tensor names, dtypes, shapes, offsets)"


class ContextTooShort(MiniStreamError):
    """The model's context cannot hold the fingerprint's prompt and new tokens."""


def weights_digest(folder: Path) -> dict[str, dict]:
    """{file name: {"size", "header_sha256"}} of every *.safetensors file in `folder` (headers only)."""
    files: dict[str, dict] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                header = f.read(min(n, 100_000_000))  # safetensors' own limit on a header
            size = path.stat().st_size
        except OSError as e:
            raise MiniStreamError(f"{path} cannot be read ({e.strerror}): check the file's permissions") from None
        files[path.name] = {"size": size, "header_sha256": hashlib.sha256(head + header).hexdigest()}
    return files


def digest_differences(recorded: dict, now: dict) -> list[str]:
    """What differs between a fingerprint's digest and the folder's, in words ([] when none)."""
    found = [f"{name} is gone" for name in sorted(set(recorded) - set(now))]
    found += [f"{name} was added" for name in sorted(set(now) - set(recorded))]
    for name in sorted(set(recorded) & set(now)):
        if recorded[name] != now[name]:
            r, n = recorded[name], now[name]
            found.append(
                f"{name} is {n['size']} bytes, recorded {r['size']}"
                if r.get("size") != n["size"]
                else f"{name}'s header (tensor names, dtypes or shapes) changed"
            )
    return found


def prompt_ids(folder: Path) -> list[int]:
    """PROMPT in the folder's own tokenizer.json (what a server started on the folder tokenizes it to)."""
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise MiniStreamError(f"{path}: no such file; convert the checkpoint again (make convert)")
    return Tokenizer.from_file(str(path)).encode(PROMPT).ids


def compute(folder: Path) -> dict:
    """The fingerprint of a converted (or quantized) folder: the reference model in float32 on its weights."""
    import torch

    from .reference import MiniStream
    from .weights import read_folder

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    cfg, state = read_folder(folder, stream=True)  # the linear weights read (and dequantized) as they run
    ids = prompt_ids(folder)
    if len(ids) + NEW_TOKENS > cfg.max_seq_len:
        raise ContextTooShort(
            f"{folder}: max_position_embeddings {cfg.max_seq_len} is shorter than the fingerprint's "
            f"{len(ids)} prompt tokens + {NEW_TOKENS} new ones"
        )
    # the weights kept as stored, each layer's cast to float32 only while it runs: the same values as a model cast
    # whole (test_scale_verify), without a float32 copy of every weight beside the stored one
    model = MiniStream.from_state(cfg, state, torch.float32, stream=True)
    with torch.no_grad():
        out = model.generate([ids], NEW_TOKENS, logprobs=TOP_K)[0]
    quantization = config.get("quantization_config")
    return {
        "fingerprint_version": VERSION,
        "format_version": FORMAT_VERSION,
        "created_by": f"ministream {__version__}",
        "prompt": PROMPT,
        "prompt_ids": ids,
        "new_tokens": NEW_TOKENS,
        "top_k": TOP_K,
        "computed_in": "float32",
        # the width the weights are stored in: their dtype, or the quantize scheme (then dequantized)
        "stored": config.get("dtype") or config.get("torch_dtype"),
        "quantized": _scheme(config, folder) if quantization else None,
        "digest": DIGEST,
        "weights": weights_digest(folder),
        "ids": out["ids"],
        "logprobs": [{str(t): lp for t, lp in step.items()} for step in out["logprobs"]],
    }


def _scheme(config: dict, folder: Path) -> str:
    from .scheme import scheme_name

    return scheme_name(config, folder / "config.json")


def record(folder: Path, log=None) -> dict | None:
    """Compute the folder's fingerprint and write FILE into it: for a writer's temporary folder, which appears
    whole or not at all (atomic.new_folder); `refresh` writes an existing folder's."""
    try:
        fp = compute(folder)
    except ContextTooShort as e:  # a model trained on a context shorter than the check: served unchecked
        (Path(folder) / FILE).unlink(missing_ok=True)
        if log:
            log(f"note: {e}: no fingerprint recorded")
        return None
    if not all(math.isfinite(lp) for step in fp["logprobs"] for lp in step.values()):
        (Path(folder) / FILE).unlink(missing_ok=True)  # a source's, copied with the folder's other files
        if log:
            log(f"note: {folder}: the reference model's logprobs are not finite: no fingerprint recorded")
        return fp
    (Path(folder) / FILE).write_text(json.dumps(fp, indent=1) + "\n")
    return fp


def read(folder: Path) -> dict | None:
    """The folder's fingerprint; None where it has none; MiniStreamError naming the file where it is not one."""
    path = Path(folder) / FILE
    try:
        fp = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise MiniStreamError(
            f"{path} cannot be read ({e}): record it again, ministream fingerprint {folder}"
        ) from None
    keys = ("fingerprint_version", "prompt_ids", "ids", "logprobs", "weights", "top_k")
    if not isinstance(fp, dict) or any(k not in fp for k in keys):
        raise MiniStreamError(f"{path} is not a fingerprint: record it again, ministream fingerprint {folder}")
    if fp["fingerprint_version"] != VERSION:
        raise MiniStreamError(
            f"{path}: fingerprint_version {fp['fingerprint_version']!r}, this ministream reads {VERSION}: "
            f"record it again, ministream fingerprint {folder}"
        )
    ok = (
        isinstance(fp["prompt_ids"], list)
        and fp["prompt_ids"]
        and all(type(t) is int for t in fp["prompt_ids"])
        and isinstance(fp["ids"], list)
        and fp["ids"]  # no new token: serve's check would compare nothing and pass
        and all(type(t) is int for t in fp["ids"])
        and isinstance(fp["logprobs"], list)
        and len(fp["logprobs"]) == len(fp["ids"])
        and all(isinstance(s, dict) for s in fp["logprobs"])
        and isinstance(fp["weights"], dict)
    )
    if not ok:
        raise MiniStreamError(
            f"{path} is damaged (its ids or logprobs): record it again, ministream fingerprint {folder}"
        )
    return fp


def stale(folder: Path, fp: dict) -> str | None:
    """Why `fp` is not this folder's fingerprint (its weight files differ from those it was computed on), or None."""
    found = digest_differences(fp["weights"], weights_digest(folder))
    if not found:
        return None
    return (
        f"{Path(folder) / FILE} was recorded for other weights ({'; '.join(found[:3])}): it is another folder's "
        f"fingerprint, or the folder changed since; if these are the weights you mean, record it anew: "
        f"ministream fingerprint {folder}"
    )
