"""The one reader of `model.pt` (format.load_checkpoint, resolve_config), which every command uses: it proves
what it reads (the zip's members, dense tensors of the format's dtypes), drops no train-config key in
silence, and accepts a tied head saved the ordinary way."""

import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from ministream import MiniStreamError
from ministream.checkpoint.convert import convert
from ministream.checkpoint.demo import make_checkpoint
from ministream.checkpoint.format import load, load_checkpoint
from ministream.checkpoint.gguf import export
from ministream.checkpoint.reference import MiniStream
from ministream.checkpoint.weights import read_folder
from ministream.spec import EMBEDDING, HEAD, TrainConfig

from conftest import quiet


def untrained(tmp_path: Path, name: str = "raw", **kw) -> Path:
    out = tmp_path / name
    make_checkpoint(out, "tiny", steps=0, log=quiet, **kw)
    return out


def saved(raw: Path) -> dict:
    return torch.load(raw / "model.pt", weights_only=True)


def resave(raw: Path, obj: dict) -> None:
    torch.save(obj, raw / "model.pt")


def converted(raw: Path, out: Path, **kw) -> tuple[TrainConfig, dict, list[str]]:
    seen: list[str] = []
    convert(raw, out, log=seen.append, **kw)
    cfg, state = read_folder(out)
    return cfg, state, seen


def refused(raw: Path, out: Path, *words: str, **kw) -> str:
    with pytest.raises(MiniStreamError) as e:
        convert(raw, out, log=quiet, **kw)
    message = str(e.value)
    assert "\n" not in message, message
    for w in words:
        assert w in message, message
    assert not out.exists()
    return message


# --- the zip: every member stored, or read without mmap; never a mapped compressed member ----------


def repack(pt: Path, deflate, replace: dict | None = None) -> None:
    """Rewrite torch.save's zip with Python's zipfile, as a repacking or archiving tool does: the members
    `deflate(name)` names compressed, the rest stored; `replace` {member suffix: writer(stream)}."""
    with zipfile.ZipFile(pt) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(pt, "w") as zf:
        for name, data in members:
            method = zipfile.ZIP_DEFLATED if deflate(name) else zipfile.ZIP_STORED
            writer = next((w for suffix, w in (replace or {}).items() if name.endswith(suffix)), None)
            if writer is None:
                zf.writestr(zipfile.ZipInfo(name), data, compress_type=method)
            else:
                info = zipfile.ZipInfo(name)
                info.compress_type = method
                with zf.open(info, "w", force_zip64=True) as f:
                    writer(f, data)


@pytest.mark.parametrize("which", ["all members", "one member"])
def test_a_checkpoint_with_deflated_zip_members_converts_to_its_own_tensors(which, tmp_path):
    raw = untrained(tmp_path)
    want = saved(raw)["model"]
    # data/1 is the second tensor pickled: blocks.0.norm1.weight, the ones the issue saw read as garbage
    repack(raw / "model.pt", (lambda n: True) if which == "all members" else (lambda n: n.endswith("/data/1")))
    assert any(i.compress_type == zipfile.ZIP_DEFLATED for i in zipfile.ZipFile(raw / "model.pt").infolist())
    _, state, seen = converted(raw, tmp_path / "hf")
    assert state.keys() == want.keys()
    for k in want:
        assert torch.equal(state[k], want[k]), k
    assert any("compressed" in line and "not mapped" in line for line in seen), seen


def zeros(size: int):
    def write(f, _data):
        chunk = bytes(2**20)
        for _ in range(size // len(chunk)):
            f.write(chunk)

    return write


def test_a_deflate_bomb_as_a_tensor_storage_is_refused_by_name_before_inflating(tmp_path):
    raw = untrained(tmp_path)
    need = saved(raw)["model"]["blocks.0.norm1.weight"].numel() * 4
    # 64 MiB of zeros deflated to ~64 KiB where the tensor needs 512 bytes: the rule is the 4 GiB bomb's
    repack(raw / "model.pt", lambda n: n.endswith("/data/1"), {"/data/1": zeros(64 * 2**20)})
    message = refused(raw, tmp_path / "hf", "data/1", f"declares {64 * 2**20} bytes", f"exactly the {need}", "bomb")
    assert "NaN" not in message and "diverged" not in message


def test_a_pickle_member_that_would_inflate_beyond_any_state_dict_is_refused_before_inflating(tmp_path):
    raw = untrained(tmp_path)

    def padded(f, data):  # the real pickle, then zeros the unpickler never reaches
        f.write(data)
        zeros(65 * 2**20)(f, data)

    repack(raw / "model.pt", lambda n: n.endswith("data.pkl"), {"data.pkl": padded})
    refused(raw, tmp_path / "hf", "data.pkl", "refused before inflating")


def test_a_stored_member_shorter_than_its_tensors_is_refused_not_mapped_past_its_end(tmp_path):
    raw = untrained(tmp_path)
    repack(raw / "model.pt", lambda n: False, {"/data/1": lambda f, data: f.write(data[: len(data) // 2])})
    refused(raw, tmp_path / "hf", "data/1", "holds 256 bytes", "need 512", "damaged")


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda t: t.to_sparse(), ["torch.sparse_coo", "dense"]),
        (lambda t: torch.empty(t.shape, device="meta"), ["on meta", "dense"]),
        (lambda t: t.to(torch.int64), ["torch.int64", "float32 or bfloat16"]),
    ],
    ids=["sparse", "meta", "int64"],
)
def test_a_tensor_that_is_not_dense_or_of_the_formats_dtypes_is_refused_by_key(make, words, tmp_path):
    raw = untrained(tmp_path)
    obj = saved(raw)
    obj["model"]["blocks.0.norm1.weight"] = make(obj["model"]["blocks.0.norm1.weight"])
    resave(raw, obj)
    refused(raw, tmp_path / "hf", "blocks.0.norm1.weight", *words)


# --- the train config: no key dropped in silence -------------------------------------------------


@pytest.mark.parametrize("key,value", [("rope_scaling", {"type": "linear", "factor": 4.0}), ("sliding_window", 4096)])
def test_a_train_config_key_the_format_does_not_define_is_refused_by_name(key, value, tmp_path):
    raw = untrained(tmp_path)
    obj = saved(raw)
    obj["config"][key] = value
    resave(raw, obj)
    refused(raw, tmp_path / "hf", repr(key), "format 1 does not define", f"--ignore-config-key {key}")


def test_an_ignored_config_key_converts_and_is_named_in_the_notes(tmp_path, cli):
    raw = untrained(tmp_path)
    obj = saved(raw)
    obj["config"].update(rope_scaling=None, dropout=0.1)
    resave(raw, obj)
    r = cli("convert", raw, tmp_path / "hf", "--ignore-config-key", "rope_scaling", "--ignore-config-key", "dropout")
    assert r.returncode == 0, r.stderr
    note = next(line for line in r.stdout.splitlines() if "ignored train config keys" in line)
    assert "rope_scaling=None" in note and "dropout=0.1" in note
    cfg, _ = read_folder(tmp_path / "hf")
    assert cfg == TrainConfig.from_dict(
        {k: v for k, v in obj["config"].items() if k not in ("rope_scaling", "dropout")}
    )


def test_the_gguf_export_of_a_checkpoint_refuses_or_ignores_an_unknown_key_as_convert_does(tmp_path):
    raw = untrained(tmp_path)
    obj = saved(raw)
    obj["config"]["sliding_window"] = 4096
    resave(raw, obj)
    with pytest.raises(MiniStreamError, match="'sliding_window'.*--ignore-config-key sliding_window"):
        export(raw, tmp_path / "m.gguf", log=quiet)
    assert not (tmp_path / "m.gguf").exists()
    seen: list[str] = []
    export(raw, tmp_path / "m.gguf", log=seen.append, ignore_config_keys=["sliding_window"])
    assert any("ignored train config keys" in s and "sliding_window=4096" in s for s in seen), seen


def test_a_key_of_the_format_cannot_be_ignored(tmp_path):
    raw = untrained(tmp_path)
    refused(
        raw, tmp_path / "hf", "--ignore-config-key rope_theta", "key of format 1", ignore_config_keys=["rope_theta"]
    )


def test_a_train_config_dict_with_a_key_the_format_does_not_define_is_refused_not_dropped():
    values = {**make_config_values(), "rope_scaling": {"factor": 4.0}}
    with pytest.raises(MiniStreamError, match="'rope_scaling' is not a key of format 1's train config"):
        TrainConfig.from_dict(values)


def make_config_values() -> dict:
    return dict(
        vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=64, norm_eps=1e-6, rope_theta=1e4,
        bos_id=0, eos_id=1,
    )  # fmt: skip


# --- a tied head saved the ordinary way ----------------------------------------------------------


def tied_module_checkpoint(tmp_path: Path) -> Path:
    """What a trainer whose lm_head shares the embedding's storage saves: state_dict() holds both keys."""
    raw = untrained(tmp_path)
    obj = saved(raw)
    cfg = TrainConfig.from_dict(obj["config"])
    model = MiniStream(cfg)
    model.load_state_dict(obj["model"])
    model.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    model.lm_head.weight = model.embedding.weight  # tied, as nanoGPT and most trainers tie
    state = model.state_dict()
    assert state[HEAD].data_ptr() == state[EMBEDDING].data_ptr()
    resave(raw, {"model": state, "config": obj["config"]})
    return raw


def test_a_tied_head_sharing_the_embeddings_storage_is_dropped_with_a_note(tmp_path):
    raw = tied_module_checkpoint(tmp_path)
    assert HEAD in saved(raw)["model"]
    cfg, state, seen = converted(raw, tmp_path / "hf")
    assert cfg.tie_embeddings and HEAD not in state
    assert torch.equal(state[EMBEDDING], saved(raw)["model"][EMBEDDING])
    assert any(f"dropped {HEAD}" in s and "the same storage" in s for s in seen), seen


def test_the_reference_model_reads_a_tied_checkpoint_saved_the_ordinary_way(tmp_path):
    raw = tied_module_checkpoint(tmp_path)
    model = MiniStream.from_checkpoint(raw)
    assert model.lm_head is None


def test_a_head_equal_bit_for_bit_to_the_embedding_is_dropped_with_a_note(tmp_path):
    raw = untrained(tmp_path)
    obj = saved(raw)
    obj["model"][HEAD] = obj["model"][EMBEDDING].clone()
    resave(raw, obj)
    cfg, ckpt = load(raw)
    assert cfg.tie_embeddings and HEAD not in ckpt.state
    assert any("equal bit for bit" in n for n in ckpt.notes), ckpt.notes


def test_a_head_that_differs_from_a_tied_embedding_is_refused_saying_by_how_much(tmp_path):
    raw = untrained(tmp_path)
    obj = saved(raw)
    obj["model"][HEAD] = obj["model"][EMBEDDING].clone()
    obj["model"][HEAD][3, 5] += 0.5
    resave(raw, obj)
    refused(raw, tmp_path / "hf", HEAD, "differs from", "max abs difference 0.5", "tie_embeddings false")


def test_a_bare_state_dict_with_a_copied_head_is_tied_by_default_without_a_flag(tmp_path):
    raw = untrained(tmp_path)
    obj = saved(raw)
    state = {**obj["model"], HEAD: obj["model"][EMBEDDING].clone()}
    resave(raw, state)  # no config entry: the values come as flags, tie_embeddings left at its default
    flags = {k: v for k, v in obj["config"].items() if k != "tie_embeddings"}
    cfg, ckpt = load(raw, flags)
    assert cfg.tie_embeddings and HEAD not in ckpt.state
    assert HEAD in load_checkpoint(raw).state  # the file is left as it is: only what is converted drops it
