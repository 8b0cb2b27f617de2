"""The command line as a table (cli.COMMANDS, ministream/commands/): every subcommand's parsed options reach its
job unchanged, by name. For each command, command lines with its options left out and given: parse with the real
parser, run the command with its job functions stood in for by recorders, and compare what each job received
with what the line said (the expected side is written out, as the old cli.py's lambdas passed it). No engine,
no build: every job function any command calls is a recorder here.
"""

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from ministream.cli import COMMANDS, build_parser, parse_args
from ministream.paths import BUILD, CACHE
from ministream.run.engine import EngineSettings
from ministream.spec import LORA_TABLE, TrainConfig

from conftest import fuzz_settings

P = Path
HERE = Path(__file__)
STATUS = 3  # what a stand-in job returns unless RETURNS says: a command that passes its job's status on exits 3


@dataclasses.dataclass(frozen=True)
class Case:
    argv: list[str]
    calls: list[tuple[str, dict]]  # the jobs called, in order ("module:function"), each with its keywords
    rc: int = 0
    env: dict = dataclasses.field(default_factory=dict)


# what a stand-in returns where the command goes on with it
RETURNS = {
    "ministream.fork.patch:patch_device": "cpu",
    "ministream.fork.patch:patch_tree": P("tree"),
    "ministream.fork.patch:refresh_diff": P("model.diff"),
    "ministream.fork.wheel:build_wheel": HERE,  # the command prints its size
    "ministream.checks.environments:remove_environments": [P("venv")],
    "ministream.checks.gpu_proof:run_proof": 0,  # done: --export goes on to export
    "ministream.run.ready:ready": ("mini", "top-k rule"),
    "ministream.checkpoint.format:load_checkpoint": "CHECKPOINT",
    "ministream.checkpoint.tokenizer:read_chat_template": "TEMPLATE",
}

NO_OVERRIDES = {f.name: None for f in dataclasses.fields(TrainConfig)}
TRAINING = {  # make_checkpoint's keywords for `checkpoint --out o`
    "out": P("o"),
    "preset": "tiny",
    "steps": None,
    "seed": 0,
    "dtype": "float32",
    "prefix": "none",
    "one_based": False,
    "bare": False,
    "optimizer": True,
    "force": False,
    "cache": None,
    "ranks": None,
    "n_kv_heads": None,
    "head_dim": None,
    "vocab_size": None,
    "tie_embeddings": None,
}
CONVERTED = {  # convert's keywords for `convert raw out`
    "raw_dir": P("raw"),
    "out": P("out"),
    "dtype": None,
    "force": False,
    "chat_template": None,
    "max_shard_size": "2GB",
    "overrides": NO_OVERRIDES,
    "allow_nonfinite": False,
    "ignore_config_keys": [],
}
V = "0.32.0"
SERVED = {  # serve's keywords for `serve m`
    "model": P("m"),
    "settings": EngineSettings(),
    "host": "127.0.0.1",
    "port": 8000,
    "name": None,
    "extra": {"the command line": [], "--vllm-args": []},
    "stop_timeout": 30.0,
    "api_key": None,
    "cluster": None,
    "loras": [],
}
BENCH = {  # bench's keywords for `bench`
    "out": P("build/bench"),
    "quick": False,
    "report_only": False,
    "systems": None,
    "note": "",
    **dict.fromkeys(["configs", "batches", "new_tokens", "prompt_len", "repeats", "serial_requests"]),
    **dict.fromkeys(["bind_configs", "copy_mib", "kv_cache_gib", "tooling"]),
}
BENCH_SERVE = {  # bench-serve's keywords for `bench-serve`
    "out": P("build/bench"),
    "quick": False,
    "report_only": False,
    "systems": None,
    "note": "",
    **dict.fromkeys(["preset", "dtype", "rates", "num_prompts", "ttft_target_s", "tpot_target_s", "seed"]),
    "bisect_steps": None,
}


def benchmark_cases(job: str, defaults: dict, argv: list[str], given: dict) -> list[Case]:
    """A benchmark's cases (bench, bench-serve): nothing given, --quick, --report, and every option given: the
    options both share and its own `argv`, received as `given`."""
    return [
        Case([], [(job, defaults)], rc=STATUS),
        Case(["--quick"], [(job, defaults | {"quick": True})], rc=STATUS),
        Case(["--report"], [(job, defaults | {"report_only": True})], rc=STATUS),
        Case(
            ["--out", "o", "--quick", "--report", "--note", "n", *argv],
            [(job, dict(out=P("o"), quick=True, report_only=True, note="n") | given)],
            rc=STATUS,
        ),
    ]


def plan(nnodes, rank, addr, port, rendezvous, timeout):
    from ministream.run.nodes import Plan

    return Plan(nnodes, rank, addr, port, rendezvous, timeout)


CASES: dict[str, list[Case]] = {
    "checkpoint": [
        Case(["--out", "o"], [("ministream.checkpoint.demo:make_checkpoint", TRAINING)]),
        Case(
            ["--out", "o", "--preset", "tiny-gqa", "--steps", "5", "--seed", "3", "--dtype", "bfloat16"]
            + ["--n-kv-heads", "2", "--head-dim", "16", "--vocab-size", "300", "--untied", "--prefix", "ddp"]
            + ["--one-based", "--bare", "--no-optimizer", "--force", "--cache", "c", "--ranks", "2"],
            [
                (
                    "ministream.checkpoint.demo:make_checkpoint",
                    {
                        **TRAINING,
                        **dict(preset="tiny-gqa", steps=5, seed=3, dtype="bfloat16", prefix="ddp", one_based=True),
                        **dict(bare=True, optimizer=False, force=True, cache=P("c"), ranks=2, n_kv_heads=2),
                        **dict(head_dim=16, vocab_size=300, tie_embeddings=False),
                    },
                )
            ],
        ),
        Case(["--out", "o", "--cache"], [("ministream.checkpoint.demo:make_checkpoint", {**TRAINING, "cache": CACHE})]),
        Case(
            ["--out", "o", "--adapter", "base"],
            [
                (
                    "ministream.checkpoint.demo:make_adapter",
                    dict(base=P("base"), out=P("o"), rank=8, alpha=16.0, targets=list(LORA_TABLE), strength=0.25)
                    | dict(seed=0, dtype="float32", prefix="none", force=False),
                )
            ],
        ),
        Case(
            ["--out", "o", "--adapter", "base", "--rank", "4", "--alpha", "8", "--targets", "Wqkv,w3"]
            + ["--strength", "0.5", "--seed", "1", "--dtype", "bfloat16", "--prefix", "compile", "--force"],
            [
                (
                    "ministream.checkpoint.demo:make_adapter",
                    dict(base=P("base"), out=P("o"), rank=4, alpha=8.0, targets=["Wqkv", "w3"], strength=0.5)
                    | dict(seed=1, dtype="bfloat16", prefix="compile", force=True),
                )
            ],
        ),
    ],
    "convert": [
        Case(["raw", "out"], [("ministream.checkpoint.convert:convert", CONVERTED)]),
        Case(["raw", "out", "--force"], [("ministream.checkpoint.convert:convert", CONVERTED | {"force": True})]),
        Case(
            ["raw", "out", "--dtype", "bfloat16", "--force", "--chat-template", "t.jinja", "--allow-nonfinite"]
            + ["--ignore-config-key", "a", "--ignore-config-key", "b", "--max-shard-size", "500MB"]
            + ["--d-model", "64", "--norm-eps", "1e-5", "--untied"],
            [
                ("ministream.checkpoint.tokenizer:read_chat_template", {"path": P("t.jinja")}),
                (
                    "ministream.checkpoint.convert:convert",
                    CONVERTED
                    | dict(dtype="bfloat16", force=True, chat_template="TEMPLATE", allow_nonfinite=True)
                    | dict(ignore_config_keys=["a", "b"], max_shard_size="500MB")
                    | {"overrides": NO_OVERRIDES | dict(d_model=64, norm_eps=1e-5, tie_embeddings=False)},
                ),
            ],
        ),
        Case(
            [str(HERE), "out"],  # a file: its folder
            [("ministream.checkpoint.convert:convert", CONVERTED | {"raw_dir": HERE.parent})],
        ),
        Case(
            ["raw", "--dry-run", "--tied", "--n-heads", "4", "--ignore-config-key", "k"],
            [
                ("ministream.checkpoint.format:load_checkpoint", {"path": P("raw")}),
                (
                    "ministream.checkpoint.convert:dry_run",
                    dict(ckpt="CHECKPOINT", ignore_config_keys=["k"])
                    | {"overrides": NO_OVERRIDES | dict(n_heads=4, tie_embeddings=True)},
                ),
            ],
            rc=STATUS,
        ),
    ],
    "convert-lora": [
        Case(
            ["ad", "out", "--base", "b"],
            [
                (
                    "ministream.checkpoint.lora:convert_lora",
                    dict(adapter_dir=P("ad"), out=P("out"), base=P("b"), force=False, ignore_config_keys=[]),
                )
            ],
        ),
        Case(
            ["ad", "out", "--base", "b", "--force", "--ignore-config-key", "k"],
            [
                (
                    "ministream.checkpoint.lora:convert_lora",
                    dict(adapter_dir=P("ad"), out=P("out"), base=P("b"), force=True, ignore_config_keys=["k"]),
                )
            ],
        ),
    ],
    "gguf": [
        Case(
            ["src", "o.gguf"],
            [
                (
                    "ministream.checkpoint.gguf:export",
                    dict(src=P("src"), out=P("o.gguf"), dtype="f32", force=False, ignore_config_keys=[]),
                )
            ],
        ),
        Case(
            ["src", "o.gguf", "--dtype", "q8_0", "--force", "--ignore-config-key", "k"],
            [
                (
                    "ministream.checkpoint.gguf:export",
                    dict(src=P("src"), out=P("o.gguf"), dtype="q8_0", force=True, ignore_config_keys=["k"]),
                )
            ],
        ),
    ],
    "quantize": [
        Case(
            ["src", "out", "--scheme", "w8a8"],
            [
                (
                    "ministream.checkpoint.quantize:quantize",
                    dict(src=P("src"), out=P("out"), scheme="w8a8", force=False, text=None, method="rtn")
                    | dict(calibration=None, samples=None, head="float"),
                )
            ],
        ),
        Case(
            ["src", "out", "--scheme", "w4a16", "--method", "gptq", "--calibration-text", "c.txt"]
            + ["--calibration-samples", "16", "--head", "quantized", "--text", "h.txt", "--force"],
            [
                (
                    "ministream.checkpoint.quantize:quantize",
                    dict(src=P("src"), out=P("out"), scheme="w4a16", force=True, text=P("h.txt"), method="gptq")
                    | dict(calibration=P("c.txt"), samples=16, head="quantized"),
                )
            ],
        ),
    ],
    "hf-files": [Case(["m"], [("ministream.checkpoint.hf_files:refresh", {"folder": P("m")})], rc=STATUS)],
    "patch": [
        Case(
            [V],
            [
                ("ministream.fork.patch:patch_device", dict(version=V, asked=None)),
                (
                    "ministream.fork.patch:patch_tree",
                    dict(version=V, src=None, git_url=None, build=BUILD, out=None, device="cpu"),
                ),
            ],
        ),
        Case(
            [V, "--src", "s", "--git-url", "u", "--build-dir", "b", "--device", "cuda"],
            [
                ("ministream.fork.patch:patch_device", dict(version=V, asked="cuda")),
                (  # the device patch_device settled on (the stand-in's "cpu")
                    "ministream.fork.patch:patch_tree",
                    dict(version=V, src=P("s"), git_url="u", build=P("b"), out=None, device="cpu"),
                ),
            ],
        ),
        Case(
            [V, "--out", "t"],
            [
                ("ministream.fork.patch:patch_device", dict(version=V, asked=None)),
                (
                    "ministream.fork.patch:patch_tree",
                    dict(version=V, src=None, git_url=None, build=BUILD, out=P("t"), device="cpu"),
                ),
            ],
        ),
        Case([V, "--refresh-diff"], [("ministream.fork.patch:refresh_diff", dict(version=V))]),
    ],
    "port": [
        Case(
            [V, "0.33.0"],
            [("ministream.fork.port:port_command", dict(source=V, target="0.33.0", every=False))],
            rc=STATUS,
        ),
        Case(["--all"], [("ministream.fork.port:port_command", dict(source=None, target=None, every=True))], rc=STATUS),
        Case(["--missing"], [("ministream.fork.pypi:port_missing", dict(index=None, timeout=60))], rc=STATUS),
        Case(
            ["--missing", "--index-url", "u", "--timeout", "5"],
            [("ministream.fork.pypi:port_missing", dict(index="u", timeout=5.0))],
            rc=STATUS,
        ),
    ],
    "releases": [
        Case([], [("ministream.fork.pypi:releases_command", dict(index=None, timeout=60))], rc=STATUS),
        Case(
            ["--index-url", "u", "--timeout", "2.5"],
            [("ministream.fork.pypi:releases_command", dict(index="u", timeout=2.5))],
            rc=STATUS,
        ),
    ],
    "matrix": [
        Case([], [("ministream.checks.matrix:check_versions", dict(versions=None, out=BUILD))], rc=STATUS),
        Case(
            ["--versions", "0.32.0,0.33.0", "--out", "o"],
            [("ministream.checks.matrix:check_versions", dict(versions="0.32.0,0.33.0", out=P("o")))],
            rc=STATUS,
        ),
        Case(
            ["--run"],
            [("ministream.checks.lines:run_lines", dict(versions=None, out=BUILD, docs=BUILD / "matrix-run"))],
            rc=STATUS,
        ),
        Case(
            ["--versions", "0.32.0", "--out", "o", "--run", "--docs", "d"],
            [("ministream.checks.lines:run_lines", dict(versions="0.32.0", out=P("o"), docs=P("d")))],
            rc=STATUS,
        ),
        Case(["--clean"], [("ministream.checks.environments:remove_environments", dict(versions=None))]),
        Case(
            ["--versions", "0.32.0,0.33.0", "--clean", "--run"],
            [("ministream.checks.environments:remove_environments", dict(versions=["0.32.0", "0.33.0"]))],
        ),
    ],
    "wheel": [
        Case(
            [V, "--device", "cpu"],
            [
                ("ministream.fork.release:require_build", dict(version=V, device="cpu", command="wheel")),
                ("ministream.fork.wheel:build_wheel", dict(version=V, device="cpu", tree=None, dist_dir=None)),
            ],
        ),
        Case(
            [V, "--device", "cuda", "--tree", "t", "--dist", "d"],
            [
                ("ministream.fork.release:require_build", dict(version=V, device="cuda", command="wheel")),
                ("ministream.fork.wheel:build_wheel", dict(version=V, device="cuda", tree=P("t"), dist_dir=P("d"))),
            ],
        ),
    ],
    "plugin": [
        Case([V], [("ministream.fork.plugin:plugin_command", dict(version=V, dist_dir=None))], rc=STATUS),
        Case(
            [V, "--dist", "d"], [("ministream.fork.plugin:plugin_command", dict(version=V, dist_dir=P("d")))], rc=STATUS
        ),
    ],
    "install": [
        Case(
            [V, "--device", "cpu"],
            [
                ("ministream.fork.release:require_build", dict(version=V, device="cpu", command="install")),
                (
                    "ministream.fork.install:install",
                    dict(version=V, device="cpu", dist_dir=None, with_zentorch=True, nearest_pins=False),
                ),
            ],
        ),
        Case(
            [V, "--device", "cuda", "--dist", "d", "--no-zentorch", "--nearest-pins"],
            [
                ("ministream.fork.release:require_build", dict(version=V, device="cuda", command="install")),
                (
                    "ministream.fork.install:install",
                    dict(version=V, device="cuda", dist_dir=P("d"), with_zentorch=False, nearest_pins=True),
                ),
            ],
        ),
    ],
    "vllm-tests": [
        Case(
            [V],
            [
                (
                    "ministream.checks.vllm_tests:run_vllm_tests",
                    dict(version=V, tree=None, compare=False, out=BUILD / "vllm-tests", quick=False),
                )
            ],
            rc=STATUS,
        ),
        Case(
            [V, "--tree", "t", "--compare", "--out", "o", "--quick"],
            [
                (
                    "ministream.checks.vllm_tests:run_vllm_tests",
                    dict(version=V, tree=P("t"), compare=True, out=P("o"), quick=True),
                )
            ],
            rc=STATUS,
        ),
        Case(
            [V, "--compare"],
            [
                (
                    "ministream.checks.vllm_tests:run_vllm_tests",
                    dict(version=V, tree=None, compare=True, out=BUILD / "vllm-tests", quick=False),
                )
            ],
            rc=STATUS,
        ),
    ],
    "cuda-smoke": [
        Case([V], [("ministream.checks.cuda_smoke:run_smoke", dict(version=V, nearest_pins=False))], rc=STATUS),
        Case(
            [V, "--nearest-pins"],
            [("ministream.checks.cuda_smoke:run_smoke", dict(version=V, nearest_pins=True))],
            rc=STATUS,
        ),
    ],
    "gpu-proof": [
        Case([V], [("ministream.checks.gpu_proof:run_proof", dict(version=V, nearest_pins=False, prepare_only=False))]),
        Case(
            [V, "--prepare-only", "--nearest-pins"],
            [("ministream.checks.gpu_proof:run_proof", dict(version=V, nearest_pins=True, prepare_only=True))],
        ),
        Case(
            [V, "--export"],
            [
                ("ministream.checks.gpu_proof:run_proof", dict(version=V, nearest_pins=False, prepare_only=True)),
                ("ministream.checks.gpu_proof:export", dict(version=V)),
            ],
        ),
        Case(
            [V, "--judge", "outputs.json", "--export"],
            [("ministream.checks.gpu_proof:judge_run", dict(version=V, outputs_file=P("outputs.json")))],
            rc=STATUS,
        ),
    ],
    "image": [
        Case(
            [V, "--device", "cpu"],
            [("ministream.fork.image:build", dict(version=V, device="cpu", name=None, route="wheel"))],
        ),
        Case(
            [V, "--device", "cuda", "--tag", "t", "--route", "plugin"],
            [("ministream.fork.image:build", dict(version=V, device="cuda", name="t", route="plugin"))],
        ),
    ],
    "clean": [
        Case([], [("ministream.fork.clean:clean", dict(root=P("."), force=False))], rc=STATUS),
        Case(["--force"], [("ministream.fork.clean:clean", dict(root=P("."), force=True))], rc=STATUS),
    ],
    "generate": [
        Case(
            ["m"],
            [
                (
                    "ministream.run.generate:generate",
                    dict(model=P("m"), settings=EngineSettings(dtype="float32"), raw=None, engines="both")
                    | dict(prompts=None, max_tokens=32, logprobs=0, stop_at_eos=False, json_path=None),
                )
            ],
        ),
        Case(
            ["m", "--raw", "r", "--engine", "vllm", "--prompt", "a", "--prompt", "b", "--max-tokens", "4"]
            + ["--dtype", "bfloat16", "--tp", "2", "--enforce-eager", "--logprobs", "3", "--stop-at-eos"]
            + ["--json", "j.json"],
            [
                (
                    "ministream.run.generate:generate",
                    dict(model=P("m"), raw=P("r"), engines="vllm", prompts=["a", "b"], max_tokens=4, logprobs=3)
                    | dict(settings=EngineSettings(dtype="bfloat16", tp=2, enforce_eager=True))
                    | dict(stop_at_eos=True, json_path=P("j.json")),
                )
            ],
        ),
        Case(
            ["m", "--stop-at-eos"],
            [
                (
                    "ministream.run.generate:generate",
                    dict(model=P("m"), settings=EngineSettings(dtype="float32"), raw=None, engines="both")
                    | dict(prompts=None, max_tokens=32, logprobs=0, stop_at_eos=True, json_path=None),
                )
            ],
        ),
    ],
    "verify": [
        Case(
            ["m"],
            [
                (
                    "ministream.run.verify:run_verify",
                    dict(model=P("m"), raw=None, settings=EngineSettings(dtype="float32"), prompts_file=None)
                    | dict(out=None, max_tokens=32, top_k=5, golden_path=None, threshold=None),
                )
            ],
            rc=STATUS,
        ),
        Case(
            ["m", "--raw", "r", "--dtype", "bfloat16", "--prompts", "p.txt", "--max-tokens", "4", "--top-k", "2"]
            + ["--golden", "g.json", "--out", "o", "--threshold", "0.9"],
            [
                (
                    "ministream.run.verify:run_verify",
                    dict(model=P("m"), raw=P("r"), settings=EngineSettings(dtype="bfloat16"), prompts_file=P("p.txt"))
                    | dict(out=P("o"), max_tokens=4, top_k=2, golden_path=P("g.json"), threshold=0.9),
                )
            ],
            rc=STATUS,
        ),
    ],
    "doctor": [
        Case(
            ["m"],
            [
                (
                    "ministream.run.doctor:run_doctor",
                    dict(model=P("m"), vllm_dir=None, settings=EngineSettings(), memory_gib=None),
                )
            ],
            rc=STATUS,
        ),
        Case(
            ["m", "--dtype", "bfloat16", "--max-model-len", "64", "--kv-cache-gib", "0.5", "--memory-gib", "4"]
            + ["--vllm-dir", "v"],
            [
                (
                    "ministream.run.doctor:run_doctor",
                    dict(model=P("m"), vllm_dir=P("v"), memory_gib=4.0)
                    | dict(settings=EngineSettings(dtype="bfloat16", max_model_len=64, kv_cache_gib=0.5)),
                )
            ],
            rc=STATUS,
        ),
    ],
    "fingerprint": [Case(["m"], [("ministream.run.fingerprint:refresh", {"folder": P("m")})], rc=STATUS)],
    "eval": [
        Case(
            ["m"],
            [
                (
                    "ministream.run.eval:run_eval",
                    dict(folder=P("m"), route="wheel", out=P("build/eval"), tasks=None, include=None)
                    | dict(dtype="float32", limit=None, url=None, eager=False),
                )
            ],
            rc=STATUS,
        ),
        Case(
            ["m", "--route", "server", "--tasks", "a,,b", "--include-path", "i", "--out", "o", "--limit", "5"]
            + ["--url", "http://127.0.0.1:9", "--dtype", "bfloat16", "--enforce-eager"],
            [
                (
                    "ministream.run.eval:run_eval",
                    dict(folder=P("m"), route="server", out=P("o"), tasks=["a", "b"], include=P("i"))
                    | dict(dtype="bfloat16", limit=5, url="http://127.0.0.1:9", eager=True),
                )
            ],
            rc=STATUS,
        ),
    ],
    "serve": [
        Case(["m"], [("ministream.run.serve:serve", SERVED)], rc=STATUS),
        Case(
            ["m", "--host", "0.0.0.0", "--port", "9000", "--name", "n", "--dtype", "bfloat16", "--tp", "2"]
            + ["--pp", "3", "--max-model-len", "64", "--enforce-eager", "--stop-timeout", "5", "--api-key", "k"]
            + ["--vllm-args", "--max-num-seqs 8", "--lora", "a=d", "--lora", "b=e"],
            [
                (
                    "ministream.run.serve:serve",
                    SERVED
                    | dict(host="0.0.0.0", port=9000, name="n", stop_timeout=5.0, api_key="k", loras=["a=d", "b=e"])
                    | dict(settings=EngineSettings(dtype="bfloat16", tp=2, pp=3, max_model_len=64, enforce_eager=True))
                    | {"extra": {"the command line": [], "--vllm-args": ["--max-num-seqs", "8"]}},
                )
            ],
            rc=STATUS,
        ),
        Case(  # vLLM's names of serve's own set them; vLLM's other options pass on
            ["--model", "m", "--tensor-parallel-size", "2", "--max-num-seqs", "64", "--served-model-name", "n"],
            [
                (
                    "ministream.run.serve:serve",
                    SERVED
                    | dict(name="n", settings=EngineSettings(tp=2))
                    | {"extra": {"the command line": ["--max-num-seqs", "64"], "--vllm-args": []}},
                )
            ],
            rc=STATUS,
        ),
        Case(
            ["m", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "3000"]
            + ["--node-timeout", "60"],
            [("ministream.run.serve:serve", SERVED | {"cluster": plan(2, 1, "10.0.0.1", 3000, 3001, 60.0)})],
            rc=STATUS,
        ),
        Case(
            ["m", "--nnodes", "2", "--rendezvous-port", "4000"],
            [("ministream.run.serve:serve", SERVED | {"cluster": plan(2, 0, "127.0.0.1", 29501, 4000, 600.0)})],
            rc=STATUS,
        ),
    ],
    "ready": [
        Case(
            [],
            [
                (
                    "ministream.run.ready:ready",
                    dict(url="http://127.0.0.1:8123", model=None, timeout=5, folder=None, dtype=None),
                )
            ],
            env={"PORT": "8123"},
        ),
        Case(
            ["--url", "u", "--model", "m", "--timeout", "2", "--folder", "f", "--dtype", "float32"],
            [("ministream.run.ready:ready", dict(url="u", model="m", timeout=2.0, folder=P("f"), dtype="float32"))],
        ),
    ],
    "serve-bench": [
        Case(
            [],
            [
                (
                    "ministream.bench.vllm_client:serve_bench",
                    dict(url="http://127.0.0.1:8000", model=None, concurrency=32, max_tokens=128, num_prompts=None)
                    | dict(dataset="corpus", tokenizer=None),
                )
            ],
            rc=STATUS,
        ),
        Case(
            ["--url", "u", "--model", "m", "--concurrency", "4", "--max-tokens", "8", "--num-prompts", "16"]
            + ["--dataset", "random", "--tokenizer", "t"],
            [
                (
                    "ministream.bench.vllm_client:serve_bench",
                    dict(url="u", model="m", concurrency=4, max_tokens=8, num_prompts=16)
                    | dict(dataset="random", tokenizer="t"),
                )
            ],
            rc=STATUS,
        ),
    ],
    "bench": benchmark_cases(
        "ministream.bench.offline:bench",
        BENCH,
        ["--systems", "a,b", "--configs", "x:y,z:w", "--batches", "1,8", "--new-tokens", "4", "--prompt-len", "8"]
        + ["--repeats", "2", "--serial-requests", "1", "--bind-configs", "q:r", "--copy-mib", "16"]
        + ["--kv-cache-gib", "5", "--no-tooling"],
        dict(systems=["a", "b"], configs=["x:y", "z:w"], batches=[1, 8], new_tokens=4, prompt_len=8, repeats=2)
        | dict(serial_requests=1, bind_configs=["q:r"], copy_mib=16, kv_cache_gib=5, tooling=False),
    ),
    "bench-serve": benchmark_cases(
        "ministream.bench.serving:bench_serve",
        BENCH_SERVE,
        ["--systems", "a", "--rates", "0.5,2", "--num-prompts", "4", "--dtype", "w8a8", "--preset", "tiny"]
        + ["--ttft-target-s", "1", "--tpot-target-s", "0.25", "--seed", "7", "--bisect-steps", "0"],
        dict(systems=["a"], rates=[0.5, 2.0], num_prompts=4, dtype="w8a8", preset="tiny", ttft_target_s=1.0)
        | dict(tpot_target_s=0.25, seed=7, bisect_steps=0),
    ),
    "bench-nodes": [
        Case(
            [],
            [("ministream.bench.multinode:bench_nodes", dict(out=P("build/bench"), quick=False, systems=None))],
            rc=STATUS,
        ),
        Case(
            ["--out", "o", "--quick", "--systems", "tp1,tp2"],
            [("ministream.bench.multinode:bench_nodes", dict(out=P("o"), quick=True, systems=["tp1", "tp2"]))],
            rc=STATUS,
        ),
    ],
    "bench-step": [
        Case(
            [],
            [
                (
                    "ministream.bench.decode_step:bench_step",
                    dict(out=P("build/bench/step"), presets=["reference"], dtypes=["float32", "bfloat16"])
                    | dict(variants=["default", "in_process", "kv_per_call", "bfloat16"], note=""),
                )
            ],
            rc=STATUS,
        ),
        Case(
            ["--out", "o", "--presets", "tiny,demo", "--dtypes", "w8a8", "--variants", "default+bfloat16"]
            + ["--note", "n"],
            [
                (
                    "ministream.bench.decode_step:bench_step",
                    dict(out=P("o"), presets=["tiny", "demo"], dtypes=["w8a8"], variants=["default+bfloat16"])
                    | dict(note="n"),
                )
            ],
            rc=STATUS,
        ),
    ],
    "bench-scale": [
        Case(
            [],
            [
                (
                    "ministream.bench.scale:scale_command",
                    dict(out=P("build/bench-scale"), sizes=["reference", "1.2b"], quick=False, force=False)
                    | dict(report_only=False, keep=False, new_tokens=None, repeats=None, tools=None),
                )
            ],
            rc=STATUS,
        ),
        Case(
            ["--out", "o", "--sizes", "1.2b,7b", "--quick", "--force", "--keep"]
            + ["--new-tokens", "16", "--repeats", "2", "--tools", "quantize,fingerprint"],
            [
                (
                    "ministream.bench.scale:scale_command",
                    dict(out=P("o"), sizes=["1.2b", "7b"], quick=True, force=True, report_only=False, keep=True)
                    | dict(new_tokens=16, repeats=2, tools=["quantize", "fingerprint"]),
                )
            ],
            rc=STATUS,
        ),
        Case(
            ["--report"],
            [
                (
                    "ministream.bench.scale:scale_command",
                    dict(out=P("build/bench-scale"), sizes=["reference", "1.2b"], quick=False, force=False)
                    | dict(report_only=True, keep=False, new_tokens=None, repeats=None, tools=None),
                )
            ],
            rc=STATUS,
        ),
    ],
    "bench-kernels": [
        Case(
            [],
            [
                (
                    "ministream.bench.kernels:bench_kernels",
                    dict(out=P("build/bench/kernels"), size="1.2b", layers=None)
                    | {"widths": list(importlib.import_module("ministream.bench.kernels").WIDTHS)}
                    | {"batches": list(importlib.import_module("ministream.bench.kernels").BATCHES)},
                )
            ],
            rc=STATUS,
        ),
        Case(
            ["--out", "o", "--size", "7b", "--widths", "w8a8,bfloat16", "--layers", "2", "--batches", "1,8,32"],
            [
                (
                    "ministream.bench.kernels:bench_kernels",
                    dict(out=P("o"), size="7b", widths=["w8a8", "bfloat16"], layers=2, batches=[1, 8, 32]),
                )
            ],
            rc=STATUS,
        ),
    ],
    "bench-accuracy": [
        Case(
            [],
            [
                (
                    "ministream.bench.accuracy:bench_accuracy",
                    dict(out=P("build/bench/accuracy"), folders=[], presets=[], text=None)
                    | {"systems": list(importlib.import_module("ministream.bench.accuracy").SYSTEMS)},
                )
            ],
            rc=STATUS,
        ),
        Case(
            ["f1", "f2", "--out", "o", "--presets", "tiny,,reference", "--systems", "vllm float32,llama.cpp f32"]
            + ["--text", "t.txt"],
            [
                (
                    "ministream.bench.accuracy:bench_accuracy",
                    dict(out=P("o"), folders=[P("f1"), P("f2")], presets=["tiny", "reference"], text=P("t.txt"))
                    | dict(systems=["vllm float32", "llama.cpp f32"]),
                )
            ],
            rc=STATUS,
        ),
    ],
    "tune": [
        Case(
            [],
            [("ministream.bench.tune:tune", dict(out=P("build/tune"), model=None, quick=False, force=False))],
            rc=STATUS,
        ),
        Case(
            ["--model", "m", "--out", "o", "--quick", "--force"],
            [("ministream.bench.tune:tune", dict(out=P("o"), model=P("m"), quick=True, force=True))],
            rc=STATUS,
        ),
        Case(
            ["--quick"],
            [("ministream.bench.tune:tune", dict(out=P("build/tune"), model=None, quick=True, force=False))],
            rc=STATUS,
        ),
    ],
}
JOBS = sorted({target for cases in CASES.values() for case in cases for target, _ in case.calls})


def function(target: str):
    module, name = target.split(":")
    return importlib.import_module(module), name


@pytest.fixture
def jobs(monkeypatch) -> list[tuple[str, dict]]:
    """Every job function a command calls, stood in for by a recorder: the calls, in order, with their keywords
    (a job is given its options by name, never by position); each returns RETURNS' value, else STATUS."""
    calls: list[tuple[str, dict]] = []
    for target in JOBS:
        module, name = function(target)
        real = getattr(module, name)

        def record(*args, _target=target, _real=real, **kwargs):
            assert not args, f"{_target} given {args} by position"
            inspect.signature(_real).bind(**kwargs)  # names the real function takes
            calls.append((_target, kwargs))
            return RETURNS.get(_target, STATUS)

        monkeypatch.setattr(module, name, record)
    return calls


def test_every_command_is_in_the_table_once_and_in_the_parser():
    listed = re.search(r"\{([a-z,-]+)\}", build_parser([]).format_usage()).group(1).split(",")
    table = [c.name for c in COMMANDS]
    assert listed == table and len(set(table)) == len(table)
    assert sorted(CASES) == sorted(table)  # and each has its cases here


@pytest.mark.parametrize(
    "command, case",
    [pytest.param(name, case, id=f"{name}-{i}") for name, cases in CASES.items() for i, case in enumerate(cases)],
)
def test_each_command_gives_its_job_exactly_the_options_parsed(command, case, jobs, monkeypatch):
    monkeypatch.delenv("PORT", raising=False)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    a = parse_args([command, *case.argv])
    assert (a.func(a), jobs) == (case.rc, case.calls)


@fuzz_settings(25)
@given(
    preset=st.sampled_from([None, "tiny", "tiny-gqa", "demo"]),
    steps=st.sampled_from([None, 1, 50]),
    seed=st.sampled_from([None, 0, 9]),
    dtype=st.sampled_from([None, "float32", "bfloat16"]),
    prefix=st.sampled_from([None, "none", "ddp", "compile", "both"]),
    shape=st.fixed_dictionaries(
        {k: st.sampled_from([None, 2, 64]) for k in ("--n-kv-heads", "--head-dim", "--vocab-size", "--ranks")}
    ),
    flags=st.sets(st.sampled_from(["--untied", "--one-based", "--bare", "--no-optimizer", "--force"])),
)
def test_checkpoint_gives_make_checkpoint_every_option_in_any_mix(preset, steps, seed, dtype, prefix, shape, flags):
    """Over many mixes of checkpoint's options (its widest command): each lands on its own keyword."""
    calls = []
    demo = importlib.import_module("ministream.checkpoint.demo")
    options = {"--preset": preset, "--steps": steps, "--seed": seed, "--dtype": dtype, "--prefix": prefix, **shape}
    argv = ["checkpoint", "--out", "o", *[x for k, v in options.items() if v is not None for x in (k, str(v))]]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(demo, "make_checkpoint", lambda **kwargs: calls.append(kwargs))
        a = parse_args([*argv, *sorted(flags)])
        assert a.func(a) == 0
    assert calls == [
        TRAINING
        | {k: v for k, v in dict(preset=preset, steps=steps, seed=seed, dtype=dtype, prefix=prefix).items() if v}
        | {k.lstrip("-").replace("-", "_"): v for k, v in shape.items() if v is not None}
        | {"tie_embeddings": False if "--untied" in flags else None, "one_based": "--one-based" in flags}
        | {"bare": "--bare" in flags, "optimizer": "--no-optimizer" not in flags, "force": "--force" in flags}
    ]
