"""The demo's corpus: the same bytes everywhere (a fixed sha256), from the grammar its docstring documents."""
from __future__ import annotations

import hashlib
import re

import pytest
import torch

from fa_forensics.demo import corpus
from fa_forensics.demo.data import demo_corpus
from fa_forensics.errors import UserError

SHA256_1MB = "f5db078bc2cc59b1e0caf1d570103e37bda06a993f7baa63368ed8b267c9f9d2"  # the bytes the bundled demo trained on


def test_the_corpus_has_its_fixed_sha256_and_size():
    data = corpus.corpus_bytes()
    assert len(data) == corpus.CORPUS_BYTES == 1_000_000
    assert hashlib.sha256(data).hexdigest() == SHA256_1MB == corpus.CORPUS_SHA256


def test_splitmix64_gives_the_reference_sequence():
    """The first outputs for seed 0 (Vigna's reference splitmix64.c), so the generator is the published one."""
    g = corpus.SplitMix64(0)
    assert [g.next() for _ in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_a_shorter_corpus_is_a_prefix_and_another_seed_other_text():
    assert corpus.corpus_bytes(20_000) == corpus.corpus_bytes()[:20_000]
    assert corpus.corpus_bytes(20_000, seed=1) != corpus.corpus_bytes(20_000)


def test_the_text_follows_its_grammar():
    text = corpus.corpus_bytes().decode("ascii")
    records = text.split("\n\n")[:-1]  # the last record is cut at 1 MB
    assert len(records) > 3000
    for r in records:
        lines = r.split("\n")
        head = re.fullmatch(r"Record (\d{4}): ([A-Z][a-z]+) of (the [a-z ]+)\.", lines[0])
        assert head, lines[0]
        number, name = head.group(1), head.group(2)
        recall = next(i for i, line in enumerate(lines) if line.startswith("So "))
        assert lines[recall] == f"So {name} kept record {number}."  # the long-range dependency the grammar plants
        items = lines[recall + 1:]
        assert len(items) == 0 or 2 <= len(items) <= 5
        assert [it.split(".")[0].strip() for it in items] == [str(i) for i in range(1, len(items) + 1)]
    assert " a anchor" not in text and " an anchor" in text


def test_demo_corpus_gives_the_bytes_as_token_ids_and_refuses_a_tiny_one():
    tokens = demo_corpus(50_000)
    assert tokens.dtype == torch.int64 and tokens.shape == (50_000,)
    assert bytes(tokens.to(torch.uint8).tolist()) == corpus.corpus_bytes(50_000)
    with pytest.raises(UserError, match="at least"):
        demo_corpus(100)
