"""The benchmarks' commands: vLLM's client against a server, the benchmarks (offline, serving, nodes, one decode
step, accuracy), and this machine's tuning."""

import argparse
from pathlib import Path

from ..run.engine import add_engine_options
from . import Command, Subparsers, heldout_text, listed, options


def given(a: argparse.Namespace, settings: dict) -> dict:
    """The command line's value (None where not given) of each of a benchmark's settings that it has an option for."""
    return {name: getattr(a, name) for name in settings if hasattr(a, name)}


def note_and_report(p: argparse.ArgumentParser, result: str) -> None:
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. 'machine shared')")
    p.add_argument(
        "--report",
        action="store_true",
        help=f"measure nothing: the table and the chart again, from OUT/{result} (also of an interrupted run)",
    )


class ServeBench(Command):
    name = "serve-bench"
    help = "vLLM's benchmark client against a running server, N requests at once"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..bench import vllm_client

        p = self.parser(sub, vllm_client.serve_bench.__doc__, raw=False)
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
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..bench import vllm_client

        return vllm_client.serve_bench(
            **options(a, "url", "model", "concurrency", "max_tokens", "num_prompts", "dataset", "tokenizer")
        )


class Bench(Command):
    name = "bench"
    help = "throughput, latency and memory: patched vLLM vs LLaMA, the reference model, core binding; tooling costs"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..bench import offline

        default_configs = offline.FULL["configs"]
        assert isinstance(default_configs, list)
        p = self.parser(sub, offline.__doc__)
        p.add_argument("--out", type=Path, default=offline.DEFAULT_OUT, help="output folder (default: %(default)s)")
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
        p.add_argument("--systems", type=listed(str), help=f"subset of {','.join(offline.SYSTEMS)}")
        p.add_argument("--no-tooling", dest="tooling", action="store_false", default=None)
        note_and_report(p, "bench.json")
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..bench import offline

        return offline.bench(
            **options(a, "out", "quick", "systems", "note", report_only="report"), **given(a, offline.FULL)
        )


class BenchServe(Command):
    name = "bench-serve"
    help = (
        "serving load with vLLM's benchmark client: ministream serve vs LLaMA names vs the reference model one "
        "request at a time"
    )

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..bench import serving
        from ..bench.widths import WIDTHS

        quick_rates, full_rates = serving.QUICK["rates"], serving.FULL["rates"]
        assert isinstance(quick_rates, list) and isinstance(full_rates, list)
        p = self.parser(sub, serving.__doc__)
        p.add_argument("--out", type=Path, default=serving.DEFAULT_OUT, help="output folder (default: %(default)s)")
        p.add_argument(
            "--quick",
            action="store_true",
            help="smoke run: rates "
            + ",".join(f"{r:g}" for r in quick_rates)
            + f", {serving.QUICK['num_prompts']} short requests each",
        )
        p.add_argument(
            "--rates",
            type=listed(float),
            help="offered request rates (req/s), comma-separated (default: "
            + ",".join(f"{r:g}" for r in full_rates)
            + ")",
        )
        p.add_argument(
            "--num-prompts",
            type=int,
            help="requests per rate (default: about a minute of arrivals, "
            f"{serving.FULL['min_prompts']} to {serving.FULL['max_prompts']})",
        )
        add_engine_options(p, "bench", ["dtype"], benchmark=serving.FULL, choices={"dtype": list(WIDTHS)})
        p.add_argument(
            "--preset", help=f"the model: a `ministream checkpoint` preset (default: {serving.FULL['preset']})"
        )
        p.add_argument("--systems", type=listed(str), help=f"subset of {','.join(serving.SYSTEMS)}")
        p.add_argument(
            "--ttft-target-s",
            type=float,
            help=f"p99 time to first token a sustained rate keeps (default: {serving.FULL['ttft_target_s']:g})",
        )
        p.add_argument(
            "--tpot-target-s",
            type=float,
            help=f"median time per output token a sustained rate keeps (default: {serving.FULL['tpot_target_s']:g})",
        )
        p.add_argument("--seed", type=int, help="the prompt set's and the arrivals' seed (default: 0)")
        p.add_argument(
            "--bisect-steps",
            type=int,
            help="rates tried after the grid, between the highest sustained and the lowest failing, until they are "
            f"within 10%% (default: {serving.FULL['bisect_steps']}; 0 with --quick)",
        )
        note_and_report(p, "serve.json")
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..bench import serving

        return serving.bench_serve(
            **options(a, "out", "quick", "systems", "note", report_only="report"), **given(a, serving.FULL)
        )


class BenchNodes(Command):
    name = "bench-nodes"
    help = "TP=1 vs TP=2 on one node vs TP=2 over two nodes: throughput and TTFT at concurrency 1 and 32"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..bench import multinode

        p = self.parser(sub, multinode.__doc__)
        p.add_argument("--out", type=Path, default=Path("build/bench"), help="output folder (default: %(default)s)")
        p.add_argument("--quick", action="store_true", help="smoke run: the tiny model, a few short requests")
        p.add_argument("--systems", type=lambda s: s.split(","), help="some of: " + ", ".join(multinode.SYSTEMS))
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..bench import multinode

        return multinode.bench_nodes(out=a.out, quick=a.quick, systems=a.systems)


class BenchStep(Command):
    name = "bench-step"
    help = "one decode step at batch 1 taken apart: forward, logits, inputs, sampling, the rest (vLLM, llama.cpp)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..bench import decode_step

        p = self.parser(sub, decode_step.__doc__)
        p.add_argument(
            "--out", type=Path, default=Path("build/bench/step"), help="output folder (default: %(default)s)"
        )
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
            default=list(decode_step.VARIANTS),
            help=", ".join(decode_step.VARIANTS) + ", or a+b: both",
        )
        p.add_argument("--note", default="")
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..bench import decode_step

        return decode_step.bench_step(**options(a, "out", "presets", "dtypes", "variants", "note"))


class BenchAccuracy(Command):
    name = "bench-accuracy"
    help = "every width on vLLM and llama.cpp against the full-precision reference: greedy ids and perplexity"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..bench import accuracy

        p = self.parser(sub, accuracy.__doc__)
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
            "--systems",
            type=lambda s: s.split(","),
            default=list(accuracy.SYSTEMS),
            help=", ".join(accuracy.SYSTEMS),
        )
        heldout_text(p)
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..bench import accuracy

        return accuracy.bench_accuracy(**options(a, "out", "folders", "presets", "systems", "text"))


class Tune(Command):
    name = "tune"
    help = (
        "choose this machine's core binding, zentorch and an offline engine's core process by a same-run check "
        "against vLLM's own (make install)"
    )

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..bench import tune

        p = self.parser(sub, tune.__doc__)
        p.add_argument("--model", type=Path, help="a converted folder to measure on (default: the reference shape)")
        p.add_argument("--out", type=Path, default=tune.DEFAULT_OUT, help="logs and models (default: %(default)s)")
        p.add_argument("--quick", action="store_true", help="batch 1 only, 8 tokens, 3 repeats, eager: a smoke run")
        p.add_argument("--force", action="store_true", help="measure again where this machine has a record")
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..bench import tune

        return tune.tune(**options(a, "out", "model", "quick", "force"))
