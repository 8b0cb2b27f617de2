"""Perplexity on held-out text (checkpoint/perplexity.py): llama-perplexity's chunks and scoring, on text the
demo models never trained on. vLLM's and llama.cpp's side: test_quantize.py (verify) and test_llamacpp.py."""

import re

import pytest
import torch

from ministream import MiniStreamError
from ministream.checkpoint.perplexity import N_CTX, chunks, folder_perplexity, reference_perplexity
from ministream.checkpoint.reference import MiniStream
from ministream.checkpoint.weights import read_folder
from ministream.paths import CORPUS, HELDOUT


def test_the_held_out_text_shares_no_sentence_with_the_training_corpus():
    seen = {s.strip() for s in re.split(r"[.!?]", CORPUS.read_text()) if s.strip()}
    held = [s.strip() for s in re.split(r"[.!?]", HELDOUT.read_text()) if len(s.split()) > 4]
    assert len(held) >= 40
    assert not [s for s in held if s in seen]


def test_the_text_is_cut_into_whole_chunks_each_opening_with_bos(tiny_gqa_hf):
    c = chunks(tiny_gqa_hf)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_gqa_hf / "tokenizer.json")).encode(HELDOUT.read_text()).ids
    assert len(c.ids) == len(ids) // N_CTX >= 2 and all(len(x) == N_CTX for x in c.ids)
    assert all(x[0] == ids[0] for x in c.ids)  # the tokenizer adds BOS: each chunk starts with it, as llama.cpp's
    assert [x[1:] for x in c.ids] == [ids[i * N_CTX + 1 : (i + 1) * N_CTX] for i in range(len(c.ids))]
    assert c.first == N_CTX // 2 and c.scored == len(c.ids) * (N_CTX - N_CTX // 2 - 1)
    assert len(chunks(tiny_gqa_hf, max_len=64).ids[0]) == 64  # never past the model's context


def test_a_model_that_knows_nothing_scores_the_vocabulary_size(tiny_gqa_hf):
    """Uniform next-token probabilities (the head zeroed) have perplexity exactly the number of logits."""
    cfg, state = read_folder(tiny_gqa_hf)
    model = MiniStream(cfg)
    model.load_state_dict({**state, "lm_head.weight": torch.zeros_like(state["lm_head.weight"])}, strict=True)
    assert reference_perplexity(model.eval(), chunks(tiny_gqa_hf)) == pytest.approx(cfg.vocab_size, rel=1e-5)
    trained = folder_perplexity(tiny_gqa_hf, chunks(tiny_gqa_hf))
    assert 1 < trained < cfg.vocab_size / 4  # the trained model has learnt the kind of text


def test_a_text_shorter_than_two_chunks_is_refused_by_name(tiny_gqa_hf, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("The river runs through the town. " * 10)
    with pytest.raises(MiniStreamError, match=r"short\.txt: \d+ tokens, fewer than 2 x n_ctx = 512"):
        chunks(tiny_gqa_hf, short)
