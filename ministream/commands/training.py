"""The training side's commands: a demo checkpoint, and a training checkpoint converted (HF folder, LoRA, GGUF,
quantized widths, the transformers files)."""

import argparse
import dataclasses
from pathlib import Path

from .. import MiniStreamError
from ..checkpoint import tokenizer
from ..paths import CACHE
from ..spec import DTYPES, LORA_TABLE, TrainConfig
from . import Command, Subparsers, heldout_text, options, src_out


def ignore_config_key(p) -> None:
    p.add_argument(
        "--ignore-config-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key of the training checkpoint's train config that format 1 does not define, and that you know "
        "does not change the math: converted without it, and said (repeatable). Any other such key is refused",
    )


class Checkpoint(Command):
    name = "checkpoint"
    help = "write a format-1 training checkpoint (tests, demo, benchmarks)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checkpoint import demo

        p = self.parser(sub, demo.__doc__)
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
        p.add_argument(
            "--ranks",
            type=int,
            metavar="N",
            help="write the sharded form FSDP saves at scale instead of one model.pt: a torch.distributed.checkpoint "
            "folder checkpoint/ (.metadata and one .distcp file per rank) of N ranks, beside config.json",
        )
        g = p.add_argument_group("LoRA adapter", "--adapter BASE: write a LoRA adapter.pt for BASE into --out instead")
        g.add_argument("--adapter", type=Path, metavar="BASE", help="the training checkpoint the adapter is for")
        g.add_argument("--rank", type=int, default=8, help="the adapter's r (default: %(default)s)")
        g.add_argument(
            "--alpha", type=float, default=16.0, help="its alpha: updates are alpha / r * B @ A (default: 16)"
        )
        g.add_argument(
            "--targets",
            type=lambda s: s.split(","),
            default=list(LORA_TABLE),
            help=f"the weights it updates, some of {','.join(LORA_TABLE)} (default: all)",
        )
        g.add_argument(
            "--strength", type=float, default=0.25, help="each update's norm over its weight's (default: %(default)s)"
        )
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..checkpoint import demo

        if a.adapter:
            demo.make_adapter(
                **options(
                    a, "out", "rank", "alpha", "targets", "strength", "seed", "dtype", "prefix", "force", base="adapter"
                )
            )
            return 0
        demo.make_checkpoint(
            **options(
                a,
                "out",
                "preset",
                "steps",
                "seed",
                "dtype",
                "prefix",
                "one_based",
                "bare",
                "optimizer",
                "force",
                "cache",
                "ranks",
                "n_kv_heads",
                "head_dim",
                "vocab_size",
                "tie_embeddings",
            )
        )
        return 0


class Convert(Command):
    name = "convert"
    help = "training checkpoint folder -> HF-style folder"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checkpoint import convert

        p = self.parser(sub, convert.__doc__, raw=False)
        p.add_argument("raw", type=Path, help="training checkpoint folder (model.pt, tokenizer.json) or model.pt")
        p.add_argument("out", type=Path, nargs="?", help="output folder (written whole, or not at all)")
        p.add_argument(
            "--dtype",
            choices=list(DTYPES),
            help="the output's dtype (default: the checkpoint's own; float32 on request)",
        )
        p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
        p.add_argument("--dry-run", action="store_true", help="print the mapping and key differences; write nothing")
        p.add_argument("--chat-template", type=Path, help="Jinja chat template file for tokenizer_config.json")
        p.add_argument("--allow-nonfinite", action="store_true", help="write NaN/Inf weights instead of refusing them")
        ignore_config_key(p)
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
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..checkpoint import convert
        from ..checkpoint.format import load_checkpoint

        overrides = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig)}
        if a.dry_run:
            return convert.dry_run(
                ckpt=load_checkpoint(path=a.raw), overrides=overrides, ignore_config_keys=a.ignore_config_key
            )
        if a.out is None:
            raise MiniStreamError("give an output folder: ministream convert RAW OUT (or --dry-run)")
        convert.convert(
            **options(
                a, "out", "dtype", "force", "max_shard_size", "allow_nonfinite", ignore_config_keys="ignore_config_key"
            ),
            raw_dir=a.raw.parent if a.raw.is_file() else a.raw,
            chat_template=tokenizer.read_chat_template(path=a.chat_template) if a.chat_template else None,
            overrides=overrides,
        )
        return 0


class ConvertLora(Command):
    name = "convert-lora"
    help = "the trainer's LoRA adapter.pt -> a PEFT adapter folder vLLM serves (--lora-modules, serve --lora)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checkpoint import lora

        p = self.parser(sub, lora.__doc__)
        p.add_argument("adapter", type=Path, help="the adapter's folder (adapter.pt), or adapter.pt")
        p.add_argument("out", type=Path, help="output folder (written whole, or not at all)")
        p.add_argument(
            "--base",
            type=Path,
            required=True,
            help="the base model: its converted folder, or its training checkpoint; every shape is checked against it",
        )
        p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
        ignore_config_key(p)
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..checkpoint import lora

        lora.convert_lora(
            **options(a, "out", "base", "force", adapter_dir="adapter", ignore_config_keys="ignore_config_key")
        )
        return 0


class Gguf(Command):
    name = "gguf"
    help = "converted folder or training checkpoint -> one GGUF file for llama.cpp"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checkpoint import gguf

        p = self.parser(sub, gguf.__doc__)
        src_out(
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
        ignore_config_key(p)
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..checkpoint import gguf

        gguf.export(**options(a, "src", "out", "dtype", "force", ignore_config_keys="ignore_config_key"))
        return 0


class Quantize(Command):
    name = "quantize"
    help = "converted folder -> a folder of int8, int4 or fp8 weights vLLM reads (compressed-tensors)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checkpoint import quantize, scheme

        p = self.parser(sub, quantize.__doc__)
        src_out(p, "converted HF-style folder (`ministream convert`)", "the folder to write (whole, or not at all)")
        p.add_argument(
            "--scheme",
            required=True,
            choices=list(scheme.SCHEMES),
            help="w8a8: int8 weights and activations; w4a16: int4 weights in groups of 128, activations as they "
            "are; fp8: float8 weights and activations, for GPUs",
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
        p.add_argument(
            "--calibration-samples", type=int, help="windows of 512 tokens GPTQ calibrates on (default: 128)"
        )
        p.add_argument(
            "--head",
            choices=scheme.HEADS,
            default="float",
            help="float: the head as it is, tied to the embedding where the model ties it (default); quantized: the "
            "head by the same scheme too, rounded to nearest, as a tensor of its own (w8a8, w4a16; vLLM with PR "
            "#37291, e.g. 0.32.0): a decode step reads half the head's bfloat16 bytes at int8",
        )
        heldout_text(p)
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..checkpoint import quantize

        quantize.quantize(
            **options(
                a,
                "src",
                "out",
                "scheme",
                "force",
                "text",
                "method",
                "head",
                calibration="calibration_text",
                samples="calibration_samples",
            )
        )
        return 0


class HfFiles(Command):
    name = "hf-files"
    help = "write this version's transformers files (and config.json's auto_map) into a converted folder, in place"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checkpoint import hf_files

        p = self.parser(sub, hf_files.__doc__)
        p.add_argument("model", type=Path, help="converted (or quantized) folder; written whole, or not at all")
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..checkpoint import hf_files

        return hf_files.refresh(folder=a.model)
