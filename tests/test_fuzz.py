"""Property-based fuzzing of the loader and the converter: random shapes, configs, key prefixes and
numbering, then damage (truncation, bit flips, deleted keys, hostile config values). Every case either
round-trips bit-exactly or ends in the project's own one-line error; never another exception, never a
partial or temporary folder, and the input checkpoint is never changed.

Bounded for `make test` (derandomized, so CI runs the same cases each time); FUZZ_EXAMPLES=N runs more.
"""

import hashlib
import json
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch
from hypothesis import given, strategies as st
from tokenizers import Tokenizer, models

from ministream import MiniStreamError
from ministream.checkpoint.convert import convert
from ministream.checkpoint.format import load_checkpoint
from ministream.checkpoint.weights import read_folder
from ministream.spec import TrainConfig, raw_shapes, renumber_block

from conftest import fuzz_settings

EXAMPLES = 200  # cheap (tiny checkpoints); 120 reached only four error kinds


@st.composite
def configs(draw) -> dict:
    n_kv = draw(st.integers(1, 2))
    n_heads = n_kv * draw(st.integers(1, 3))
    return dict(
        vocab_size=draw(st.integers(8, 40)),
        d_model=draw(st.sampled_from([8, 12, 16, 24])),
        n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=draw(st.sampled_from([2, 4, 6, 8])),
        d_ff=draw(st.integers(1, 24)),
        max_seq_len=64,
        norm_eps=draw(st.sampled_from([1e-5, 1e-6])),
        rope_theta=draw(st.sampled_from([1e4, 5e5])),
        tie_embeddings=draw(st.booleans()),
        bos_id=0,
        eos_id=1,
    )


HOSTILE = [
    ("d_model", "abc"),
    ("n_layers", 10**9),
    ("norm_eps", float("nan")),
    ("n_heads", 0),
    ("vocab_size", -5),
    ("tie_embeddings", "yes"),
    ("head_dim", 3.5),
    ("rope_theta", float("inf")),
    ("d_ff", [1, 2]),
    ("n_kv_heads", 7),
    ("eos_id", 10**6),
]


@st.composite
def cases(draw) -> dict:
    return dict(
        config=draw(configs()),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        prefix=draw(st.sampled_from(["", "module.", "_orig_mod.", "module._orig_mod."])),
        one_based=draw(st.booleans()),
        bare=draw(st.booleans()),
        out_dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        seed=draw(st.integers(0, 2**16)),
        damage=draw(st.sampled_from(["none", "none", "truncate", "flip", "delete_key", "hostile", "nan"])),
        where=draw(st.floats(0, 1)),
        hostile=draw(st.sampled_from(HOSTILE)),
    )


def write_checkpoint(folder: Path, case: dict) -> dict:
    """A format-1 checkpoint folder for the case, damaged as it says; returns the config flags it needs."""
    cfg = TrainConfig.from_dict(case["config"])
    g = torch.Generator().manual_seed(case["seed"])
    state = {
        k: (torch.randn(shape, generator=g) * 0.5).to(getattr(torch, case["dtype"]))
        for k, shape in raw_shapes(cfg).items()
    }
    if case["one_based"]:
        state = {renumber_block(k, +1): v for k, v in state.items()}
    if case["damage"] == "delete_key":
        del state[sorted(state)[int(case["where"] * (len(state) - 1))]]
    if case["damage"] == "nan":
        name = sorted(state)[int(case["where"] * (len(state) - 1))]
        state[name] = (
            state[name].clone().view(-1).index_fill(0, torch.tensor([0]), float("nan")).view(state[name].shape)
        )
    state = {case["prefix"] + k: v for k, v in state.items()}
    values = dict(case["config"])
    if case["damage"] == "hostile":
        values[case["hostile"][0]] = case["hostile"][1]
    folder.mkdir(parents=True)
    torch.save(state if case["bare"] else {"model": state, "config": values, "step": 3}, folder / "model.pt")
    vocab = {f"t{i}": i for i in range(min(8, cfg.vocab_size))}
    Tokenizer(models.WordLevel(vocab, unk_token="t2")).save(str(folder / "tokenizer.json"))
    data = (folder / "model.pt").read_bytes()
    if case["damage"] == "truncate":
        (folder / "model.pt").write_bytes(data[: int(case["where"] * len(data))])
    elif case["damage"] == "flip":
        bit = int(case["where"] * (len(data) * 8 - 1))
        data = bytearray(data)
        data[bit // 8] ^= 1 << (bit % 8)
        (folder / "model.pt").write_bytes(bytes(data))
    return values if case["bare"] else {}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def error_kind(message: str) -> str:
    """The error's kind: its message with the paths, names and numbers taken out."""
    text = re.sub(r"/\S+", "PATH", message)
    text = re.sub(r"\S+\.weight", "TENSOR", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\([^)]*\)", "X", text)
    return re.sub(r"[-+]?\d[\d.e+-]*", "N", text)[:80]


def check_case(case: dict, root: Path) -> str:
    """One case: converted bit-exactly, or refused in one line with nothing left behind; what it came to."""
    raw, out = root / "raw", root / "out"
    flags = write_checkpoint(raw, case)
    before = sha256(raw / "model.pt")
    try:
        convert(raw, out, dtype=case["out_dtype"], overrides=flags, log=lambda *a: None)
    except MiniStreamError as e:
        message = str(e)
        assert "\n" not in message.strip() and "Traceback" not in message, message
        assert not out.exists(), "a refused conversion left an output folder"
        outcome = error_kind(message)
    else:
        cfg, restored = read_folder(out)
        loaded = load_checkpoint(raw)  # what the loader made of the file: the canonical names
        want = {k: v.to(getattr(torch, case["out_dtype"])) for k, v in loaded.state.items()}
        assert restored.keys() == want.keys()
        for k in want:
            assert torch.equal(restored[k].view(torch.uint8), want[k].contiguous().view(torch.uint8)), k
        outcome = "(converted)"
    assert sorted(p.name for p in root.iterdir()) == sorted(["raw"] + (["out"] if out.exists() else [])), (
        "a temporary sibling was left behind"
    )
    assert sha256(raw / "model.pt") == before, "the input checkpoint changed"
    return outcome


def test_every_checkpoint_round_trips_or_is_refused_cleanly(tmp_path):
    """Every case passes check_case, and the cases reach both outcomes: conversions and at least five kinds
    of the project's own error (what they said is printed; run with -s)."""
    seen: Counter = Counter()

    @fuzz_settings(EXAMPLES)
    @given(case=cases())
    def fuzz(case):
        root = Path(tempfile.mkdtemp(dir=tmp_path))
        try:
            seen[check_case(case, root)] += 1
        finally:
            shutil.rmtree(root)

    fuzz()
    report = {
        "cases": sum(seen.values()),
        "converted": seen["(converted)"],
        "error_kinds": len(seen) - 1,
        "errors": dict(seen.most_common()),
    }
    print(json.dumps(report, indent=1))
    assert report["converted"] > 0 and report["error_kinds"] >= 5, report
