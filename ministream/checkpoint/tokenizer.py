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
