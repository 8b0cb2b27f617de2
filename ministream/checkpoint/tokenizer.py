"""The training tokenizer in the HF folder: checked against the model, and its tokenizer_config.json."""

from pathlib import Path

from .. import MiniStreamError
from ..spec import TrainConfig


def tokenizer_config(path: Path, cfg: TrainConfig, chat_template: str | None) -> dict:
    """tokenizer_config.json for the training tokenizer.json at `path`, after checking it fits the model."""
    from tokenizers import Tokenizer

    if not path.is_file():
        raise MiniStreamError(
            f"{path}: no such file; the training checkpoint folder must hold the tokenizer it was trained with"
        )
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise MiniStreamError(f"{path}: not a Hugging Face tokenizers file ({e})") from None
    if tok.get_vocab_size() > cfg.vocab_size:
        raise MiniStreamError(
            f"{path}: the tokenizer has {tok.get_vocab_size()} tokens but the model's embedding has only "
            f"vocab_size={cfg.vocab_size} rows: wrong tokenizer for this checkpoint?"
        )
    special = {}
    for role, i in (("bos_token", cfg.bos_id), ("eos_token", cfg.eos_id)):
        token = tok.id_to_token(i)
        if token is None:
            raise MiniStreamError(f"{path}: has no token with id {i} ({role.split('_')[0]}_id in the train config)")
        special[role] = token
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": cfg.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def check_chat_template(text: str, source: str) -> str:
    """`text` if it compiles as a Jinja template the way transformers and vLLM compile chat templates (a
    sandboxed environment with loop controls); MiniStreamError naming `source` and the line otherwise."""
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]).parse(text)
    except TemplateSyntaxError as e:
        raise MiniStreamError(
            f"{source}: not a valid Jinja chat template (line {e.lineno}: {e.message}); fix the template"
        ) from None
    return text


def read_chat_template(path: Path) -> str:
    """A chat template file's text, checked before anything is written: it exists, is UTF-8 text, compiles."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise MiniStreamError(f"--chat-template {path}: no such file; give the Jinja template's path") from None
    except OSError as e:
        raise MiniStreamError(f"--chat-template {path} cannot be read ({e.strerror}); give a readable file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MiniStreamError(
            f"--chat-template {path} is not UTF-8 text (byte {e.start}); give the Jinja template's text file"
        ) from None
    if "\0" in text:
        raise MiniStreamError(f"--chat-template {path} is a binary file; give the Jinja template's text file")
    return check_chat_template(text, f"--chat-template {path}")
