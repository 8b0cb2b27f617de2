"""The `ministream` command: the command line only; each subcommand delegates to the module of its stage."""

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

from . import MiniStreamError


# --- the training side ----------------------------------------------------------------------

def add_checkpoint(sub) -> None:
    from .checkpoint import demo

    p = sub.add_parser("checkpoint", help="write a format-1 training checkpoint (tests, demo, benchmarks)",
                       description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=list(demo.PRESETS))
    p.add_argument("--out", type=Path, required=True, help="folder to write model.pt and tokenizer.json into")
    p.add_argument("--steps", type=int, help="training steps (preset default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--n-kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--vocab-size", type=int, help="rows of the embedding (>= the tokenizer's size)")
    p.add_argument("--untied", dest="tie_embeddings", action="store_false", default=None)
    p.add_argument("--prefix", default="none", choices=["none", "ddp", "compile", "both"],
                   help="key prefix as DistributedDataParallel (module.) / torch.compile (_orig_mod.) leave it")
    p.add_argument("--one-based", action="store_true", help="number blocks from 1, as some exports do")
    p.add_argument("--bare", action="store_true", help="a bare state dict, with no config entry")
    p.add_argument("--no-optimizer", dest="optimizer", action="store_false", help="leave out optimizer state")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=lambda a: demo.make_checkpoint(
        a.out, a.preset, a.steps, a.seed, a.dtype, a.prefix, a.one_based, a.bare, a.optimizer, a.force,
        n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, vocab_size=a.vocab_size, tie_embeddings=a.tie_embeddings) and 0)


def add_convert(sub) -> None:
    from .checkpoint import convert
    from .spec import DTYPES, TrainConfig

    p = sub.add_parser("convert", help="training checkpoint folder -> HF-style folder", description=convert.__doc__)
    p.add_argument("raw", type=Path, help="training checkpoint folder (model.pt, tokenizer.json) or model.pt")
    p.add_argument("out", type=Path, nargs="?", help="output folder (written whole, or not at all)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--dry-run", action="store_true", help="print the mapping and key differences; write nothing")
    p.add_argument("--chat-template", type=Path, help="Jinja chat template file for tokenizer_config.json")
    p.add_argument("--max-shard-size", default=convert.DEFAULT_SHARD_SIZE,
                   help="split model.safetensors above this size (e.g. 500MB; huggingface_hub's units)")
    g = p.add_argument_group("train config", "values for a checkpoint without a config entry "
                             "(checked against the tensor shapes)")
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
            return convert.dry_run(load_checkpoint(a.raw), overrides)
        if a.out is None:
            raise MiniStreamError("give an output folder: ministream convert RAW OUT (or --dry-run)")
        template = a.chat_template.read_text() if a.chat_template else None
        convert.convert(a.raw.parent if a.raw.is_file() else a.raw, a.out, a.dtype, a.force, template,
                        a.max_shard_size, overrides)
        return 0

    p.set_defaults(func=run)


# --- the vLLM side: patch, port, matrix, wheel, install, image ------------------------------


# --- using an engine: generate, serve, serve-bench, verify, doctor, bench -----------------------


# modules that still register their own subcommands (being moved into the sections above)
MODULES = [
    "ministream.run.generate",  # generate: text from the reference model and the installed vLLM
    "ministream.fork.patch",  # patch: pristine vLLM tree + our patch set, in git
    "ministream.fork.port",  # port: carry a patch set to another vLLM release (three-way merge)
    "ministream.fork.matrix",  # matrix: every supported vLLM version's patch set, checked statically
    "ministream.fork.wheel",  # wheel, install: release wheel + patched Python files
    "ministream.run.verify",  # verify: golden outputs vs the installed vLLM, layer by layer on failure
    "ministream.run.doctor",  # doctor: a converted folder and the installed vLLM, checked without an engine
    "ministream.run.bench",  # bench: patched vLLM vs LLaMA, the reference model, core binding; tooling costs
    "ministream.run.serve",  # serve, serve-bench: OpenAI-compatible server (vllm serve) on a converted folder
    "ministream.fork.image",  # image: the serving container image (docker/), docker or podman
]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="ministream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_checkpoint(sub)
    add_convert(sub)
    for module in MODULES:
        importlib.import_module(module).register(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except MiniStreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
