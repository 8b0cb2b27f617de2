"""How an engine runs, said once: the settings every command that starts one (generate, verify, serve, the
benchmarks' engines) or judges one (doctor) takes (EngineSettings), their command-line options
(add_engine_options), and what this machine adds to them, chosen in one place: KV cache, core binding,
compiled or eager, context length and seed, for the offline engines, the server and the figure doctor judges a
folder against.

On a machine without a GPU: a KV cache of a quarter of the memory available (1 to 64 GiB, split among the
ranks) instead of a fraction of system memory; one core per rank under tensor parallelism; at one rank, the
core binding and zentorch that `ministream tune` chose on this machine (tuned.py: vLLM's own unless ours was
faster beyond the spread), and where it never ran there, every core to the model (vLLM keeps one for its front
end otherwise); for an offline engine at one rank, its core in the caller's process where tune found that
faster (offline_defaults). With a GPU, vLLM's own defaults. Settings the user put in the environment always win.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.version import Version

from .. import MiniStreamError
from . import tuned

GiB = 1 << 30
SEED = 0  # every engine samples from the same seed, so runs repeat
# Offline engines see short prompts; a cap keeps one sequence of a long-context model inside the cache.
# The server keeps the model's own length (or --max-model-len): what doctor judges.
OFFLINE_MAX_MODEL_LEN = 2048
BIND, KV_CACHE = "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"  # vLLM's CPU settings (GiB for the cache)
# "0": an offline engine's core (and, on vLLM's CPU platform, its worker) runs in the caller's process
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
# 0.11-0.19's CPU worker takes its cores from BIND's "|"-list by its global rank (v1/worker/cpu_worker.py,
# omp_cpuids[self.rank]): over nodes, rank 1 on a node with one rank found no entry (IndexError). 0.20 reads it
# by local rank and wants exactly the node's ranks (vllm/utils/ompmultiprocessing.py).
LOCAL_RANK_BIND = Version("0.20")
# vLLM reports usage to its authors unless told not to: nothing this project starts phones home
NO_USAGE_STATS = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


# --- the settings: how an engine runs, and the options that say it ----------------------------------


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """How an engine runs, as a command says it (vLLM says the same with EngineArgs). The defaults are what
    `ministream serve` runs without options, vLLM's own; what this machine adds (its cores, the CPU KV cache)
    is engine_env's, and an offline engine caps the context (llm_kwargs)."""

    dtype: str | None = None  # weights and activations; None: vLLM's "auto", the folder's torch_dtype
    tp: int = 1  # tensor_parallel_size
    pp: int = 1  # pipeline_parallel_size (serve: with --nnodes, over the nodes)
    max_model_len: int | None = None  # longest prompt + output, in tokens; None: the model's
    enforce_eager: bool = False  # eager asked for; else compiled (eager())
    kv_cache_gib: float | None = None  # the CPU KV cache; None: VLLM_CPU_KVCACHE_SPACE, else kv_cache_gib()
    seed: int = SEED  # no option: every engine samples from the same seed

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineSettings":
        """What a parsed command line says: the options add_engine_options gave its parser; the rest default."""
        return cls(**{name: getattr(args, name) for name in getattr(args, "engine_options", ())})


SERVE_DEFAULTS = EngineSettings()  # serve without options, what doctor judges unless told
OFFLINE_DTYPE = "float32"  # an offline engine compared with the reference model (which has no "auto")


def add_engine_options(
    parser: argparse.ArgumentParser,
    kind: str,
    names: Sequence[str],
    benchmark: dict | None = None,
    choices: dict[str, list[str]] | None = None,
) -> None:
    """EngineSettings' fields `names` as options of a command of `kind` (engine_options: their flags, defaults
    and help, as that kind of command says them), recorded for EngineSettings.from_args. benchmark: a
    benchmark's settings, whose values a "bench" option's help names as its default; choices: an option's
    choices that a floor above says (a benchmark's widths)."""
    table = engine_options()
    for name in names:
        if kind not in table[name]:
            raise ValueError(f"a {kind} command has no --{name.replace('_', '-')}: say it in engine_options first")
        spec = dict(table[name][kind])
        if choices and name in choices:
            spec["choices"] = choices[name]
        if benchmark is not None and "help" in spec:
            spec["help"] = spec["help"].format(**benchmark)
        parser.add_argument("--" + name.replace("_", "-"), **spec)
    parser.set_defaults(engine_options=(*(parser.get_default("engine_options") or ()), *names))


def engine_options() -> dict[str, dict[str, dict]]:
    """Each option once: for each kind of command that has it, its argparse keywords. The kinds: "offline", an
    engine compared with the reference model (generate, verify: OFFLINE_DTYPE unless asked); "server", vLLM's
    server (serve: vLLM's defaults); "judge", the engine serve would get, judged without starting it (doctor);
    "bench", a benchmark's engines (bench, bench-serve: the benchmark's own settings are the defaults)."""
    from ..spec import DTYPES

    eager_help = "vLLM without torch.compile (default: compiled, see docs/bench.md, 'Compiled or eager')"
    return {
        "dtype": {
            "offline": dict(default=OFFLINE_DTYPE, choices=list(DTYPES)),
            "server": dict(help="weights/activations dtype (default: vLLM's auto, the folder's torch_dtype)"),
            "judge": dict(choices=list(DTYPES), help="dtype to serve in (default: config.json's)"),
            # what every system of a benchmark runs: the reference server and llama.cpp too; the choices are
            # the benchmark's widths (bench/widths.py), given by the command
            "bench": dict(help="weight width; default: {dtype}"),
        },
        "tp": {
            "offline": dict(type=int, default=1, help="vLLM tensor_parallel_size"),
            "server": dict(type=int, default=1, help="tensor_parallel_size"),
        },
        "pp": {"server": dict(type=int, default=1, help="pipeline_parallel_size (with --nnodes: over the nodes)")},
        "max_model_len": {
            "server": dict(type=int, help="longest prompt + output, in tokens (default: the model's)"),
            "judge": dict(type=int, help="context to serve (default: max_position_embeddings)"),
        },
        "enforce_eager": {kind: dict(action="store_true", help=eager_help) for kind in ("offline", "server")},
        "kv_cache_gib": {
            "judge": dict(
                type=float,
                help="KV cache size (default on CPU: VLLM_CPU_KVCACHE_SPACE, else what `ministream serve` would "
                "choose now)",
            ),
            # whole GiB: what vLLM reads from VLLM_CPU_KVCACHE_SPACE, which the benchmark's engines get
            "bench": dict(
                type=int, help="VLLM_CPU_KVCACHE_SPACE for every engine (default: what `ministream serve` would choose)"
            ),
        },
    }


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and AMD's driver devices


def gpu_visible() -> bool:
    """Whether a GPU's driver device is here: has_gpu's question without importing torch, for the checks that
    run before a command needs torch."""
    return any(os.path.exists(p) for p in GPU_DEVICES)


def eager(asked: bool = False) -> bool:
    """Whether an engine runs eager (enforce_eager): only when asked (the hidden-state dump needs Python in
    forward; a user's --enforce-eager). Else compiled: CUDA graphs on a GPU; on the CPU vLLM's torch.compile
    path (inductor, traced once for every batch size), measured as fast as eager or faster in both dtypes
    (docs/bench.md, "Compiled or eager", the machines named there). A model's first start compiles (a slower
    engine start), cached under VLLM_CACHE_ROOT for the next."""
    return asked


def memory_available() -> int:
    """Bytes this process may still use: MemAvailable, or less under a cgroup (container) limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    avail = avail or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            cap = Path(limit).read_text().strip()
            if cap.isdigit() and int(cap) < (1 << 60):
                avail = min(avail, int(cap) - int(Path(usage).read_text().strip()))
        except (OSError, ValueError):
            continue
    return avail


def kv_cache_gib(available: int | None = None, tp: int = 1) -> int:
    """The CPU KV cache of each rank: a quarter of the memory available, split among the tp ranks
    (vLLM gives every rank the whole VLLM_CPU_KVCACHE_SPACE), at least 1 GiB, at most 64."""
    available = memory_available() if available is None else available
    return max(1, min(64, int(available * 0.25) // tp // GiB))


def core_binding(tp: int = 1, cores: set[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: every core of this process for the model; under tensor parallelism one
    share per rank, ranks separated by "|" ("0|1" on 2 cores with tp 2)."""
    ordered = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if tp == 1:
        return f"{ordered[0]}-{ordered[-1]}" if len(ordered) > 1 else str(ordered[0])
    per = max(1, len(ordered) // tp)
    return "|".join(
        f"{ordered[r * per]}-{ordered[r * per + per - 1]}" if per > 1 else str(ordered[r]) for r in range(tp)
    )


@contextlib.contextmanager
def vllm_failures(model: Path):
    """vLLM's own failure inside (it refused the folder, its engine died) as one line naming the folder and what to
    run, not a traceback: what verify and generate say when the engine they started fails."""
    try:
        yield
    except MiniStreamError:
        raise
    except Exception as e:
        raise MiniStreamError(
            f"vLLM could not serve {model} ({type(e).__name__}: {str(e).strip()[-300:]}); "
            f"run `ministream doctor {model}`"
        ) from e


def check_tp(tp: int) -> None:
    """Refuse a tensor_parallel_size this machine cannot run, before vLLM takes a minute to fail at it:
    one GPU per rank, or without a GPU one core per rank (of the cores this process may use)."""
    if tp < 1:
        raise MiniStreamError(f"--tp {tp}: tensor parallelism needs 1 rank or more")
    if has_gpu():
        import torch

        have, unit, which = torch.cuda.device_count(), "GPU", ""
    else:
        have, unit, which = len(os.sched_getaffinity(0)), "core", f" ({core_binding(1)})"
    if tp > have:
        raise MiniStreamError(
            f"--tp {tp} needs one {unit} per rank, but this process may use {have} {unit}(s)"
            f"{which}: give --tp {have} or less"
        )


def cpu_defaults(tp: int = 1, choice: dict | None = None) -> dict[str, str]:
    """This machine's defaults for vLLM's CPU settings; none with a GPU. Where `ministream tune` measured this
    machine (its record: tuned.chosen(), or `choice`), vLLM's own core binding and platform unless ours were
    faster beyond the spread; one rank only: under tensor parallelism vLLM's own binding keeps a core per rank
    for its front end, which a small machine does not have."""
    if has_gpu():
        return {}
    choice = tuned.chosen() if choice is None else choice
    env = {KV_CACHE: str(kv_cache_gib(tp=tp))}
    if tp > 1 or choice is None or choice.get("binding") != "vllm":
        env[BIND] = core_binding(tp)
    if choice is not None and choice.get("zentorch") is False:
        env["PYTHONPATH"] = str(tuned.NO_ZENTORCH)
    return env


def defaults(tp: int = 1) -> dict[str, str]:
    """Every engine's environment defaults: no usage reporting, and this machine's CPU settings."""
    return {**NO_USAGE_STATS, **cpu_defaults(tp)}


def engine_env(tp: int = 1, environ: dict | None = None) -> dict:
    """An engine's environment: `environ` (this one by default) plus the defaults it does not set (a PYTHONPATH
    default goes before the user's)."""
    env = dict(os.environ if environ is None else environ)
    for k, v in defaults(tp).items():
        env[k] = tuned.hide_zentorch(env.get(k, "")) if k == "PYTHONPATH" else env.get(k, v)
    return env


def kv_cache_bytes(environ: dict | None = None, tp: int = 1) -> int:
    """The CPU KV cache each rank of an engine of `tp` ranks started now gets: the user's VLLM_CPU_KVCACHE_SPACE,
    else ours."""
    said = (os.environ if environ is None else environ).get(KV_CACHE)
    return int(float(said) * GiB) if said else kv_cache_gib(tp=tp) * GiB


# --- the offline engine (LLM) ---------------------------------------------------------------


def offline_max_model_len(model: Path, asked: int | None = None) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    return min(config.get("max_position_embeddings", OFFLINE_MAX_MODEL_LEN), asked or OFFLINE_MAX_MODEL_LEN)


def llm_kwargs(model: Path, settings: EngineSettings, **overrides) -> dict:
    """`LLM(...)`'s arguments for a converted folder; overrides (a caller's reason) replace ours."""
    return {
        "model": str(model),
        "dtype": settings.dtype or "auto",
        "tensor_parallel_size": settings.tp,
        "max_model_len": offline_max_model_len(model, settings.max_model_len),
        "seed": settings.seed,
        "enforce_eager": eager(settings.enforce_eager),
        **({"pipeline_parallel_size": settings.pp} if settings.pp > 1 else {}),
        **overrides,
    }


def offline_defaults(tp: int = 1, pp: int = 1, choice: dict | None = None) -> dict[str, str]:
    """What an offline engine (LLM) adds to cpu_defaults: its core in the caller's process, where `ministream
    tune` found that faster here (the two process hops of a CPU step cost most where cores are few: bench.md,
    the decode step taken apart); one rank only, as vLLM runs several ranks from processes of their own."""
    if has_gpu() or tp > 1 or pp > 1:
        return {}
    choice = tuned.chosen() if choice is None else choice
    return {IN_PROCESS: "0"} if choice is not None and choice.get("in_process") is True else {}


_SET_HERE: set[str] = set()  # what use_defaults put into this process's environment (not the user's)


def use_defaults(tp: int = 1, pp: int = 1) -> None:
    """Put the defaults into this process's environment (vLLM's engine processes inherit it), with an offline
    engine's own; zentorch, where the check turned it off, out of this process's reach too (vLLM may pick its
    platform here). An offline default set for an earlier engine of this process and not this one's is taken
    back; a user's own setting is left as it is."""
    offline = offline_defaults(tp, pp)
    for k in _SET_HERE - set(offline):
        os.environ.pop(k, None)
    _SET_HERE.intersection_update(offline)
    for k, v in offline.items():
        if k not in os.environ:
            os.environ[k] = v
            _SET_HERE.add(k)
    os.environ.update(engine_env(tp))
    if tuned.hides_zentorch(os.environ.get("PYTHONPATH", "")) and "zentorch" not in sys.modules:
        sys.modules["zentorch"] = None  # type: ignore[assignment]  # `import zentorch` raises ImportError


# --- LoRA adapters beside the base model --------------------------------------------------------

# the max_lora_rank values vLLM takes (vllm/config/lora.py, MaxLoRARanks, 0.32)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_settings(ranks: list[int]) -> dict:
    """vLLM's LoRA settings for serving adapters of these ranks (one entry per adapter) in one batch beside the
    base model: the smallest max_lora_rank vLLM takes that holds them all, and a slot for each adapter plus a
    spare one. Why the spare: vLLM's CPU LoRA ops (lora/ops/torch_ops/lora_ops.py, 0.32) gather slot -1, the
    last, for a base-model row, whose index -1 means "no adapter"; with every slot filled, a base request batched
    with adapters gets the last adapter's update (vLLM PRs #48421 and #49656, open). Slots fill from the first
    free one, so with a spare the last slot is never filled and holds zeros."""
    rank = next((r for r in LORA_RANKS if r >= max(ranks)), None)
    if rank is None:
        raise MiniStreamError(f"LoRA rank {max(ranks)}: vLLM serves adapters of rank {LORA_RANKS[-1]} at most")
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": len(ranks) + 1}


def lora_server_args(adapters: list[tuple[str, Path, int]]) -> list[str]:
    """`vllm serve`'s options for adapters (name, PEFT folder, rank): lora_settings, and each as --lora-modules:
    NAME=PATH, or vLLM's JSON form where either holds a comma (vLLM reads NAME=PATH only without one)."""
    settings = lora_settings([r for _, _, r in adapters])
    modules = [
        json.dumps({"name": name, "path": path}) if "," in name + path else f"{name}={path}"
        for name, path in ((name, str(Path(folder).resolve())) for name, folder, _ in adapters)
    ]
    return [
        "--enable-lora",
        *("--max-lora-rank", str(settings["max_lora_rank"]), "--max-loras", str(settings["max_loras"])),
        *("--lora-modules", *modules),
    ]


# --- the server (vLLM's OpenAI server) --------------------------------------------------------


def server_command(
    model: Path, host: str, port: int, name: str, settings: EngineSettings, extra: Sequence[str] = ()
) -> list[str]:
    """vLLM's OpenAI server from this interpreter's environment (the patched vLLM of `make install`).

    `vllm serve` runs this same server, but the `vllm` command of vllm-cpu 0.32.0 dies at start
    (it asks importlib.metadata for the distribution "vllm"; the CPU build is "vllm-cpu"), so both
    devices start the server's module, which takes the same options (the model as --model).
    """
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(Path(model).resolve()),
        "--served-model-name",
        name,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(settings.tp),
        "--seed",
        str(settings.seed),
    ]
    if settings.dtype:
        cmd += ["--dtype", settings.dtype]
    if settings.max_model_len:
        cmd += ["--max-model-len", str(settings.max_model_len)]
    if eager(settings.enforce_eager):
        cmd += ["--enforce-eager"]
    return cmd + list(extra)


def node_command(server: list[str], pp: int, nnodes: int, rank: int, master_addr: str, master_port: int) -> list[str]:
    """`server_command`'s server as one node of vLLM's multiprocessing executor over `nnodes` machines (vLLM PR
    #23691, from 0.11.1): `vllm serve` (its --headless for the nodes that serve no API), through vllm_cli for
    the CPU build whose own `vllm` command cannot start."""
    module = server.index("vllm.entrypoints.openai.api_server")
    args = list(server[module + 1 :])
    args[args.index("--model") : args.index("--model") + 2] = [args[args.index("--model") + 1]]  # positional
    cmd = [*server[: module - 1], "-m", "ministream.run.vllm_cli", "serve", *args]
    cmd += ["--pipeline-parallel-size", str(pp), "--distributed-executor-backend", "mp"]
    cmd += ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", master_addr]
    cmd += ["--master-port", str(master_port)]
    return cmd + (["--headless"] if rank > 0 else [])


def node_env(
    local_ranks: int, host_ip: str, environ: dict | None = None, nnodes: int = 1, release: str | None = None
) -> dict:
    """A node's engine environment: `engine_env` for the ranks this node runs, and the address vLLM
    advertises to the other nodes (VLLM_HOST_IP: rank 0 sends each step's scheduler output there).
    release: the installed vLLM's version, whose CPU worker may read the core binding by global rank."""
    env = engine_env(local_ranks, environ)
    env.setdefault("VLLM_HOST_IP", host_ip)
    said = BIND in (os.environ if environ is None else environ)
    if not said and BIND in env and release and Version(release) < LOCAL_RANK_BIND:
        # each node runs as many ranks: its own binding at every node's place puts its ranks on its cores
        env[BIND] = "|".join([env[BIND]] * nnodes)
    return env
