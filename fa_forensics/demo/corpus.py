"""The demo's training text: a deterministic synthetic corpus, the same bytes on every machine.

No public-domain book ships with the package's dependencies, and the Python standard library's
files differ between Python builds, so the demo generates its text from a documented grammar and a
fixed seed, with integer arithmetic only (SplitMix64), independent of Python, NumPy and torch
versions. The bytes are checked against `CORPUS_SHA256` before training.

The grammar (ASCII; every choice uniform unless said otherwise) makes a text with local structure
(words, agreement, punctuation) and long-range structure attention must learn (a name and a number
introduced in a record and repeated later in the same record, lists that count):

    corpus    := record*                          records are separated by a blank line
    record    := header sentence{2..6} recall list?
    header    := "Record " NUMBER ": " NAME " of " PLACE "." NEWLINE
    sentence  := subject " " verb " " object [" " prep " " PLACE] "."    then NEWLINE (1/3) or " " (2/3)
    subject   := NAME | "the " [ADJ " "] NOUN
    object    := "the " [ADJ " "] NOUN | ("a " | "an ") NOUN | NAME
    recall    := "So " NAME " kept record " NUMBER "." NEWLINE     (the header's NAME and NUMBER)
    list      := ("  " i ". " [ADJ " "] NOUN NEWLINE) for i in 1..k, k in 2..5   (present with probability 1/2)
    NUMBER    := four digits

The word lists below are the project's own.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

CORPUS_SEED = 20261206
CORPUS_BYTES = 1_000_000  # the demo's default corpus: 1 MB
# sha256 of corpus_bytes(CORPUS_BYTES), checked before training
CORPUS_SHA256 = "f5db078bc2cc59b1e0caf1d570103e37bda06a993f7baa63368ed8b267c9f9d2"

_MASK = (1 << 64) - 1

NAMES = ("Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lars",
         "Mira", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sven", "Tara", "Ugo", "Vera", "Wim", "Yara", "Zeno")
PLACES = ("the harbour", "the mill", "the north gate", "the library", "the old bridge", "the market", "the quarry",
          "the orchard", "the river bank", "the station", "the tower", "the valley", "the workshop", "the square")
NOUNS = ("lamp", "ledger", "boat", "key", "letter", "basket", "clock", "map", "rope", "wheel", "kettle", "bell",
         "ladder", "coin", "window", "garden", "cart", "candle", "anchor", "drum", "needle", "barrel", "compass")
ADJS = ("red", "small", "heavy", "old", "bright", "narrow", "quiet", "broken", "wooden", "silver", "cold", "round",
        "green", "tall", "empty")
VERBS = ("carried", "found", "mended", "counted", "painted", "sold", "hid", "lifted", "weighed", "opened", "moved",
         "cleaned", "measured", "wrapped", "lost")
PREPS = ("near", "behind", "inside", "beyond", "under", "across", "beside")


class SplitMix64:
    """Steele, Lea and Flood's SplitMix64: a 64-bit generator in plain integer arithmetic."""

    def __init__(self, seed: int):
        self.state = seed & _MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """An integer in [0, n) (n ≤ 2^32; the modulo bias is below 2^-32)."""
        return self.next() % n

    def pick(self, options: tuple[str, ...]) -> str:
        return options[self.below(len(options))]

    def coin(self) -> bool:
        return self.next() >> 63 == 1


def _noun_phrase(rng: SplitMix64, article: str) -> str:
    adj = f"{rng.pick(ADJS)} " if rng.coin() else ""
    return f"{article} {adj}{rng.pick(NOUNS)}"


def _indefinite(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _sentence(rng: SplitMix64) -> str:
    subject = rng.pick(NAMES) if rng.coin() else _noun_phrase(rng, "the")
    subject = subject[0].upper() + subject[1:]
    kind = rng.below(3)
    obj = _noun_phrase(rng, "the") if kind == 0 else (_indefinite(rng.pick(NOUNS)) if kind == 1 else rng.pick(NAMES))
    where = f" {rng.pick(PREPS)} {rng.pick(PLACES)}" if rng.coin() else ""
    return f"{subject} {rng.pick(VERBS)} {obj}{where}."


def _record(rng: SplitMix64) -> str:
    number = f"{rng.below(10_000):04d}"
    name = rng.pick(NAMES)
    lines = [f"Record {number}: {name} of {rng.pick(PLACES)}."]
    body = [_sentence(rng) for _ in range(2 + rng.below(5))]
    text = ""
    for s in body:
        text += s + ("\n" if rng.below(3) == 0 else " ")
    lines.append(text.rstrip())
    lines.append(f"So {name} kept record {number}.")
    if rng.coin():
        for i in range(1, 2 + 1 + rng.below(4)):
            adj = f"{rng.pick(ADJS)} " if rng.coin() else ""
            lines.append(f"  {i}. {adj}{rng.pick(NOUNS)}")
    return "\n".join(lines) + "\n\n"


@lru_cache(maxsize=4)
def corpus_bytes(n_bytes: int = CORPUS_BYTES, seed: int = CORPUS_SEED) -> bytes:
    """The first `n_bytes` bytes of the corpus generated from `seed` (a prefix of any longer corpus)."""
    rng = SplitMix64(seed)
    parts, total = [], 0
    while total < n_bytes:
        record = _record(rng).encode("ascii")
        parts.append(record)
        total += len(record)
    return b"".join(parts)[:n_bytes]


def corpus_sha256(n_bytes: int = CORPUS_BYTES, seed: int = CORPUS_SEED) -> str:
    return hashlib.sha256(corpus_bytes(n_bytes, seed)).hexdigest()
