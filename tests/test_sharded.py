"""Sharded training checkpoints (format.md, "Sharded checkpoints"): torch.distributed.checkpoint folders written by
real gloo ranks (demo.make_checkpoint(ranks=N)), read by the one reader (format.load_checkpoint) through torch's
DCP reader, one tensor at a time, never the optimizer's entries; and convert's default dtype, the checkpoint's own.
"""

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_checkpoint_reader import refused

from ministream.checkpoint.convert import convert
from ministream.checkpoint.demo import make_checkpoint
from ministream.checkpoint.format import load, load_checkpoint
from ministream.checkpoint.gguf import export
from ministream.checkpoint.lora import base_config
from ministream.checkpoint.reference import MiniStream
from ministream.checkpoint.sharded import METADATA, save_sharded
from ministream.run.generate import load_reference
from ministream.spec import TrainConfig

from conftest import one_line_error, quiet

STEPS = 3  # enough for Adam's moments to be saved beside the weights, as a trainer's are


def saved(root: Path, ranks: int | None, **kw) -> Path:
    """The same weights (one seed, STEPS steps of training), as model.pt (ranks None) or sharded by `ranks`; each
    in a folder named raw, so that what a tool writes from the folder's name (GGUF's general.name) is the same."""
    out = root / ("pt" if ranks is None else f"ranks{ranks}") / "raw"
    if not out.exists():
        make_checkpoint(out, "tiny", steps=STEPS, log=quiet, ranks=ranks, **kw)
    return out


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    """A root holding the model.pt save and the 2-rank save of one bfloat16 model (others are made on demand)."""
    root = tmp_path_factory.mktemp("saves")
    saved(root, None, dtype="bfloat16")
    saved(root, 2, dtype="bfloat16")
    return root


def copied(raw: Path, tmp_path: Path) -> Path:
    shutil.copytree(raw, tmp_path / "raw")
    return tmp_path / "raw"


def files(folder: Path) -> dict[str, bytes]:
    """Every file's bytes; the tool's record of what it made (.ministream-made.json: names, sizes and mtimes) by
    its names and sizes, the mtimes being the only thing two runs may differ in."""
    out = {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}
    made = json.loads(out.pop(".ministream-made.json"))
    out["made"] = json.dumps({k: v[0] for k, v in made["files"].items()}).encode()
    return out


def entries(raw: Path) -> dict:
    """{fqn: (file, offset, length)} of every chunk the checkpoint's index names (read with torch's own pickle:
    the test's, not the reader's)."""
    metadata = pickle.loads((raw / "checkpoint" / METADATA).read_bytes())
    return {
        (i.fqn, tuple(i.offset or ())): (s.relative_path, s.offset, s.length) for i, s in metadata.storage_data.items()
    }


# --- the same weights, both ways ------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.full), pytest.param(1, marks=pytest.mark.full)])
def test_a_sharded_save_converts_to_the_folder_its_model_pt_converts_to(ranks, saves, tmp_path):
    raw = saved(saves, ranks, dtype="bfloat16")
    assert len(list((raw / "checkpoint").glob("*.distcp"))) == ranks  # one file per rank, as torch wrote them
    convert(saved(saves, None), tmp_path / "from-pt", log=quiet)
    seen: list[str] = []
    convert(raw, tmp_path / "from-dcp", log=seen.append)
    assert files(tmp_path / "from-dcp") == files(tmp_path / "from-pt")
    assert "note: ignored entries: optimizer" in seen


@pytest.mark.full
def test_a_sharded_save_exports_the_gguf_file_its_model_pt_exports(saves, tmp_path):
    export(saved(saves, None), tmp_path / "pt.gguf", "f32", log=quiet)
    export(saved(saves, 3, dtype="bfloat16"), tmp_path / "dcp.gguf", "f32", log=quiet)
    assert (tmp_path / "dcp.gguf").read_bytes() == (tmp_path / "pt.gguf").read_bytes()


@pytest.mark.full
def test_the_reference_model_of_a_sharded_save_is_the_model_pt_ones(saves):
    # load_reference tells a training checkpoint from a converted folder: a sharded one holds config.json too
    ids = torch.tensor([[0, 40, 41, 300, 7, 99]])
    want = load_reference(saved(saves, None), "float32")(ids)
    assert torch.equal(load_reference(saved(saves, 2), "float32")(ids), want)


@pytest.mark.full
def test_convert_lora_reads_a_sharded_base_as_a_training_checkpoint_not_a_converted_folder(saves):
    # a sharded checkpoint holds config.json, as a converted folder does: its train config is the checkpoint's
    assert base_config(saved(saves, 2)) == base_config(saved(saves, None))


@pytest.mark.full
def test_prefixed_one_based_keys_of_a_sharded_save_read_with_the_notes_of_model_pt(tmp_path):
    kw = dict(prefix="both", one_based=True)
    (cfg_pt, pt), (cfg_dcp, dcp) = load(saved(tmp_path, None, **kw)), load(saved(tmp_path, 3, **kw))
    assert cfg_dcp == cfg_pt and dcp.state.keys() == pt.state.keys()
    assert all(torch.equal(dcp.state[k], pt.state[k]) for k in pt.state)
    assert dcp.notes == [n.replace("optimizer, step", "optimizer") for n in pt.notes]


@pytest.mark.parametrize("given", ["the folder", "checkpoint/", "checkpoint/.metadata"])
@pytest.mark.full
def test_a_sharded_checkpoint_is_read_given_its_folder_its_dcp_folder_or_its_index(given, saves):
    raw = saved(saves, 2)
    path = {"the folder": raw, "checkpoint/": raw / "checkpoint", "checkpoint/.metadata": raw / "checkpoint" / METADATA}
    ckpt = load_checkpoint(path[given])
    assert ckpt.path == raw / "checkpoint" and ckpt.config == json.loads((raw / "config.json").read_text())


@pytest.mark.full
def test_the_commands_write_convert_and_refuse_a_sharded_checkpoint_as_a_user_runs_them(cli, tmp_path):
    raw = tmp_path / "raw"
    made = cli("checkpoint", "--preset", "tiny", "--steps", "2", "--ranks", "3", "--out", raw)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in (raw / "checkpoint").iterdir()) == [METADATA, *(f"__{r}_0.distcp" for r in range(3))]
    run = cli("convert", raw, tmp_path / "hf")
    assert run.returncode == 0 and "ignored entries: optimizer" in run.stdout + run.stderr, run.stderr
    (raw / "checkpoint" / "__2_0.distcp").unlink()
    error = one_line_error(cli("convert", raw, tmp_path / "hf2"))
    assert f"{raw / 'checkpoint' / '__2_0.distcp'}: no such file" in error


# --- never the optimizer -------------------------------------------------------------------------------------


def test_the_optimizer_entries_are_never_read(saves, tmp_path):
    raw = copied(saved(saves, 2), tmp_path)
    _, want = load(saved(saves, None))
    optimizer = {k: v for k, v in entries(raw).items() if not k[0].startswith("model.")}
    assert any(k[0].endswith("exp_avg_sq") for k in optimizer)  # the moments are there to be not read
    for file, offset, length in optimizer.values():  # every byte of them garbage: torch.load of any one fails
        with open(raw / "checkpoint" / file, "r+b") as f:
            f.seek(offset)
            f.write(b"\xff" * length)
    cfg, ckpt = load(raw)
    assert ckpt.state.keys() == want.state.keys()
    assert all(torch.equal(ckpt.state[k], want.state[k]) for k in want.state)


# the process's own peak (VmHWM: not getrusage's ru_maxrss, which Linux carries over exec from the forking pytest)
READ_PEAK = """
import re, sys
import torch.distributed.checkpoint  # the code's own memory: not what the test bounds
from ministream.checkpoint.format import load_checkpoint
def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
before = peak()
ckpt = load_checkpoint(sys.argv[1])
print(peak() - before)
"""


@pytest.mark.full
def test_reading_a_sharded_checkpoint_holds_its_weights_and_one_tensor_never_the_optimizers(tmp_path):
    # 33M parameters in bfloat16 (66 MB, the largest tensor 33 MB) beside Adam's float32 moments (264 MB), by 2
    # ranks: the optimizer's entries, or a rank's whole file, read at once would show many times over
    cfg = dict(vocab_size=32000, d_model=512, n_layers=4, n_heads=8, head_dim=64, d_ff=2048, max_seq_len=256)
    cfg |= dict(norm_eps=1e-6, rope_theta=10000.0, n_kv_heads=8, tie_embeddings=True, bos_id=0, eos_id=1)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in MiniStream(TrainConfig(**cfg)).state_dict().items()}
    model = {k: torch.randn(s).to(torch.bfloat16) for k, s in shapes.items()}
    adam = {"exp_avg": torch.randn, "exp_avg_sq": torch.rand}
    moments = {k: {m: make(s) for m, make in adam.items()} | {"step": torch.tensor(9.0)} for k, s in shapes.items()}
    save_sharded(tmp_path / "raw" / "checkpoint", {"model": model, "optimizer": {"state": moments}}, 2)
    (tmp_path / "raw" / "config.json").write_text(json.dumps(cfg))
    weights = sum(t.numel() * t.itemsize for t in model.values())
    largest = max(t.numel() * t.itemsize for t in model.values())
    run = subprocess.run([sys.executable, "-c", READ_PEAK, tmp_path / "raw"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    grown = int(run.stdout.split()[-1])
    assert grown < 1.15 * (weights + largest), (grown, weights, largest)


# --- what is refused, by name ----------------------------------------------------------------------------------


@pytest.mark.full
def test_a_sharded_checkpoint_without_its_index_is_refused_saying_the_save_did_not_finish(saves, tmp_path):
    raw = copied(saved(saves, 2), tmp_path)
    (raw / "checkpoint" / METADATA).unlink()
    refused(raw, tmp_path / "hf", f"{raw / 'checkpoint' / METADATA}: no such file", "2 rank file(s)", "copy the whole")


@pytest.mark.full
def test_a_rank_file_missing_from_a_sharded_checkpoint_is_refused_by_name(saves, tmp_path):
    raw = copied(saved(saves, 2), tmp_path)
    (raw / "checkpoint" / "__1_0.distcp").unlink()
    refused(raw, tmp_path / "hf", f"{raw / 'checkpoint' / '__1_0.distcp'}: no such file", "every rank's", "model.")


@pytest.mark.full
def test_a_truncated_rank_file_is_refused_before_a_tensor_is_read(saves, tmp_path):
    raw = copied(saved(saves, 2), tmp_path)
    rank1 = raw / "checkpoint" / "__1_0.distcp"
    model = [v for k, v in entries(raw).items() if k[0].startswith("model.") and v[0] == rank1.name]
    rank1.write_bytes(rank1.read_bytes()[: max(o + n for _, o, n in model) - 1])  # cut inside its last weight
    refused(raw, tmp_path / "hf", f"{rank1}: ", "truncated", "copy it again")


@pytest.mark.full
def test_a_damaged_weight_chunk_is_refused_naming_its_file_and_key(saves, tmp_path):
    raw = copied(saved(saves, 2), tmp_path)
    (fqn, _), (file, offset, length) = next((k, v) for k, v in entries(raw).items() if k[0] == "model.norm_f.weight")
    with open(raw / "checkpoint" / file, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * length)
    refused(raw, tmp_path / "hf", f"{raw / 'checkpoint' / file}: model.norm_f.weight cannot be read", "damaged")


@pytest.mark.full
def test_an_index_missing_a_ranks_chunk_is_refused_not_read_as_uninitialized_values(saves, tmp_path):
    raw = copied(saved(saves, 2), tmp_path)
    index = raw / "checkpoint" / METADATA
    metadata = pickle.loads(index.read_bytes())
    metadata.state_dict_metadata["model.embedding.weight"].chunks.pop()  # the last rank's rows, unsaid
    index.write_bytes(pickle.dumps(metadata))
    refused(raw, tmp_path / "hf", "model.embedding.weight [512, 128]", "of its 65536 values", "copy the checkpoint/")


@pytest.mark.full
def test_an_index_that_needs_code_to_be_read_is_refused_not_executed(saves, tmp_path):
    raw = copied(saved(saves, 2), tmp_path)
    planted = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (planted,))

    (raw / "checkpoint" / METADATA).write_bytes(pickle.dumps(Payload()))
    refused(raw, tmp_path / "hf", "needs code to be executed", "pathlib.Path.touch", "refused")
    assert not planted.exists()


@pytest.mark.full
def test_a_sharded_checkpoint_without_config_json_is_refused_before_its_weights_are_read(tmp_path):
    raw = saved(tmp_path, 2, bare=True)
    refused(raw, tmp_path / "hf", f"{raw / 'config.json'}: no such file", "write it there")


@pytest.mark.full
def test_a_sharded_weight_of_the_wrong_shape_for_its_config_is_refused_by_key(saves, tmp_path):
    raw = copied(saved(saves, 2), tmp_path)
    config = json.loads((raw / "config.json").read_text())
    (raw / "config.json").write_text(json.dumps({**config, "d_ff": config["d_ff"] * 2}))
    refused(raw, tmp_path / "hf", "blocks.0.mlp.w12.weight", str(raw / "checkpoint"))


# --- the output dtype: the checkpoint's own ------------------------------------------------------------------


def dtypes(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def test_convert_writes_a_bfloat16_checkpoint_in_bfloat16_unless_told(saves, tmp_path):
    convert(saved(saves, None), tmp_path / "hf", log=quiet)
    assert dtypes(tmp_path / "hf") == {"BF16"}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.full
def test_convert_writes_float32_on_request(saves, tmp_path):
    convert(saved(saves, None), tmp_path / "hf", dtype="float32", log=quiet)
    assert dtypes(tmp_path / "hf") == {"F32"}


@pytest.mark.full
def test_convert_writes_a_float32_checkpoint_in_float32(tiny, tmp_path):
    convert(tiny, tmp_path / "hf", log=quiet)
    assert dtypes(tmp_path / "hf") == {"F32"}


@pytest.mark.full
def test_a_checkpoint_of_mixed_dtypes_converts_to_float32_and_says_so(saves, tmp_path):
    raw = copied(saved(saves, None), tmp_path)
    obj = torch.load(raw / "model.pt", weights_only=True)
    obj["model"] = {k: v.float() if v.dim() == 1 else v for k, v in obj["model"].items()}  # norms kept in float32
    torch.save(obj, raw / "model.pt")
    seen: list[str] = []
    convert(raw, tmp_path / "hf", log=seen.append)
    assert dtypes(tmp_path / "hf") == {"F32"}
    note = next(n for n in seen if "mixed dtypes" in n)
    assert "bfloat16 (" in note and "float32 (" in note and "writing float32" in note, note
