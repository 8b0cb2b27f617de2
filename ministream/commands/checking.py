"""The commands across releases: the matrix of patch sets, vLLM's own tests, and the CUDA wheel's checks."""

import argparse
from pathlib import Path

from ..paths import BUILD
from . import Command, Subparsers, for_release, options
from .building import nearest_pins


class Matrix(Command):
    name = "matrix"
    help = "check every supported vLLM version's patch set (static)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checks import matrix

        p = self.parser(sub, matrix.__doc__)
        p.add_argument("--versions", help="comma-separated vLLM releases (default: all of patches/versions.json)")
        p.add_argument(
            "--out", type=Path, default=BUILD, help="where matrix.json and matrix.md go (default: %(default)s)"
        )
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
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..checks import environments, lines, matrix

        if a.clean:
            versions = a.versions.split(",") if a.versions else None
            for path in environments.remove_environments(versions=versions):
                print(f"removed {path}")
            return 0
        if a.run:
            return lines.run_lines(versions=a.versions, out=a.out, docs=a.docs)
        return matrix.check_versions(versions=a.versions, out=a.out)


class VllmTests(Command):
    name = "vllm-tests"
    help = "vLLM's own tests of MiniStream, from the patched tree, offline"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checks import vllm_tests

        p = self.parser(sub, vllm_tests.__doc__)
        for_release(p)
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
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..checks import vllm_tests

        return vllm_tests.run_vllm_tests(**options(a, "version", "tree", "compare", "out", "quick"))


class CudaSmoke(Command):
    name = "cuda-smoke"
    help = "the patched CUDA wheel in a fresh environment, checked without a GPU"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checks import cuda_smoke

        p = self.parser(sub, cuda_smoke.__doc__)
        for_release(p)
        nearest_pins(p)
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..checks import cuda_smoke

        return cuda_smoke.run_smoke(version=a.version, nearest_pins=a.nearest_pins)


class GpuProof(Command):
    name = "gpu-proof"
    help = "what only a GPU can show of the patched CUDA wheel, one JSON report"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..checks import gpu_proof

        p = self.parser(sub, gpu_proof.__doc__)
        for_release(p)
        nearest_pins(p)
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
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..checks import gpu_proof

        if a.judge:
            return gpu_proof.judge_run(version=a.version, outputs_file=a.judge)
        done = gpu_proof.run_proof(
            version=a.version, nearest_pins=a.nearest_pins, prepare_only=a.prepare_only or a.export
        )
        if a.export and done == 0:
            gpu_proof.export(version=a.version)
        return done
