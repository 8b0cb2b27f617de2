"""LoRA, from the trainer to the server (issue 33): the trainer's adapter.pt read by model.pt's reader and checked
against the base model, converted to a PEFT adapter folder, merged into the reference model, and served by real
vLLM 0.32.0 CPU engines beside the base model: offline (`LLM(enable_lora=True)` + `LoRARequest`), by `vllm serve
--enable-lora --lora-modules` and by `ministream serve --lora`, on the patched wheel and on the plugin route.

The adapters are `ministream checkpoint --adapter`'s: random, seeded, each update a quarter of its weight's norm,
so that the adapted models' greedy outputs differ from the base's (a test proves it: else the comparisons could
not fail). The engine tests share one engine per route and kind: the offline one in make test, the servers in
make test-full.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ministream import MiniStreamError
from ministream.checkpoint.demo import make_adapter
from ministream.checkpoint.format import ADAPTER_FILE, load
from ministream.checkpoint.lora import PEFT_CONFIG, PEFT_WEIGHTS, check_peft, convert_lora, load_adapter
from ministream.checkpoint.reference import MiniStream
from ministream.run import engine, serve
from ministream.run.generate import DEFAULT_PROMPTS, tokenize
from ministream.run.server import complete, free_port, running, stop, wait_ready
from ministream.spec import LORA_TABLE, lora_table, peft_shapes, peft_to_lora

from conftest import one_line_error, quiet

MAX_TOKENS = 24
VLLM = Path(sys.executable).parent / "vllm"


# --- adapters for the tests: the trainer's, and converted ---------------------------------------------

# name: (targets, seed, dtype, key prefix) of `ministream checkpoint --adapter`'s adapters for tiny-gqa, whose Wqkv
# splits into three different sizes (4 query heads, 2 kv heads) and whose head is untied
ADAPTERS = {
    "all": (tuple(LORA_TABLE), 0, "float32", "none"),
    "qkv-down-bf16": (("Wqkv", "w3"), 1, "bfloat16", "both"),  # a subset, bfloat16, DDP + compile prefixes
    "third": (("out_proj", "w12"), 2, "float32", "none"),
}


@pytest.fixture(scope="session")  # cheap: made again where the engine tests run (conftest: groups)
def trainer(tiny_gqa, tmp_path_factory) -> dict[str, Path]:
    """The trainer's adapter folders (adapter.pt), by ADAPTERS' name."""
    root = tmp_path_factory.mktemp("trainer")
    for name, (targets, seed, dtype, prefix) in ADAPTERS.items():
        make_adapter(tiny_gqa, root / name, targets=targets, seed=seed, dtype=dtype, prefix=prefix, log=quiet)
    return {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="session")  # cheap: made again where the engine tests run (conftest: groups)
def peft(trainer, tiny_gqa_hf, tmp_path_factory) -> dict[str, Path]:
    """The same adapters converted (PEFT folders), by name."""
    root = tmp_path_factory.mktemp("peft")
    for name, folder in trainer.items():
        convert_lora(folder, root / name, tiny_gqa_hf, log=quiet)
    return {name: root / name for name in trainer}


@pytest.fixture(scope="session")  # cheap: made again where the engine tests run (conftest: groups)
def prompts(tiny_gqa_hf) -> list[list[int]]:
    return tokenize(tiny_gqa_hf, DEFAULT_PROMPTS)


@pytest.fixture(scope="session")  # cheap: made again where the engine tests run (conftest: groups)
def want(tiny_gqa, trainer, prompts) -> dict[str | None, list[dict]]:
    """The reference model's greedy outputs (ids, top-2 logprobs), base (None) and merged with each adapter."""
    return {
        name: MiniStream.from_checkpoint(tiny_gqa, adapter=trainer[name] if name else None).generate(
            prompts, MAX_TOKENS, logprobs=2
        )
        for name in (None, *ADAPTERS)
    }


def ids(outputs: list[dict]) -> list[list[int]]:
    return [o["ids"] for o in outputs]


# --- the adapter's model, and the split -------------------------------------------------------------


def test_each_adapter_changes_the_reference_models_greedy_outputs(want):
    """Else every comparison below would pass with the adapters ignored."""
    for name in ADAPTERS:
        changed = sum(a != b for a, b in zip(ids(want[name]), ids(want[None])))
        assert changed >= len(DEFAULT_PROMPTS) - 1, (name, changed)


def test_the_adapted_models_are_peaked_so_fp32_comparisons_mean_something(want):
    """The top token of every step leads the second by far more than fp32 rounding moves a logprob (~1e-5)."""
    for name in ADAPTERS:
        margin = min(sorted(s.values())[-1] - sorted(s.values())[-2] for o in want[name] for s in o["logprobs"])
        assert margin > 1e-4, (name, margin)


def test_the_split_is_exact_against_the_merged_weight(tiny_gqa, trainer, peft):
    """q/k/v and gate/up each hold B's rows of their part and the whole A: concatenated, B is the trainer's bit
    for bit, and every part's update is the merged weight's rows (exact in float64)."""
    cfg, ckpt = load(tiny_gqa)
    adapter = load_adapter(trainer["all"])
    tensors = load_file(peft["all"] / PEFT_WEIGHTS)
    rows = lora_table(cfg, adapter.r)
    assert peft_to_lora(rows, tensors).keys() == adapter.state.keys()
    for row in rows:
        a, b = adapter.state[row.a], adapter.state[row.b]
        assert all(torch.equal(tensors[n], a) for n in row.peft_a), row.a
        assert torch.equal(torch.cat([tensors[n] for n in row.peft_b]), b), row.b
        merged = ckpt.state[row.base].double() + adapter.scaling * b.double() @ a.double()
        start = 0
        for name in row.peft_b:
            part = tensors[name].double()
            rows_of = slice(start, start + part.shape[0])
            update = adapter.scaling * part @ a.double()
            assert torch.allclose(ckpt.state[row.base][rows_of].double() + update, merged[rows_of], 0, 1e-12), name
            start += part.shape[0]
        assert start == row.b_shape[0] and len(row.peft_b) == (3 if row.target == "Wqkv" else 2 if row.split else 1)


def test_a_subset_of_targets_converts_to_their_modules_only(peft):
    config = json.loads((peft["qkv-down-bf16"] / PEFT_CONFIG).read_text())
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert {k.split(".")[-3] for k in load_file(peft["qkv-down-bf16"] / PEFT_WEIGHTS)} == set(config["target_modules"])
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", 8, 16, "none")


def test_a_bfloat16_adapter_with_prefixes_is_written_as_the_trainer_saved_it(tiny_gqa, trainer, peft):
    saved = torch.load(trainer["qkv-down-bf16"] / ADAPTER_FILE, weights_only=True)["lora"]
    assert saved and all(k.startswith("module._orig_mod.blocks.") for k in saved)
    assert "stripped key prefixes: _orig_mod., module." in load_adapter(trainer["qkv-down-bf16"]).notes
    tensors = load_file(peft["qkv-down-bf16"] / PEFT_WEIGHTS)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    state = peft_to_lora(lora_table(load(tiny_gqa)[0], 8), tensors)
    assert len(state) == len(saved) and all(torch.equal(v, saved["module._orig_mod." + k]) for k, v in state.items())


# --- every bad adapter refused by name, before anything is written -----------------------------------


def nan_in(obj: dict) -> dict:
    obj["lora"]["blocks.1.attn.out_proj.lora_B.weight"][3, 2] = float("nan")
    return obj


# what is done to the trainer's adapter.pt (its plain dict), and the words of the one-line refusal
DAMAGE = {
    "rank": (lambda o: {**o, "config": {"r": 4, "alpha": 16.0}}, r"Wqkv\.lora_A\.weight has shape \[8, 128\], but r=4"),
    "missing": (
        lambda o: {**o, "lora": {k: v for k, v in o["lora"].items() if k != "blocks.1.mlp.w3.lora_B.weight"}},
        r"missing 1 tensor\(s\), first 'blocks\.1\.mlp\.w3\.lora_B\.weight'",
    ),
    "block": (
        lambda o: {**o, "lora": {**o["lora"], "blocks.2.mlp.w3.lora_A.weight": torch.zeros(8, 384)}},
        r"blocks\.2\.mlp\.w3\.lora_A\.weight is for block 2, but the base model has n_layers=2",
    ),
    "unknown": (
        lambda o: {**o, "lora": {**o["lora"], "blocks.0.attn.Wqkv.lora_A.bias": torch.zeros(8)}},
        r"'blocks\.0\.attn\.Wqkv\.lora_A\.bias' is not a LoRA factor",
    ),
    "no-alpha": (lambda o: {**o, "config": {"r": 8}}, r"its config has 'r'; an adapter's config gives r and alpha"),
    "alpha": (lambda o: {**o, "config": {"r": 8, "alpha": float("inf")}}, r"alpha=inf: must be a finite number"),
    "config-key": (
        lambda o: {**o, "config": {**o["config"], "use_rslora": True}},
        r"'use_rslora' = True, which the format does not define .* --ignore-config-key use_rslora",
    ),
    "nan": (nan_in, r"blocks\.1\.attn\.out_proj\.lora_B\.weight holds NaN or Inf"),
    "int": (
        lambda o: {**o, "lora": {**o["lora"], "blocks.0.mlp.w3.lora_A.weight": torch.zeros(8, 384, dtype=torch.int32)}},
        r"blocks\.0\.mlp\.w3\.lora_A\.weight has dtype torch\.int32",
    ),
    "model": (lambda o: {"model": o["lora"], "config": {}}, r"holds a training checkpoint \('model'\), not a LoRA"),
    "code": (
        lambda o: {**o, "made_by": Path("trainer")},
        r"needs code to be executed to load \(pathlib\.\w*Path\); it is refused.*'adapter\.pt'\)",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_bad_adapter_is_refused_in_one_line_naming_what_and_nothing_is_written(damage, trainer, tiny_gqa, tmp_path):
    change, words = DAMAGE[damage]
    bad = tmp_path / "adapter"
    bad.mkdir()
    torch.save(change(torch.load(trainer["all"] / ADAPTER_FILE, weights_only=True)), bad / ADAPTER_FILE)
    with pytest.raises(MiniStreamError, match=words) as refused:
        convert_lora(bad, tmp_path / "out", tiny_gqa, log=quiet)
    assert "\n" not in str(refused.value) and str(bad / ADAPTER_FILE) in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_an_adapter_for_another_base_is_refused_by_the_command_naming_both_shapes(trainer, tiny_hf, tmp_path, cli):
    """tiny-gqa's Wqkv has (4 + 2*2) heads of 64 rows, tiny's (2 + 2*2): every shape is checked against the base."""
    line = one_line_error(cli("convert-lora", trainer["all"], tmp_path / "out", "--base", tiny_hf))
    assert "blocks.0.attn.Wqkv.lora_B.weight has shape [512, 8], but r=8 and the base model's" in line
    assert "blocks.0.attn.Wqkv.weight [384, 128] imply [out, r] = [384, 8]" in line
    assert not (tmp_path / "out").exists()


def test_a_config_key_named_harmless_is_converted_without_it_and_said(trainer, tiny_gqa_hf, tmp_path):
    obj = torch.load(trainer["all"] / ADAPTER_FILE, weights_only=True)
    (tmp_path / "adapter").mkdir()
    torch.save({**obj, "config": {**obj["config"], "dropout": 0.05}, "step": 100}, tmp_path / "adapter" / ADAPTER_FILE)
    said: list[str] = []
    convert_lora(tmp_path / "adapter", tmp_path / "out", tiny_gqa_hf, log=said.append, ignore_config_keys=["dropout"])
    assert "note: ignored adapter config keys (--ignore-config-key): dropout" in said
    assert "note: ignored entries: step" in said and (tmp_path / "out" / PEFT_WEIGHTS).is_file()


# --- the output: whole or nothing, never over an input ------------------------------------------------


def test_a_non_empty_output_is_refused_without_force_and_replaced_whole_with_it(trainer, tiny_gqa_hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("user work")
    with pytest.raises(MiniStreamError, match="exists and is not empty: .* --force"):
        convert_lora(trainer["all"], out, tiny_gqa_hf, log=quiet)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    convert_lora(trainer["all"], out, tiny_gqa_hf, force=True, log=quiet)
    assert sorted(p.name for p in out.iterdir()) == [".ministream-made.json", PEFT_CONFIG, PEFT_WEIGHTS]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("where", ["adapter", "inside-adapter", "base", "inside-base"])
def test_an_output_that_is_or_lies_inside_an_input_is_refused_even_with_force(
    where, trainer, tiny_gqa_hf, tmp_path, tree
):
    adapter, base = tmp_path / "adapter", tmp_path / "base"
    adapter.mkdir()
    (adapter / ADAPTER_FILE).write_bytes((trainer["all"] / ADAPTER_FILE).read_bytes())
    base.mkdir()
    for f in tiny_gqa_hf.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    before = tree(tmp_path)
    out = {"adapter": adapter, "inside-adapter": adapter / "peft", "base": base, "inside-base": base / "lora"}[where]
    with pytest.raises(MiniStreamError, match="destroy what the command reads"):
        convert_lora(adapter, out, base, force=True, log=quiet)
    assert tree(tmp_path) == before


def test_sigterm_while_converting_keeps_the_old_output_and_leaves_no_temporary_folder(trainer, tiny_gqa_hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("the previous conversion")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ministream"), "convert-lora", str(trainer["all"]), str(out)]
        + ["--base", str(tiny_gqa_hf), "--force"],
        env={**os.environ, "MINISTREAM_PAUSE_AT": "convert-lora:weights"},  # the weights written
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    assert proc.stderr.readline().startswith("paused at convert-lora:weights"), proc.stderr.read()
    assert list(tmp_path.glob(f".out.tmp-*/{PEFT_WEIGHTS}"))
    proc.terminate()
    assert proc.wait(60) == 128 + 15 and "error: interrupted (SIGTERM)" in proc.stderr.read()
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["old.txt"]


def test_merging_an_adapter_into_the_reference_never_writes_model_pt(tiny_gqa, trainer):
    before = (tiny_gqa / "model.pt").read_bytes()
    model = MiniStream.from_checkpoint(tiny_gqa, adapter=trainer["all"])
    assert not torch.equal(
        model.blocks[0].attn.Wqkv.weight, MiniStream.from_checkpoint(tiny_gqa).blocks[0].attn.Wqkv.weight
    )
    assert (tiny_gqa / "model.pt").read_bytes() == before


# --- serve's pre-flight check ------------------------------------------------------------------------


def test_serves_pre_flight_check_accepts_what_convert_lora_writes(tiny_gqa, peft):
    cfg = load(tiny_gqa)[0]
    for name, folder in peft.items():
        shapes = {k: tuple(v.shape) for k, v in load_file(folder / PEFT_WEIGHTS).items()}
        assert check_peft(folder, cfg, shapes) == 8, name
        assert shapes.items() <= peft_shapes(cfg, 8).items(), name
    assert len(load_file(peft["all"] / PEFT_WEIGHTS)) == len(peft_shapes(cfg, 8))  # every target: all of them


def test_serve_refuses_an_adapter_that_does_not_fit_the_model_before_vllm_starts(peft, tiny_hf, cli):
    line = one_line_error(cli("serve", tiny_hf, "--port", free_port(), "--lora", f"gqa={peft['all']}"))
    assert f"{peft['all'] / PEFT_WEIGHTS}: base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight" in line
    assert "has shape [256, 8], but r=8 and the base model imply [128, 8]" in line


@pytest.mark.parametrize(
    "loras, words",
    [
        (["nameless"], "give NAME=DIR"),
        (["tiny-gqa=PEFT"], "the name 'tiny-gqa' is already served (the base model's: --name)"),
        (["a=PEFT", "a=PEFT"], "the name 'a' is already served: give each adapter a name of its own"),
        (["a=TRAINER"], "it holds the trainer's adapter: convert it, ministream convert-lora TRAINER OUT --base"),
    ],
)
def test_serve_refuses_a_bad_lora_option_before_vllm_starts(loras, words, peft, trainer, tiny_gqa_hf, tmp_path):
    named = tmp_path / "tiny-gqa"
    named.symlink_to(tiny_gqa_hf)
    fill = {"PEFT": str(peft["all"]), "TRAINER": str(trainer["all"])}
    for key, path in fill.items():
        loras, words = [a.replace(key, path) for a in loras], words.replace(key, path)
    with pytest.raises(MiniStreamError) as refused:
        serve.serve(named, port=free_port(), loras=loras)
    assert words in str(refused.value)


@pytest.mark.parametrize("option", ["--lora-modules a=/x", "--max-loras=1", "--max_loras 4"])
def test_serve_refuses_the_lora_options_it_sets_itself_in_vllm_args(option):
    with pytest.raises(MiniStreamError, match="which serve sets itself: give --lora NAME=DIR"):
        serve.vllm_args(f"--max-num-seqs 8 {option}")


def test_serve_turns_lora_on_with_the_adapters_rank_and_a_spare_slot(peft):
    args = engine.lora_server_args([("a", peft["all"], 8), ("b", peft["third"], 8)])
    assert args == [
        "--enable-lora",
        *("--max-lora-rank", "8", "--max-loras", "3"),
        *("--lora-modules", f"a={peft['all'].resolve()}", f"b={peft['third'].resolve()}"),
    ]
    assert engine.lora_settings([1, 12])["max_lora_rank"] == 16
    with pytest.raises(MiniStreamError, match="rank 600: vLLM serves adapters of rank 512 at most"):
        engine.lora_settings([600])


# --- engines: the adapters served beside the base model --------------------------------------------------

OFFLINE = f"""
import json, sys
from ministream.run.engine import EngineSettings
from ministream.run.generate import vllm_engine, vllm_generate
if __name__ == "__main__":
    folder, prompts, settings, batches = sys.argv[1], *map(json.loads, sys.argv[2:])
    llm = vllm_engine(folder, EngineSettings(dtype="float32", max_model_len=256), **settings)
    results = []
    for batch in batches:  # per group of prompts its adapter folder (null: the base model), all in one batch
        adapters = [a for a in batch for _ in prompts]
        results.append(vllm_generate(llm, prompts * len(batch), {MAX_TOKENS}, 2, adapters=adapters))
    print("RESULT " + json.dumps(results))
"""

# batches of the offline engine, whose settings are serve's for two adapters (engine.lora_settings: a slot each
# and a spare): the base and both in one batch; then a third adapter too, which fills the spare slot
BATCHES = {"mixed": [None, "all", "qkv-down-bf16"], "full": [None, "all", "qkv-down-bf16", "third"]}


@pytest.fixture(scope="module")
def offline(tiny_gqa_hf, peft, prompts, tmp_path_factory) -> dict[str, list[list[dict]]]:
    """One offline engine (`LLM(enable_lora=True, ...)`, `LoRARequest`s) in its own process: per batch of
    BATCHES, the outputs of each group of prompts."""
    script = tmp_path_factory.mktemp("offline") / "lora_engine.py"
    script.write_text(OFFLINE)
    batches = [[str(peft[n]) if n else None for n in batch] for batch in BATCHES.values()]
    settings = engine.lora_settings([8, 8])
    args = [json.dumps(x) for x in (prompts, settings, batches)]
    r = subprocess.run([sys.executable, str(script), str(tiny_gqa_hf), *args], capture_output=True, text=True)
    result = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and result, r.stderr[-5000:]
    n = len(prompts)
    return {
        name: [out[i * n : (i + 1) * n] for i in range(len(batch))]
        for (name, batch), out in zip(BATCHES.items(), json.loads(result[0][len("RESULT ") :]))
    }


def logprob_difference(got: list[dict], want: list[dict]) -> float:
    """The largest difference between vLLM's and the reference's logprob of the tokens both chose."""
    return max(
        abs(g[str(t)] - w[t]) for go, wo in zip(got, want) for g, w, t in zip(go["logprobs"], wo["logprobs"], wo["ids"])
    )


@pytest.mark.vllm
def test_base_and_two_adapters_in_one_batch_each_give_the_reference_merged_greedy_ids_in_fp32(offline, want):
    """Each adapter served by vLLM (PEFT folder, LoRARequest) gives the reference model with that adapter merged:
    greedy ids identical in fp32, logprobs within 1e-3; the base model's prompts in the same batch, the base's."""
    for name, got in zip(BATCHES["mixed"], offline["mixed"]):
        assert ids(got) == ids(want[name]), name
        assert logprob_difference(got, want[name]) < 1e-3, name


# the bug of vLLM 0.32's CPU LoRA ops that engine.lora_settings' spare slot steps around (vLLM PRs #48421, #49656,
# open): with every slot filled, a base-model row's slot index -1 reads the last slot, the last adapter's weights
FIXED = (
    "the base rows are the base model's with every LoRA slot filled: vLLM fixed its CPU LoRA ops (PRs #48421, "
    "#49656)? Hold the base rows to the base model here, and drop engine.lora_settings' spare slot where the "
    "pinned release has the fix"
)


@pytest.mark.vllm
def test_with_every_lora_slot_filled_each_adapter_is_served_and_the_base_rows_get_the_last_adapter(offline, want):
    """vLLM's known bug, pinned as it is: each adapter's rows are its reference's (fp32 identical ids, logprobs
    within 1e-3), while no base row gives the base model's greedy ids: they carry the last adapter's update, the
    slot -1 reads, so more of them give its ids than any other model's. Which rows, and whether exactly, varies
    from run to run: seen 5, 8 and 10 of 10 with its ids, 0 to 7 of them its logprobs within 1e-3 too, none
    with another adapter's or the base's ids. Base rows that are the base model's fail saying vLLM fixed it."""
    got = dict(zip(BATCHES["full"], offline["full"]))
    for name in BATCHES["full"][1:]:
        assert ids(got[name]) == ids(want[name]), name
        assert logprob_difference(got[name], want[name]) < 1e-3, name
    base = ids(got[None])
    assert base != ids(want[None]), FIXED
    agree = {name: sum(a == b for a, b in zip(base, ids(want[name]))) for name in BATCHES["full"]}
    assert agree[None] == 0, (FIXED, agree)  # not one prompt the base model's
    last = BATCHES["full"][-1]
    assert agree[last] > max(n for name, n in agree.items() if name != last), f"not the last adapter's: {agree}"


# --- servers: vllm serve and ministream serve, on the patched wheel and the plugin route ----------------


def served_ids(url: str, base: str, prompts: list[list[int]]) -> dict[str | None, list[list[int]]]:
    """The greedy ids of every prompt from the base model and each adapter, all requests at once (one batch)."""
    models = {None: base, **{name: name for name in ("all", "qkv-down-bf16")}}

    def ask(job):
        model, prompt = job
        status, body = complete(url, model, prompt, MAX_TOKENS, timeout=600, return_token_ids=True)
        assert status == 200, body
        return body["choices"][0]["token_ids"]

    jobs = [(models[name], p) for name in models for p in prompts]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(ask, jobs))
    n = len(prompts)
    return {name: got[i * n : (i + 1) * n] for i, name in enumerate(models)}


ROUTES = pytest.mark.parametrize("route", ["patched wheel", "plugin"])


@pytest.mark.vllm
@pytest.mark.full
@ROUTES
def test_vllm_serve_enable_lora_serves_each_adapter_under_its_name(
    route, route_python, tiny_gqa_hf, peft, prompts, want, tmp_path
):
    """As vLLM's documentation teaches it: `vllm serve DIR --enable-lora --lora-modules name=dir ...` (the stock
    CPU build's `vllm` command cannot start: its launcher, run.vllm_cli), --max-loras with the spare slot."""
    python, env = route_python(route)
    env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1"}
    port, log = free_port(), tmp_path / "vllm.log"
    vllm = [str(VLLM)] if python == Path(sys.executable) else [str(python), "-m", "ministream.run.vllm_cli"]
    cmd = [*vllm, "serve", str(tiny_gqa_hf), "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "float32", "--max-model-len", "256", "--seed", "0"]
    cmd += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "3", "--lora-modules"]
    cmd += [f"{name}={peft[name]}" for name in ("all", "qkv-down-bf16")]
    with running(cmd, log, env) as proc:
        wait_ready(f"http://127.0.0.1:{port}", proc, log, 900)
        got = served_ids(f"http://127.0.0.1:{port}", "base", prompts)
    for name, outputs in got.items():
        assert outputs == ids(want[name]), name


@pytest.mark.vllm
@pytest.mark.full
@ROUTES
def test_ministream_serve_lora_serves_each_adapter_under_its_name(
    route, route_python, tiny_gqa_hf, peft, prompts, want, start_serve, tmp_path
):
    python, env = route_python(route)
    env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = tmp_path / "serve.log"
    loras = [a for name in ("all", "qkv-down-bf16") for a in ("--lora", f"{name}={peft[name]}")]
    proc, url = start_serve(
        tiny_gqa_hf, log, "--dtype", "float32", "--max-model-len", 256, "--name", "base", *loras, python=python, env=env
    )
    try:
        wait_ready(url, proc, log, 900)
        got = served_ids(url, "base", prompts)
    finally:
        stop(proc)
    assert "--enable-lora --max-lora-rank 8 --max-loras 3 --lora-modules" in log.read_text()
    for name, outputs in got.items():
        assert outputs == ids(want[name]), name
