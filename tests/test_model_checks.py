"""model_checks.py's checks (names, attributes, weights): each rejects the defect class it exists for, planted in
a correctly patched tree of one release, with a message naming the file, the name and the release; and
the unmodified patch sets of an old and a new release pass."""

import pytest

from ministream.checks import model_checks as static
from ministream.checks.matrix import Failed
from ministream.fork import patchset
from ministream.fork.patch import MINISTREAM
from ministream.fork.port import touched
from ministream.fork.release import release_files


def patched_trees(version, root):
    """(pristine tree, patched tree, patch set) of `version`, as the matrix builds them."""
    folder = patchset.patch_set_dir(version)
    files = release_files(version, touched(version), patchset.pinned(folder, version))
    tree, patched = root / "pristine", root / "patched"
    for base in (tree, patched):
        for rel, text in files.items():
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / rel).write_text(text)
    patchset.apply(patched, folder)
    return tree, patched, folder


@pytest.mark.parametrize("version", ["0.6.3", "0.34.0"])
def test_an_unmodified_patch_set_passes(version, tmp_path):
    trees = patched_trees(version, tmp_path)
    details = {name: check(*trees[:2], version, trees[2]) for name, check in static.CHECKS.items()}
    assert details["names"].endswith("vllm imports resolve")
    assert details["attributes"].endswith("all MiniStreamConfig's")
    assert details["weights"].startswith(
        "23 tensors (tied + untied) load; shards .q_proj:'q', .k_proj:'k', .v_proj:'v', .gate_proj:0, .up_proj:1"
    )


# defect class -> (release, check, the patched ministream.py's text -> the defect, what the message names)
DEFECTS = {
    "undefined name in forward": (
        "0.6.3",
        "names",
        ("        x = self.act_fn(gate_up)\n", "        x = self.act_fn(clamp_activations(gate_up))\n"),
        ["line 105 (MiniStreamMLP.forward): name 'clamp_activations' is not defined"],
    ),
    "import of a module of another release": (
        "0.6.3",
        "names",
        (
            "from vllm.attention import Attention, AttentionMetadata\n",
            "from vllm.attention import AttentionMetadata\n"
            "from vllm.model_executor.layers.attention import Attention\n",
        ),
        ["no module vllm.model_executor.layers.attention"],
    ),
    "import of a name of another release": (
        "0.33.0",
        "names",
        (
            "from vllm.sequence import IntermediateTensors\n",
            "from vllm.sequence import IntermediateTensors\nfrom vllm.utils import is_hip\n",
        ),
        ["imports is_hip from vllm/utils/__init__.py"],
    ),
    "attribute an imported module lacks": (
        "0.21.0",
        "names",
        ("ministream_debug.start(hidden_states)", "ministream_debug.begin(hidden_states)"),
        ["ministream_debug.begin", "ministream_debug.py has no begin"],
    ),
    "q/k shard ids swapped (stacked_params_mapping)": (
        "0.6.3",
        "weights",
        (
            '(".qkv_proj", ".q_proj", "q"),\n            (".qkv_proj", ".k_proj", "k"),',
            '(".qkv_proj", ".q_proj", "k"),\n            (".qkv_proj", ".k_proj", "q"),',
        ),
        [".q_proj to ('.qkv_proj', 'k')", ".k_proj -> ('.qkv_proj', 'k')"],
    ),
    "gate/up shard ids swapped (WeightsMapper)": (
        "0.32.0",
        "weights",
        (
            '".gate_proj": (".gate_up_proj", 0),\n            ".up_proj": (".gate_up_proj", 1),',
            '".gate_proj": (".gate_up_proj", 1),\n            ".up_proj": (".gate_up_proj", 0),',
        ),
        [".gate_proj to ('.gate_up_proj', 1)", ".gate_proj -> ('.gate_up_proj', 0)"],
    ),
    "config attribute under a name the release's config no longer has": (
        "0.33.0",
        "attributes",
        (
            'rope_parameters=getattr(config, "rope_parameters", None)',
            'rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta}',
        ),
        ["reads config.rope_theta", "llama.py reads rope_parameters"],
    ),
    "config attribute misspelt": (
        "0.10.2",
        "attributes",
        ("eps=config.rms_norm_eps)", "eps=config.layer_norm_eps)"),
        ["reads config.layer_norm_eps", "llama.py reads rms_norm_eps"],
    ),
    "untied head tied anyway": (
        "0.32.0",
        "weights",
        (
            "            if config.tie_word_embeddings:\n                self.lm_head = self.lm_head.tie_weights(",
            "            if True:\n                self.lm_head = self.lm_head.tie_weights(",
        ),
        ["untied lm_head is left unset with tie_word_embeddings False"],
    ),
    "untied head never loaded": (
        "0.6.3",
        "weights",
        (
            'skip_prefixes=(["lm_head."]\n                           if self.config.tie_word_embeddings else None),',
            'skip_prefixes=["lm_head."],',
        ),
        ["load_weights skips lm_head.weight with tie_word_embeddings False"],
    ),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_a_planted_defect_is_rejected(defect, tmp_path):
    version, check, (old, new), named = DEFECTS[defect]
    tree, patched, folder = patched_trees(version, tmp_path)
    model = patched / MINISTREAM
    assert old in model.read_text(), f"the defect cannot be planted in vLLM {version}'s ministream.py"
    model.write_text(model.read_text().replace(old, new, 1))
    for name, other in static.CHECKS.items():  # only the check for this class fails
        if name != check:
            other(tree, patched, version, folder)
    with pytest.raises(Failed) as e:
        static.CHECKS[check](tree, patched, version, folder)
    message = str(e.value)
    assert message.startswith(MINISTREAM) and f"vLLM {version}" in message, message
    assert all(n in message for n in named), message
