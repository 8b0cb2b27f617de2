"""serve holds vLLM's options to what the installed vLLM resolves them to (issue 52, cases 1 and 2), with vLLM's
own parser: no stand-in.

vLLM's parser takes any unambiguous prefix of an option, `=` and space forms, underscores for dashes, dotted keys
of a dict option, and `--config FILE.yaml` (on the command line or inside --vllm-args), whose keys it merges. A
property test draws those spellings for every setting serve must refuse and shows each refused by its resolved
name, before vLLM starts; the issue's own cases run through the real `ministream serve` command in
test_serve_checks.py; options that are fine reach vLLM as given. And --lora: an adapter folder whose path
holds a comma reaches vLLM whole (its JSON form), one whose adapter_config.json is not PEFT's object is refused in
one line naming the file.
"""

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import assume, given, strategies as st

from ministream import MiniStreamError
from ministream.checkpoint.demo import make_adapter
from ministream.checkpoint.lora import PEFT_CONFIG, convert_lora
from ministream.cli import parse_args
from ministream.run import engine, serve, vllm_options
from ministream.run.server import free_port

from conftest import fuzz_settings, quiet

EXAMPLES = 60  # milliseconds each (vLLM's parser is built once); FUZZ_EXAMPLES=N for more

# what a user may ask vLLM for that serve must refuse: setting -> a value that differs from what serve runs
REFUSED = {
    # other math than the folder's (vllm_options.FOLDER)
    "load_format": "dummy",
    "hf_overrides": '{"rms_norm_eps": 0.5}',
    "hf_config_path": "/tmp",
    "tokenizer": "/tmp",
    "revision": "main",
    "quantization": "fp8",
    "kv_cache_dtype": "fp8",
    "model_class_overrides": '{"MiniStreamForCausalLM": "a.b:C"}',
    "runner": "pooling",
    # serve's own (vllm_options.OWN)
    "port": "9001",
    "host": "0.0.0.0",
    "served_model_name": "other",
    "max_model_len": "64",
    "dtype": "float16",
    "tensor_parallel_size": "2",
    "api_key": "key",
    "max_loras": "4",
    "lora_modules": "a=/x",
}
DICTS = {"hf_overrides": ("rms_norm_eps", "0.5"), "model_class_overrides": ("MiniStreamForCausalLM", '"a.b:C"')}
PLACES = ["the command line", "--vllm-args", "YAML on the command line", "YAML in --vllm-args"]


@pytest.fixture(scope="module")
def parser():
    found = vllm_options.vllm_parser()
    assert found is not None, "vLLM's parser could not be built: is vLLM installed here?"
    return found


def long_name(parser, dest: str) -> str:
    return next(s for a in parser._actions if a.dest == dest for s in a.option_strings if s.startswith("--"))


def shortest_prefix(parser, option: str) -> int:
    """The length of the shortest prefix of `option` that vLLM's parser takes for it alone."""
    target = parser._option_string_actions[option]
    for n in range(3, len(option) + 1):
        if {parser._option_string_actions[s] for s in parser._option_string_actions if s.startswith(option[:n])} == {
            target
        }:
            return n
    return len(option)


def serve_takes() -> dict[str, bool]:
    """serve's own option strings (cli.parse_args's split): a spelling that is one of them is serve's option."""
    import argparse

    from ministream.cli import build_parser

    top = build_parser(["serve"])
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {o: a.nargs != 0 for a in sub._actions for o in a.option_strings}


def resolved_command(folder: Path, argv: list[str]) -> list[str]:
    """What `ministream serve FOLDER ARGV` would start, through the command line's own parse and serve's own
    check (serve.vllm_command, the same call serve makes); raises its refusal."""
    a = parse_args(["serve", str(folder), "--port", "8000", *argv])
    given = {"the command line": serve.passed_on(a.vllm_options, a), "--vllm-args": serve.vllm_args(a.vllm_args)}
    settings = engine.EngineSettings.from_args(a)
    config = json.loads((folder / "config.json").read_text())
    return serve.vllm_command(a.model, settings, a.host, a.port, a.name or folder.name, given, config=config)


@st.composite
def spellings(draw, parser):
    """(setting, where it is given, serve's arguments that give it, the spelling of its name): a prefix vLLM takes
    for it alone (or the whole name), some dashes as underscores, `=` or a space or a dotted key."""
    dest = draw(st.sampled_from(sorted(REFUSED)))
    option = long_name(parser, dest)
    cut = draw(st.integers(shortest_prefix(parser, option), len(option)))
    name = "--" + "".join(c if c != "-" or not draw(st.booleans()) else "_" for c in option[2:cut])
    form = draw(st.sampled_from(["space", "equals", *(["dotted"] if dest in DICTS else [])]))
    place = draw(st.sampled_from(PLACES))
    return dest, name, form, place


def options_for(dest: str, name: str, form: str) -> list[str]:
    if form == "dotted":
        key, value = DICTS[dest]
        return [f"{name}.{key}", value]
    return [name, REFUSED[dest]] if form == "space" else [f"{name}={REFUSED[dest]}"]


def yaml_for(dest: str, name: str, form: str) -> dict:
    value = yaml.safe_load(REFUSED[dest]) if dest in DICTS else REFUSED[dest]
    if form == "dotted":
        key, dotted = DICTS[dest]
        return {f"{name[2:]}.{key}": yaml.safe_load(dotted)}
    return {name[2:]: value}


# ---------------------------------------------------------------- refused by the resolved name


@fuzz_settings(EXAMPLES)
@given(data=st.data())
def test_every_spelling_vllm_takes_for_a_setting_serve_must_refuse_is_refused_before_it_starts(
    data, parser, tiny_hf, tmp_path
):
    dest, name, form, place = data.draw(spellings(parser))
    option = long_name(parser, dest)
    if place == "the command line":
        # serve's own option of that name (exact: its parser takes no prefixes) is serve's, not vLLM's
        assume(name not in serve_takes() and name not in serve.VLLM_NAMES)
        argv = options_for(dest, name, form)
        where = "the command line"
    elif place == "--vllm-args":
        argv = ["--vllm-args=" + shlex.join(options_for(dest, name, form))]  # a value starting with "-": with =
        where = "--vllm-args"
    else:
        config = tmp_path / "options.yaml"
        config.write_text(yaml.safe_dump(yaml_for(dest, name, form)))
        inside = place == "YAML in --vllm-args"
        argv = [f"--vllm-args=--config {config}"] if inside else ["--config", str(config)]
        where = f"{config} ("
    with pytest.raises(MiniStreamError) as caught:
        resolved_command(tiny_hf, argv)
    line = str(caught.value)
    assert "\n" not in line and where in line and f"sets {option}" in line, (argv, line)
    assert "which serve sets itself" in line if dest in vllm_options.OWN else "serve" in line, line


ISSUE = {  # issue 52's cases 1 and 2: serve's arguments (DUMMY: a YAML file with load-format: dummy), the words
    "load_format_prefix": (["--load-form", "dummy"], "the command line sets --load-format dummy (given as --load-fo"),
    "hf_overrides_prefix": (
        ["--hf-overr", '{"rms_norm_eps": 0.5}'],
        "the command line sets --hf-overrides (given as --hf-overr), which would serve other math than the "
        'folder\'s config.json, tokenizer and weights (it gives {"rms_norm_eps": 0.5})',
    ),
    "yaml_on_the_command_line": (["--config", "DUMMY"], "DUMMY (load-format, --config in the command line) sets"),
    "yaml_in_vllm_args": (["--vllm-args=--config DUMMY"], "DUMMY (load-format, --config in --vllm-args) sets"),
    "yaml_missing": (["--config", "/nonexistent/d.yaml"], "--config /nonexistent/d.yaml: no such file"),
    "yaml_key_of_serves_own": (["--config", "PORT"], "PORT (port, --config in the command line) sets --port"),
}


@pytest.mark.parametrize("case", ISSUE)
def test_the_issues_options_are_refused_in_one_line_before_vllm_starts(case, tiny_hf, tmp_path):
    """In-process, the same call serve makes before it starts vLLM (serve.vllm_command); through the command in
    test_serve_checks.py."""
    files = {"DUMMY": tmp_path / "d.yaml", "PORT": tmp_path / "port.yaml"}
    files["DUMMY"].write_text("load-format: dummy\n")
    files["PORT"].write_text("port: 9001\n")  # serve's own --port would win over it: asked all the same
    args, words = ISSUE[case]
    for key, path in files.items():
        args, words = [a.replace(key, str(path)) for a in args], words.replace(key, str(path))
    with pytest.raises(MiniStreamError) as caught:
        resolved_command(tiny_hf, args)
    assert words in str(caught.value) and "\n" not in str(caught.value), caught.value


# ---------------------------------------------------------------- what is fine reaches vLLM as given


def test_options_that_keep_the_folders_math_reach_vllm_as_given(parser, tiny_hf, tmp_path):
    config = tmp_path / "fine.yaml"
    config.write_text("max-num-seqs: 8\nenable_prefix_caching: true\n")
    mine = ["--max-num-se", "8", "--enable-prefix-caching", "--load-format=safetensors", "--seed", "3"]
    theirs = ["--config", str(config), "--max_num_batched_tokens=512"]
    cmd = resolved_command(tiny_hf, [*mine, "--vllm-args=" + shlex.join(theirs)])
    assert cmd[-len(mine) - len(theirs) :] == [*mine, *theirs]  # as given
    got = vllm_options._parse(parser, cmd[cmd.index("-m") + 2 :])
    assert (got["max_num_seqs"], got["enable_prefix_caching"], got["max_num_batched_tokens"]) == (8, True, 512)
    assert (got["load_format"], got["model"], got["seed"]) == ("safetensors", str(tiny_hf.resolve()), 3)


def test_vllms_parser_errors_and_help_are_one_line_before_it_starts(tiny_hf):
    for argv, words in [
        (["--max-num-s", "8"], "ambiguous option: --max-num-s could match"),
        (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
        (["--vllm-args=--help"], "it asks vLLM for help"),
        (["--vllm-args=--config=x.yaml"], "--config=FILE is not read by vLLM"),
    ]:
        with pytest.raises(MiniStreamError, match="vLLM") as caught:
            resolved_command(tiny_hf, argv)
        assert words in str(caught.value) and "\n" not in str(caught.value), caught.value


@pytest.mark.parametrize(
    "text, words",
    [
        ("- load-format\n- dummy\n", "holds list, not `option: value` lines"),
        ("load-format: [dummy\n", "is not valid YAML"),
        ("", "holds NoneType"),
    ],
)
def test_a_config_file_vllm_would_fail_on_is_refused_naming_it(text, words, tiny_hf, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(MiniStreamError, match="bad.yaml") as caught:
        resolved_command(tiny_hf, ["--config", str(config)])
    assert words in str(caught.value), caught.value


# ---------------------------------------------------------------- --lora


@pytest.fixture(scope="module")
def adapter(tiny, tiny_hf, tmp_path_factory) -> Path:
    """A PEFT adapter folder for tiny (convert-lora's), in a folder whose path holds commas."""
    root = tmp_path_factory.mktemp("lora")
    make_adapter(tiny, root / "trainer", targets=("Wqkv",), seed=0, dtype="float32", prefix="none", log=quiet)
    convert_lora(root / "trainer", root / "dir,with,comma", tiny_hf, log=quiet)
    return root / "dir,with,comma"


def test_an_adapter_whose_path_holds_a_comma_reaches_vllm_whole(parser, adapter, tiny_hf):
    config = json.loads((tiny_hf / "config.json").read_text())
    adapters = serve.check_loras([f"a={adapter}", "b,c=" + str(adapter)], config, tiny_hf, tiny_hf.name)
    args = engine.lora_server_args(adapters)
    got = vllm_options._parse(parser, ["--model", str(tiny_hf), *args])
    assert [(m.name, m.path) for m in got["lora_modules"]] == [
        ("a", str(adapter.resolve())),
        ("b,c", str(adapter.resolve())),
    ]


@pytest.mark.parametrize(
    "text, words",
    [
        ('["r", 8]', "holds a JSON list, not PEFT's LoraConfig"),
        ("r: 8", "not valid JSON"),
        ('{"r": 8, "lora_alpha": "16", "target_modules": ["q_proj"]}', "lora_alpha='16'"),
        ('{"r": 8, "lora_alpha": 16, "target_modules": 5}', "target_modules=5"),
    ],
)
def test_an_adapter_config_that_is_not_pefts_object_is_refused_naming_the_file(text, words, adapter, tiny_hf, tmp_path):
    planted = tmp_path / "planted"
    shutil.copytree(adapter, planted)
    (planted / PEFT_CONFIG).write_text(text)
    config = json.loads((tiny_hf / "config.json").read_text())
    with pytest.raises(MiniStreamError, match=str(planted / PEFT_CONFIG)) as caught:
        serve.check_loras([f"a={planted}"], config, tiny_hf, tiny_hf.name)
    assert words in str(caught.value), caught.value


def test_serve_with_adapters_refuses_vllms_runtime_lora_loading_which_would_fill_the_spare_slot(
    adapter, tiny_hf, monkeypatch
):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with pytest.raises(MiniStreamError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: an adapter loaded while"):
        serve.serve(tiny_hf, port=free_port(), loras=[f"a={adapter}"])


def test_make_serve_s_pipeline_recipe_passes_serve_s_own_check(tiny_hf):
    """docs/routes.md's Ray recipe (`make serve MODEL=dir TP=1 PP=2`, one node) as make writes it: serve's --pp,
    not vLLM's --pipeline-parallel-size in --vllm-args, which serve refuses as its own option."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "serve", f"MODEL={tiny_hf}", "PP=2"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.replace("\\\n", " ")  # make's continued lines, one command
    words = shlex.split(next(line for line in out.splitlines() if " serve " in line))
    argv = words[words.index("serve") + 2 :]  # after the folder
    assert "--pp" in argv, argv
    cmd = resolved_command(tiny_hf, argv)
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "ray"


def test_vllms_parser_is_built_only_where_the_user_gave_vllm_options(tiny_hf, monkeypatch):
    """Building vLLM's parser costs a forked child ~10 s of vLLM's imports: serve's own options alone need no
    check, any option of the user's is checked (wherever given)."""
    asked = []
    monkeypatch.setattr(vllm_options, "check_resolved", lambda command, given, quant: asked.append(given))
    resolved_command(tiny_hf, [])
    assert asked == []
    resolved_command(tiny_hf, ["--max-num-seqs", "4"])
    resolved_command(tiny_hf, ["--vllm-args", "--max-num-seqs 4"])
    assert [{k: v for k, v in g.items() if v} for g in asked] == [
        {"the command line": ["--max-num-seqs", "4"]},
        {"--vllm-args": ["--max-num-seqs", "4"]},
    ]
