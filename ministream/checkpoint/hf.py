"""The converted folder in Hugging Face transformers without remote code: MiniStreamConfig, MiniStreamModel and
MiniStreamForCausalLM registered with the Auto classes on import.

After `import ministream.checkpoint.hf`, `AutoModelForCausalLM.from_pretrained(folder)` (and AutoConfig, AutoModel)
load a converted folder without trust_remote_code. The classes are not a second copy: they are made by executing
the very files a converted folder carries (hf_files.files(), the text convert writes), as modules of their own
under this one, so the route with remote code and the route without cannot drift.
"""

import linecache
import sys
import types
from typing import Any

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .. import __version__
from ..spec import (
    ARCH,
    CONFIG_CLASS,
    HF_CONFIG_MODULE,
    HF_MODEL_MODULE,
    MODEL_CLASS,
    MODEL_TYPE,
    TrainConfig,
    hf_config,
)
from . import hf_files

PACKAGE = f"{__name__}.folder_files"  # the files' package: ministream.checkpoint.hf.folder_files.modeling_ministream


def _execute() -> dict[str, types.ModuleType]:
    """{module name: module} of the folder's files, executed in order (the model file imports the config's by a
    relative import, which finds it in sys.modules). Their source is in linecache, for tracebacks and inspect."""
    package = types.ModuleType(PACKAGE)
    package.__path__ = []
    sys.modules[PACKAGE] = package
    modules = {}
    for name, text in hf_files.files().items():
        module = types.ModuleType(f"{PACKAGE}.{name.removesuffix('.py')}")
        module.__package__ = PACKAGE
        module.__file__ = f"<{name} as ministream {__version__} writes it into a converted folder>"
        linecache.cache[module.__file__] = (len(text), None, text.splitlines(True), module.__file__)
        sys.modules[module.__name__] = module
        exec(compile(text, module.__file__, "exec"), module.__dict__)
        modules[name.removesuffix(".py")] = module
    return modules


_modules = _execute()
MiniStreamConfig: Any = getattr(_modules[HF_CONFIG_MODULE], CONFIG_CLASS)
MiniStreamModel: Any = getattr(_modules[HF_MODEL_MODULE], MODEL_CLASS)
MiniStreamForCausalLM: Any = getattr(_modules[HF_MODEL_MODULE], ARCH)


def config_from_train(cfg: TrainConfig, dtype: str = "float32") -> Any:
    """The MiniStreamConfig a folder converted from `cfg` holds (config.json's values, as convert writes them)."""
    drop = ("architectures", "model_type", "auto_map")
    return MiniStreamConfig(**{k: v for k, v in hf_config(cfg, dtype).items() if k not in drop})


AutoConfig.register(MODEL_TYPE, MiniStreamConfig, exist_ok=True)
AutoModel.register(MiniStreamConfig, MiniStreamModel, exist_ok=True)
AutoModelForCausalLM.register(MiniStreamConfig, MiniStreamForCausalLM, exist_ok=True)
