"""The commands that use an engine or judge one: generate, verify, doctor, eval, serve and its readiness probe,
and a folder's fingerprint."""

import argparse
import sys
from pathlib import Path

from .. import MiniStreamError
from ..run.engine import EngineSettings, add_engine_options
from . import Command, Subparsers, options, seconds

RAW_HELP = (
    "training checkpoint folder for the reference model (default: the reference model reads the converted folder)"
)


class Generate(Command):
    name = "generate"
    help = "greedy text from the reference model and the installed vLLM"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..run import generate

        p = self.parser(sub, generate.__doc__, raw=False)
        p.add_argument("model", type=Path, help="converted HF-style folder")
        p.add_argument("--raw", type=Path, help=RAW_HELP)
        p.add_argument("--engine", default="both", choices=["both", "reference", "vllm"])
        p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: a built-in set)")
        p.add_argument("--max-tokens", type=int, default=32)
        add_engine_options(p, "offline", ["dtype", "tp", "enforce_eager"])
        p.add_argument("--logprobs", type=int, default=0, help="also record the top-k logprobs of each new token")
        p.add_argument(
            "--stop-at-eos", action="store_true", help="stop at the eos token (default: exactly --max-tokens)"
        )
        p.add_argument("--json", type=Path, help="write token ids, logprobs, texts and timings here")
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..run import generate

        generate.generate(
            **options(
                a,
                "model",
                "raw",
                "max_tokens",
                "logprobs",
                "stop_at_eos",
                engines="engine",
                prompts="prompt",
                json_path="json",
            ),
            settings=EngineSettings.from_args(a),
        )
        return 0


class Verify(Command):
    name = "verify"
    help = "golden outputs from the reference model vs the installed vLLM; layer by layer on failure"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..run import verify

        p = self.parser(sub, verify.__doc__)
        p.add_argument("model", type=Path, help="converted HF-style folder")
        p.add_argument("--raw", type=Path, help=RAW_HELP)
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
            help="where the golden file, vLLM's outputs and the layer dumps go (default: out/verify/<model folder "
            "name>)",
        )
        p.add_argument(
            "--threshold",
            type=float,
            help="cosine below which a layer diverges "
            f"(default: {', '.join(f'{k} {v}' for k, v in verify.THRESHOLDS.items())})",
        )
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..run import verify

        return verify.run_verify(
            **options(
                a,
                "model",
                "raw",
                "out",
                "max_tokens",
                "top_k",
                "threshold",
                prompts_file="prompts",
                golden_path="golden",
            ),
            settings=EngineSettings.from_args(a),
        )


class Doctor(Command):
    name = "doctor"
    help = "check a converted folder and the installed vLLM (no engine)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..run import doctor

        p = self.parser(sub, doctor.__doc__, raw=False)
        p.add_argument("model", type=Path, help="converted HF-style folder")
        add_engine_options(p, "judge", ["dtype", "max_model_len", "kv_cache_gib"])  # of the engine serve would get
        p.add_argument("--memory-gib", type=float, help="memory for weights + KV cache (default: the GPU's, else RAM)")
        p.add_argument("--vllm-dir", type=Path, help=argparse.SUPPRESS)  # tests: another vllm/ package to read
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..run import doctor

        return doctor.run_doctor(
            model=a.model, vllm_dir=a.vllm_dir, settings=EngineSettings.from_args(a), memory_gib=a.memory_gib
        )


class Fingerprint(Command):
    name = "fingerprint"
    help = "record what a folder's model computes (for a folder written before convert and quantize did)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checkpoint import fingerprint as recorded

        p = self.parser(sub, recorded.__doc__)
        p.add_argument(
            "model", type=Path, help="converted (or quantized) folder; the file is written whole, or not at all"
        )
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..run import fingerprint

        return fingerprint.refresh(folder=a.model)


class Eval(Command):
    name = "eval"
    help = "lm-evaluation-harness on a converted folder, through a route"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..run import eval as lm_eval_run

        p = self.parser(sub, lm_eval_run.__doc__)
        p.add_argument("model", type=Path, help="converted HF-style folder")
        p.add_argument("--route", choices=list(lm_eval_run.ROUTES), default="wheel", help="(default: %(default)s)")
        p.add_argument(
            "--tasks",
            type=lambda s: [t for t in s.split(",") if t],
            help=f"lm-eval task names, comma-separated (default: ours, {','.join(lm_eval_run.OURS)})",
        )
        p.add_argument(
            "--include-path", type=Path, help="folder of your own lm-eval task YAMLs (lm-eval's --include_path)"
        )
        p.add_argument(
            "--out", type=Path, default=Path("build/eval"), help="results.json goes here (default: %(default)s)"
        )
        p.add_argument("--limit", type=int, help="the first N items of each task only")
        p.add_argument(
            "--url", help="route server: a server already running (e.g. http://127.0.0.1:8000), not one started"
        )
        add_engine_options(p, "offline", ["dtype", "enforce_eager"])
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..run import eval as lm_eval_run

        return lm_eval_run.run_eval(
            **options(
                a,
                "route",
                "out",
                "tasks",
                "dtype",
                "limit",
                "url",
                folder="model",
                include="include_path",
                eager="enforce_eager",
            )
        )


class Serve(Command):
    name = "serve"
    help = "OpenAI-compatible server (vllm serve) on a converted folder"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..run import serve

        p = self.parser(
            sub,
            serve.__doc__,
            raw=False,
            epilog="Options of `vllm serve` that serve has none of go to vLLM as they are (e.g. --max-num-seqs 64), "
            "and vLLM's names of serve's own set them (--model DIR, --tensor-parallel-size 2, --served-model-name "
            "N): a recipe written for vLLM's server runs with serve's defaults.",
            allow_abbrev=False,  # an option of vLLM's is never taken for a prefix of serve's
        )
        p.add_argument("model", type=Path, nargs="?", help="converted HF-style folder (or --model DIR)")
        p.add_argument(
            "--host", default="127.0.0.1", help="address to listen on (default: loopback only; 0.0.0.0 for all)"
        )
        p.add_argument("--port", type=int, default=8000)
        p.add_argument("--name", help="served model name (default: the folder's name)")
        add_engine_options(p, "server", ["dtype", "tp", "pp", "max_model_len", "enforce_eager"])
        p.add_argument("--nnodes", type=int, default=1, help="machines this server spans (vLLM's multiproc executor)")
        p.add_argument(
            "--node-rank", type=int, default=0, help="this machine's rank: 0 serves the API, others headless"
        )
        p.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address, as every node reaches it")
        p.add_argument("--master-port", type=int, default=29501, help="rank 0's torch.distributed port")
        p.add_argument(
            "--rendezvous-port", type=int, help="rank 0's port for the nodes' check (default: master port + 1)"
        )
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
            "--vllm-args",
            default="",
            help="more `vllm serve` options, one string, e.g. --vllm-args='--max-num-seqs 64'",
        )
        p.add_argument(
            "--lora",
            action="append",
            default=[],
            metavar="NAME=DIR",
            help="serve the PEFT adapter in DIR (ministream convert-lora) beside the model, as the model NAME "
            "(repeatable): vLLM's LoRA on, its rank and slots fitted to the adapters",
        )
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..run import serve

        # vLLM's names set a's first (cli.parse_args put them in vllm_options); by where they came from, which a
        # refusal names
        extra = {"the command line": serve.passed_on(a.vllm_options, a), "--vllm-args": serve.vllm_args(a.vllm_args)}
        return serve.serve(
            **options(a, "model", "host", "port", "name", "stop_timeout", "api_key", loras="lora"),
            settings=EngineSettings.from_args(a),
            extra=extra,
            cluster=cluster(a),
        )


def cluster(a: argparse.Namespace):
    """serve's nodes (run/nodes.py's Plan) from --nnodes and the rest; None for one machine."""
    from ..run import nodes

    if a.nnodes == 1:
        return None
    if not 0 <= a.node_rank < a.nnodes:
        raise MiniStreamError(f"--node-rank {a.node_rank}: give 0 to {a.nnodes - 1} for --nnodes {a.nnodes}")
    return nodes.Plan(
        **options(a, "nnodes", "master_addr", "master_port", rank="node_rank", timeout="node_timeout"),
        rendezvous_port=a.rendezvous_port or a.master_port + 1,
    )


class Ready(Command):
    name = "ready"
    help = "exit 0 once a server answers with its model (a readiness probe)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..run import ready

        p = self.parser(sub, ready.__doc__)
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
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..run import ready

        url = a.url or ready.default_url()
        try:
            name, how = ready.ready(**options(a, "model", "timeout", "folder", "dtype"), url=url)
        except MiniStreamError as e:  # a state, not an input error: 1, as a probe expects
            print(f"not ready: {e}", file=sys.stderr)
            return 1
        print(f"ready: {url} serves {name!r}: {how}")
        return 0
