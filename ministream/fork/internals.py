"""vLLM's internals that ministream's tools reach by name, stated once, tool by tool and era by era.

The tools take these names from here (bench-step the model runner's methods it times, doctor the platform
rule it reports), and the matrix's `internals` check (checks/internals_check.py) proves, release by release, that
each resolves in that release's own files, read with pysource.py and never imported: a name that moves in
a new vLLM is a failing cell of `make matrix`, not a traceback at run time. Every `vllm` import in the
package's own modules is checked the same way, from the era its module states in IMPORTS_SINCE.

An era (`since`) is the first release in which the tool reaches that name at all: bench-step times the V1
engine's model runner, which older releases do not have; below its era a need is not applicable, and the
check says so.
"""

import ast
from typing import NamedTuple


class Name(NamedTuple):
    """Module `module` (dotted) exists; with `name`, it defines that name; with `attr`, the class `name` has
    that attribute (in its body, as a `self.x = ...` of a method, or through a base class of the release's)."""

    module: str
    name: str = ""
    attr: str = ""


class Env(NamedTuple):
    """vLLM reads the environment variable `name` (a key of vllm/envs.py's environment_variables)."""

    name: str


class Runner(NamedTuple):
    """Every model runner the release's workers build (WORKERS) has one of `any_of`, the names of `part` in each
    runner era: a method, or "model.x", the loaded model's x (the runner sets self.model; x is a method of
    MiniStreamForCausalLM, which the matrix's interface check holds to LlamaForCausalLM's)."""

    part: str
    any_of: tuple[str, ...]


class Need(NamedTuple):
    tool: str  # who reaches it: a command, or the module that does
    since: str  # the first release the tool reaches it in
    what: Name | Env | Runner


# The workers vLLM's V1 engine starts (v1/worker/), and their attribute holding the model runner.
WORKERS = (Name("vllm.v1.worker.cpu_worker", "CPUWorker"), Name("vllm.v1.worker.gpu_worker", "Worker"))
RUNNER_ATTRIBUTE = "model_runner"
V1_ENGINE = "0.9.2"  # the oldest supported release with the V1 engine's CPU worker (vllm/v1/worker/cpu_worker.py)
# bench-step's era: the V1 runner splits a step into execute_model and sample_tokens (with _sample) from 0.11
BENCH_STEP = "0.11.2"

# bench-step's timers (bench/decode_step.py), part -> its name in each runner era: the V1 runner
# (v1/worker/gpu_model_runner.py and its CPU subclass), then the V2 runner (v1/worker/gpu/model_runner.py; the
# only one from 0.34, which deletes the V1 runner and VLLM_USE_V2_MODEL_RUNNER). The V2 runner calls
# self.model(...) inline, and its sample() computes the logits too (model_state.compute_sample_logits), so
# bench-step times each part without the parts timed inside it.
RUNNER_PARTS: dict[str, tuple[str, ...]] = {
    "execute_model": ("execute_model",),
    "sample_tokens": ("sample_tokens",),
    "inputs": ("_prepare_inputs", "prepare_inputs"),
    "forward": ("_model_forward", "model.forward"),
    "sample": ("_sample", "sample"),
    "logits": ("model.compute_logits",),
}

# What the engine settings (run/engine.py) give every engine: generate, verify, serve, bench
_ENGINE: list[Name | Env] = [
    *(Env(e) for e in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_NO_USAGE_STATS", "VLLM_HOST_IP")),
    *(
        Name("vllm.engine.arg_utils", "EngineArgs", field)
        for field in ("model", "dtype", "tensor_parallel_size", "max_model_len", "seed", "enforce_eager")
    ),
    Name("vllm.entrypoints.openai.api_server"),  # serve's server, run as a module
]

NEEDS: tuple[Need, ...] = (
    *(Need("engine settings", "0.4.3", what) for what in _ENGINE),
    Need("engine settings", "0.5.5", Env("VLLM_CPU_OMP_THREADS_BIND")),
    Need("engine settings", "0.6.3", Env("VLLM_CACHE_ROOT")),
    # verify: the engine eager and without prefix caching, so that every prompt's prefill passes through
    # forward() with the dump switch (patches/common/files/.../ministream_debug.py); the logits half of the
    # dump is in the model's compute_logits, which the runner calls on the model it loaded
    Need("verify", "0.4.3", Name("vllm.engine.arg_utils", "EngineArgs", "enforce_eager")),
    Need("verify", "0.4.3", Name("vllm.engine.arg_utils", "EngineArgs", "enable_prefix_caching")),
    Need("verify", V1_ENGINE, Runner("logits", RUNNER_PARTS["logits"])),
    # bench-step: timers in the engine core's process (LLM.collective_rpc, a pickled function), on every
    # runner the worker may build, with and without the engine core in this process
    *(Need("bench-step", BENCH_STEP, Runner(part, names)) for part, names in RUNNER_PARTS.items()),
    Need("bench-step", BENCH_STEP, Name("vllm.entrypoints.llm", "LLM", "collective_rpc")),
    Need("bench-step", BENCH_STEP, Env("VLLM_ENABLE_V1_MULTIPROCESSING")),
    Need("bench-step", BENCH_STEP, Env("VLLM_ALLOW_INSECURE_SERIALIZATION")),
    Need("bench-step", BENCH_STEP, Name("vllm.engine.arg_utils", "EngineArgs", "async_scheduling")),
    # doctor's platform report (run/doctor.py check_platform): the CPU platform and, where vLLM has one, the
    # platform for AMD's CPU library and vLLM's own rule for picking it (fork/zentorch.py mirrors it)
    Need("doctor", "0.6.3", Name("vllm.platforms.cpu", "CpuPlatform")),
    Need("doctor", "0.18.1", Name("vllm.platforms.zen_cpu", "ZenCpuPlatform")),
    Need("doctor", "0.18.1", Name("vllm.platforms", "_is_amd_zen_cpu")),
)

# The tools' modules (run/, bench/, fork/) that import vllm, each from the first release it works with (the check
# resolves every one of their `vllm` imports in each release from then on); a module there that imports vllm
# and is not listed fails the check until it is. checks/ is left out: its probes run inside a release's own
# environment, where running them is their proof.
IMPORTS_SINCE = {
    "run/generate.py": "0.4.3",  # LLM, SamplingParams
    "run/vllm_perplexity.py": "0.4.3",  # SamplingParams(prompt_logprobs=...)
    "bench/workers.py": "0.6.3",  # vllm.platforms.current_platform
    "bench/decode_step.py": BENCH_STEP,
    "run/vllm_cli.py": "0.7.3",  # vLLM's own command line (vllm/entrypoints/cli/main.py)
    "bench/kernels.py": "0.20.0",  # vllm._custom_ops' oneDNN handlers (onednn_mm, onednn_scaled_mm), CpuArchEnum
    "bench/vllm_client.py": "0.11.2",  # `vllm bench serve`'s client (vllm.utils.argparse_utils from 0.11)
    "run/vllm_options.py": "0.11.2",  # vLLM's server parser (FlexibleArgumentParser); below it the string check
    "fork/plugin_files/ministream_vllm/__init__.py": "0.6.3",  # the plugin route (fork/plugin.py)
}


# --- the CPU platform's own rule ---------------------------------------------------------------


def cpu_needs_triton(platform_cpu_py: str) -> bool:
    """Whether a release's CPU platform (vllm/platforms/cpu.py) refuses an x86 CPU without Triton: its
    CpuPlatform.check_and_update_config raises under a test of HAS_TRITON (0.34: "vLLM on x86 CPUs requires
    Triton (triton-cpu)"), where older releases fell back to the V1 model runner."""
    module = ast.parse(platform_cpu_py)
    cls = next((n for n in ast.walk(module) if isinstance(n, ast.ClassDef) and n.name == "CpuPlatform"), None)
    check = next(
        (
            f
            for f in (cls.body if cls else [])
            if isinstance(f, ast.FunctionDef) and f.name == "check_and_update_config"
        ),
        None,
    )
    return any(
        isinstance(node, ast.If)
        and any(isinstance(n, ast.Name) and n.id == "HAS_TRITON" for n in ast.walk(node.test))
        and any(isinstance(n, ast.Raise) for n in node.body)
        for node in (ast.walk(check) if check else ())
    )
