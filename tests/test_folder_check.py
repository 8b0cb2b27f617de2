"""One folder check (folder.examine) for doctor, serve, generate and verify (issue 32, case 3): a config.json
key or value that is not format 1's math is a doctor error and a serve refusal, and doctor has an error
exactly when check_servable (the pre-flight serve, generate and verify run) refuses; hypothesis holds it
over random config.json values. doctor's own flags are refused by name. Real converted folders; no engine.
"""

import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st
from safetensors.torch import load_file, save_file
from walk import walk, walk_doctor

from ministream import MiniStreamError
from ministream.checkpoint.folder import checked
from ministream.checkpoint.headers import read_headers
from ministream.checkpoint.quantize import quantize
from ministream.run.doctor import doctor
from ministream.run.engine import EngineSettings
from ministream.run.folder import check_memory, check_servable

from conftest import fuzz_settings, made_once, quiet

EXAMPLES = 50
# doctor's machine-side checks held still, so that only the folder decides (the tiny model fits them)
STILL = dict(settings=EngineSettings(max_model_len=64, kv_cache_gib=1), memory_gib=64)


def with_config(tiny_hf: Path, where: Path, **change) -> Path:
    """A copy of the converted folder with config.json keys set (None: removed)."""
    shutil.copytree(tiny_hf, where)
    config = json.loads((where / "config.json").read_text())
    config.update(change)
    (where / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return where


def refusal(folder: Path) -> str | None:
    try:
        check_servable(folder)
    except MiniStreamError as e:
        return str(e)
    return None


def errors(folder: Path) -> list[str]:
    return [str(f) for f in doctor(folder, **STILL) if f.level == "error"]


# keys vLLM applies, each changing the model's output away from format 1's
OTHER_MATH = {
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "hidden_act": "gelu",
    "attention_bias": True,
    "mlp_bias": True,
    "sliding_window": 64,
    "quantization_config": {"quant_method": "fp8"},
    "pretraining_tp": 2,
}


@pytest.mark.parametrize("key", OTHER_MATH)
def test_a_config_key_that_changes_the_math_is_a_doctor_error_and_a_serve_refusal(key, tiny_hf, tmp_path):
    folder = with_config(tiny_hf, tmp_path / "m", **{key: OTHER_MATH[key]})
    said = refusal(folder)
    assert said and f"{key}=" in said and "vLLM would apply" in said, said
    found = errors(folder)
    assert len(found) == 1 and found[0].startswith(f"error {key}: ") and "vLLM would apply" in found[0], found


def test_a_key_format_1_does_not_define_is_named_with_what_to_do(tiny_hf, tmp_path):
    said = refusal(with_config(tiny_hf, tmp_path / "m", sliding_window=64))
    assert said and "sliding_window=64: format 1 does not define it; vLLM would apply it" in said, said
    assert "remove sliding_window from config.json, or convert again" in said


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("hidden_size", "128", "hidden_size='128': must be a number, not str"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps=nan: must be finite"),
        ("tie_word_embeddings", "false", "tie_word_embeddings='false': must be true or false"),
        ("hidden_size", 128.0, "hidden_size=128.0: must be an integer"),  # transformers 5 refuses it in vLLM
        ("rms_norm_eps", 1, "rms_norm_eps=1: must be written with a decimal point"),  # and this
    ],
)
def test_a_value_serve_refuses_is_a_doctor_error_naming_the_key(key, value, words, tiny_hf, tmp_path):
    folder = with_config(tiny_hf, tmp_path / "m", **{key: value})
    said = refusal(folder)
    assert said and words in said, said
    found = errors(folder)
    assert len(found) == 1 and words in found[0], found


def untie_with_a_head_of_zeros(folder: Path) -> None:
    t = load_file(folder / "model.safetensors")
    t["lm_head.weight"] = torch.zeros_like(t["model.embed_tokens.weight"])
    save_file(t, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))


def grow_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(["<extra1>", "<extra2>"])
    tok.save(str(folder / "tokenizer.json"))


def bad_chat_template(folder: Path) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))


# what doctor called an error and serve let through, or doctor only warned of and serve refused
FOLDER_FAULTS = {
    "no tokenizer.json": (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json: no such file"),
    "a chat template that does not compile": (bad_chat_template, "not a valid Jinja chat template"),
    "an untied head of zeros": (untie_with_a_head_of_zeros, "lm_head.weight is all zeros"),
    "a tokenizer bigger than the vocabulary": (grow_tokenizer, "the tokenizer has 514 tokens but the model only 512"),
}


@pytest.mark.parametrize("fault", FOLDER_FAULTS)
def test_a_folder_doctor_calls_wrong_is_one_serve_refuses(fault, tiny_hf, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf, folder)
    spoil, words = FOLDER_FAULTS[fault]
    spoil(folder)
    said = refusal(folder)
    assert said and words in said, said
    assert any(words in f for f in errors(folder)), errors(folder)


@pytest.mark.parametrize("text, what", [("[1, 2]", "a JSON list"), ("null", "null")])
def test_doctor_on_a_config_that_is_no_object_says_so_in_one_line(text, what, tiny_hf, tmp_path, cli):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf, folder)
    (folder / "config.json").write_text(text)
    r = cli("doctor", folder)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0] == f"error: {folder / 'config.json'} holds {what}, not an object; " + (
        "convert again (make convert)"
    ), r.stderr


@pytest.mark.parametrize(
    "flag, value",
    [("--max-model-len", "-5"), ("--max-model-len", "0"), ("--memory-gib", "nan"), ("--memory-gib", "-1"),
     ("--kv-cache-gib", "-2"), ("--kv-cache-gib", "nan"), ("--kv-cache-gib", "inf")],
)  # fmt: skip
def test_doctor_refuses_a_meaningless_flag_by_name_in_one_line(flag, value, tiny_hf, cli):
    r = cli("doctor", tiny_hf, flag, value)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stdout, r.stderr)
    assert lines[0].startswith(f"error: {flag} ") and ": must be a positive" in lines[0], r.stderr
    assert "MiB" not in r.stdout


def test_every_key_the_converter_writes_is_one_the_check_allows():
    from ministream.checkpoint.config_json import CONFIG_KEYS
    from ministream.spec import TrainConfig, hf_config

    cfg = TrainConfig(64, 16, 1, 2, 32, 64, 1e-6, 1e4, 0, 1)
    assert set(hf_config(cfg, "bfloat16", "x")) <= set(CONFIG_KEYS)


def test_a_folder_saved_again_by_transformers_still_passes(tiny_hf, tmp_path):
    """save_pretrained writes transformers' own metadata beside the format's keys: none of it is refused."""
    from ministream.checkpoint.hf import MiniStreamConfig

    folder = tmp_path / "m"
    shutil.copytree(tiny_hf, folder)
    MiniStreamConfig.from_pretrained(folder).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert "transformers_version" in config and "rope_theta" not in config  # transformers 5 keeps rope_parameters
    assert refusal(folder) is None and not errors(folder)


@pytest.fixture(scope="module")
def tiny_w8a8(tiny_hf, tmp_path_factory) -> Path:
    """The converted tiny model quantized w8a8 (round to nearest), made once for the run."""
    return made_once(tmp_path_factory, "hf", "tiny-w8a8", lambda out: quantize(tiny_hf, out, "w8a8", log=quiet))


@pytest.mark.parametrize("weights", ["float", pytest.param("w8a8", marks=pytest.mark.full)])
def test_serves_check_reads_config_json_its_train_config_and_its_scheme_once(weights, tiny_hf, request):
    """check_servable (the pre-flight of serve, generate and verify) opens config.json once, parses the train
    config it holds once and reads a quantized folder's scheme once: every check takes what that read gave
    (tests/walk.py counts the opens and the calls)."""
    folder = tiny_hf if weights == "float" else request.getfixturevalue("tiny_w8a8")
    seen = walk(folder, "bfloat16")  # a dtype every machine runs both in: the check goes to its end
    assert seen.refused is None, seen.refused
    assert seen.config_reads == 1 and seen.calls["read_config"] == 1, seen
    assert seen.calls["train_config_from_hf"] == 1, seen
    assert seen.calls["read_scheme"] == (weights != "float") and not seen.calls["scheme_name"], seen


def test_doctor_reads_config_json_its_train_config_and_a_quantized_folders_scheme_once(tiny_w8a8):
    """doctor opens config.json once, parses the train config once and reads the scheme once, for every finding
    that needs them (the installed vLLM's, the folder's, the transformers files', the dtype it runs in): each takes
    what the one folder check read (tests/walk.py counts the opens and the calls)."""
    seen = walk_doctor(tiny_w8a8, **STILL)
    assert seen.refused is None, seen.refused
    topics = {f.topic for f in seen.returned}
    assert {"quantization", "vllm", "fingerprint", "transformers", "memory"} <= topics, topics  # it went to its end
    assert seen.config_reads == 1 and seen.calls["read_config"] == 1, seen
    assert seen.calls["train_config_from_hf"] == 1, seen
    assert seen.calls["read_scheme"] == 1 and not seen.calls["scheme_name"], seen


def test_an_engine_that_could_not_fit_the_memory_is_refused_naming_the_folder_and_what_to_do(tiny_hf, tiny_w8a8):
    """check_memory (check_servable's, before any engine starts): the weights in the dtype the engine computes in
    (a float tensor at that dtype's size, a packed int8 one as stored) and each rank's KV cache, against the memory
    available; refused by one byte short, with the smaller ways named: bfloat16 where it asked float32, quantize
    where the folder is not quantized."""
    kv = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    for folder, quantized in ((tiny_hf, False), (tiny_w8a8, True)):
        stored = read_headers(folder)
        parameters = {name: torch.Size(t.shape).numel() for name, t in stored.items()}
        ints = {name for name, t in stored.items() if t.dtype == "I8"}
        assert bool(ints) == quantized
        f32 = sum(n * (1 if name in ints else 4) for name, n in parameters.items())  # the packed ones are I8
        seen = checked(folder).folder
        assert seen.held_bytes("float32") == f32
        assert seen.held_bytes("bfloat16") == f32 - sum(2 * n for name, n in parameters.items() if name not in ints)
        need = f32 + 2 * 2**30  # two ranks' KV caches of 1 GiB each
        check_memory(seen, "float32", ranks=2, environ=kv, available=need)
        with pytest.raises(MiniStreamError) as refused:
            check_memory(seen, "float32", ranks=2, environ=kv, available=need - 1)
        said = str(refused.value)
        assert str(folder) in said and "float32" in said and "could not start" in said, said
        assert "--dtype bfloat16" in said and ("ministream quantize" in said) != quantized, said
        # half of the weights on another node: this node's share
        check_memory(seen, "float32", share=0.5, environ=kv, available=f32 // 2 + 2**30)


# --- the property: doctor has an error exactly when serve's check refuses ----------------------------------

EXTRA_KEYS = ["rope_scaling", "sliding_window", "foo", "use_cache", "pad_token_id", "transformers_version",
              "_name_or_path", "id2label", "pretraining_tp", "attention_dropout", "is_encoder_decoder"]  # fmt: skip
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 700),
    st.sampled_from([0, 1, 2, 64, 128, 512, 2**31, -(2**40)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "128", "silu", "gelu", "false", "ministream", "llama", "float32", "int8", "default"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["rope_type", "rope_theta", "factor", "0", "a"]), inner, max_size=3)
    ),
    max_leaves=5,
)
# what becomes of a key's present value: near misses as well as garbage
OPS = {
    "same": lambda v: v,
    "float": lambda v: float(v) if type(v) is int else v,
    "int": lambda v: int(v) if type(v) is float and v.is_integer() else v,
    "string": lambda v: str(v),
    "negative": lambda v: -v if type(v) in (int, float) else v,
    "double": lambda v: v * 2 if type(v) in (int, float) else v,
}
DELETE = object()


@st.composite
def configs(draw, base: dict):
    """config.json as a user or a tool may leave it: one to three keys changed, removed or added; now and
    then no object at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(st.one_of(st.none(), st.lists(SCALARS, max_size=2), SCALARS))
    config = dict(base)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(base) + EXTRA_KEYS))
        how = draw(st.sampled_from([*OPS, "value", "delete"]))
        if how == "delete":
            config.pop(key, None)
        elif how == "value" or key not in config:
            config[key] = draw(VALUES)
        else:
            config[key] = OPS[how](config[key])
    return config


def test_doctor_has_an_error_exactly_when_serves_check_refuses(tiny_hf, tmp_path):
    """Over random config.json values on a real converted folder: check_servable refuses (the pre-flight of
    serve, generate and verify) exactly when doctor reports an error or cannot read the folder. Both
    outcomes are seen."""
    assert not errors(tiny_hf), errors(tiny_hf)  # the folder and this machine are fine: only config.json moves
    base = json.loads((tiny_hf / "config.json").read_text())
    folder = Path(tempfile.mkdtemp(dir=tmp_path)) / "m"
    shutil.copytree(tiny_hf, folder)
    seen: Counter = Counter()

    @fuzz_settings(EXAMPLES)
    @given(config=configs(base))
    def fuzz(config):
        (folder / "config.json").write_text(json.dumps(config))
        refused = refusal(folder)
        try:
            found = errors(folder)
        except MiniStreamError as e:  # a folder that cannot be read at all: one line, exit 2
            assert "\n" not in str(e)
            found = [str(e)]
        assert bool(found) == bool(refused), (config, refused, found)
        seen["refused" if refused else "served"] += 1

    fuzz()
    assert seen["refused"] and seen["served"], seen


def test_a_quantized_folders_check_and_doctor_import_no_compressed_tensors(tiny_w8a8):
    """The scheme is read against the configs shipped per compressed-tensors version (scheme.WRITTEN), not built
    by the library: its ~7 s of imports were in every doctor and serve of a quantized folder."""
    code = (
        "import sys; from pathlib import Path; from ministream.run.folder import check_servable; "
        "from ministream.run.doctor import doctor; "
        f"check_servable(Path({str(tiny_w8a8)!r}), 'bfloat16'); doctor(Path({str(tiny_w8a8)!r})); "
        "print(sorted(m for m in sys.modules if m.startswith('compressed_tensors')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])
