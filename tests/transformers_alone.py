"""A converted folder in Hugging Face transformers where ministream cannot be imported (test_transformers.py).

    python transformers_alone.py FOLDER REQUEST.json OUT.json

A meta-path finder refuses `ministream` and every module under it before anything is imported, so the folder
must open on its own files: AutoTokenizer without trust_remote_code, AutoModelForCausalLM and AutoModel with it.
REQUEST: {"prompt_ids": [[...]], "new_tokens": N, "top_k": K, "dtypes": ["float32", ...], "text": "..."}.
OUT: what each part gave, for the test to hold to the reference model: per dtype each prompt's greedy ids and
top-k logprobs from .generate(), and every prompt's logits (OUT.<dtype>.logits.pt); whether the base model's
output through the head is the causal model's; the tokenizer's class and ids, and whether loading it asked or
printed anything; where the classes came from; and which transformers ran (the test may put another release
first on PYTHONPATH, over this environment's).
"""

import contextlib
import importlib.abc
import io
import json
import sys


class RefuseMiniStream(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ministream" or name.startswith("ministream."):
            raise ModuleNotFoundError(f"No module named {name!r} (refused: transformers_alone.py)", name=name)
        return None


sys.meta_path.insert(0, RefuseMiniStream())

import torch  # noqa: E402
import transformers  # noqa: E402
from packaging.version import Version  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

# from_pretrained's dtype keyword: `dtype` from transformers 4.56 (torch_dtype deprecated), `torch_dtype` before
DTYPE = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def main(folder: str, request_path: str, out_path: str) -> None:
    request = json.loads(open(request_path).read())
    try:
        import ministream  # noqa: F401

        importable = True
    except ImportError:
        importable = False
    out: dict = {
        "transformers": {"version": transformers.__version__, "file": transformers.__file__},
        "ministream_importable": importable,
        "tokenizer": {},
        "runs": {},
    }
    for trust in (None, False, True):  # None: not given, as a user who knows the tokenizer is stock writes it
        # what transformers' question "Do you wish to run the custom code?" prints (input()'s prompt goes to
        # stdout; with stdin closed it then reads EOF, which transformers takes as a no)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            tok = AutoTokenizer.from_pretrained(folder, **({} if trust is None else {"trust_remote_code": trust}))
        out["tokenizer"][str(trust)] = {
            "class": type(tok).__name__,
            "ids": tok(request["text"], add_special_tokens=False)["input_ids"],
            "asked": "Do you wish to run the custom code?" in printed.getvalue(),
            "printed": printed.getvalue(),
        }
    printed = io.StringIO()  # docs/convert.md's other way to ask nothing: tokenizer_config.json's class itself
    with contextlib.redirect_stdout(printed):
        tok = PreTrainedTokenizerFast.from_pretrained(folder)
    out["tokenizer_class_itself"] = {
        "ids": tok(request["text"], add_special_tokens=False)["input_ids"],
        "printed": printed.getvalue(),
    }
    for dtype in request["dtypes"]:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **{DTYPE: getattr(torch, dtype)})
        model.eval()
        model.generation_config.eos_token_id = None  # the reference runs every new token, as verify asks vLLM to
        outputs = []
        with torch.no_grad():
            for ids in request["prompt_ids"]:  # one at a time: a batch would pad the short ones
                gen = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=request["new_tokens"],
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
                steps = []
                for logits in gen.logits:
                    top = torch.log_softmax(logits[0].float(), -1).topk(request["top_k"])
                    steps.append({str(t): lp for t, lp in zip(top.indices.tolist(), top.values.tolist())})
                outputs.append({"ids": gen.sequences[0, len(ids) :].tolist(), "logprobs": steps})
            # every prompt's logits at every position, in a file beside OUT (JSON would be tens of MB)
            logits = [model(torch.tensor([ids])).logits[0].float() for ids in request["prompt_ids"]]
        torch.save(logits, f"{out_path}.{dtype}.logits.pt")
        out["runs"][dtype] = {
            "class": f"{type(model).__module__}.{type(model).__name__}",
            "config_class": f"{type(model.config).__module__}.{type(model.config).__name__}",
            "outputs": outputs,
        }
        if dtype == "float32":  # AutoModel: the same weights without the head (no random initialisation)
            base = AutoModel.from_pretrained(folder, trust_remote_code=True, **{DTYPE: torch.float32}).eval()
            with torch.no_grad():
                through_head = model.lm_head(base(torch.tensor([request["prompt_ids"][0]])).last_hidden_state)[0]
            out["base"] = {
                "class": f"{type(base).__module__}.{type(base).__name__}",
                "same_as_the_heads_model": torch.equal(through_head, logits[0]),
            }
    out["ministream_imported"] = any(m == "ministream" or m.startswith("ministream.") for m in sys.modules)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
