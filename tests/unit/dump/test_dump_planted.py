"""The planted sample dump carries the mechanism it claims, as the BF16 reference sees it."""
from __future__ import annotations


import pytest
import torch

from fa_forensics.dump import open_dump
from fa_forensics.errors import ConfigError
from fa_forensics.planted import SynthSpec, bf16_reference, check_planted, synth


@pytest.fixture(scope="module")
def planted(planted_dump):
    return open_dump(planted_dump)


def test_planted_heads_carry_the_bias(planted):
    c = check_planted(planted)
    # O_lp - O_hp in the planted feature: negative, significant (one-sided sign test)
    assert c.o_bias_mean < 0 and c.o_bias_mean + 3 * c.o_bias_se < 0 and c.o_bias_sign_p < 0.01
    # Σ_T (δ_lp - δ_hp) > 0, significant
    assert c.delta_sum > 3 * c.delta_se_of_sum and c.delta_sign_p < 0.01
    # the planted feature leads Σ_T dO·(O_lp - O_hp)
    assert c.feature == planted.ground_truth["planted_feature"] and c.feature_rank <= 3


def test_other_heads_are_unbiased_controls(planted):
    others = [h for h in range(planted.layer_info(0, 0).n_heads) if h not in planted.ground_truth["planted_heads"]]
    c = check_planted(planted, heads=others)
    assert abs(c.o_bias_mean) < 4 * c.o_bias_se and c.o_bias_sign_p > 0.01
    assert c.feature_rank > 3


def test_tied_rows_attain_their_maximum_exactly_k_times(planted):
    truth = planted.ground_truth
    K, h = truth["ties"], truth["planted_heads"][0]
    for s in planted.steps:
        layout = truth["ties_layout"][f"step{s}.layer0.b0.h{h}"]
        q, k = (planted.read(s, 0, n, heads=h, batch=0)[0, 0].float() for n in ("q", "k"))  # (T, D)
        S = (q @ k.T) * planted.layer_info(s, 0).scale  # (T, T) fp32
        T = S.shape[0]
        S = S.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        m = S.amax(-1, keepdim=True)
        p_bar = torch.exp(S - m).bfloat16()
        tied = torch.arange(layout["first_tied_row"], T)
        assert len(tied) == layout["n_tied_rows"] > T // 2
        assert ((S[tied] == m[tied]).sum(-1) == K).all()
        assert ((p_bar[tied] == 1).sum(-1) == K).all()
        # distractors (V = 0 in the planted feature) sit at 0.875·r_m; every other key > 8 below
        distractors = torch.tensor([t for g in layout["distractors"] for t in g])
        rest = S[tied].masked_fill(S[tied] == m[tied], float("-inf"))
        rest[:, distractors] = float("-inf")
        assert ((m[tied, 0] - rest.amax(-1)) > 8).all()  # little mass elsewhere
        assert (S[tied][:, distractors].amax(-1) <= 0.876 * m[tied, 0]).all()
        positions = {tuple(g) for g in layout["groups"]}
        arg = {tuple(row.nonzero().flatten().tolist()) for row in (S[tied] == m[tied])}
        assert arg <= positions


def test_planted_feature_is_negative_and_carries(planted):
    f, h = planted.ground_truth["planted_feature"], planted.ground_truth["planted_heads"][0]
    v = planted.read(0, 0, "v", heads=h)[..., f].float()
    do = planted.read(0, 0, "do", heads=h)[..., f].float()
    layout = planted.ground_truth["ties_layout"]
    distractors = [t for b in range(v.shape[0]) for g in layout[f"step0.layer0.b{b}.h{h}"]["distractors"] for t in g]
    assert len(distractors) > 0
    for b in range(v.shape[0]):
        zero = torch.zeros(v.shape[-1], dtype=torch.bool)
        zero[[t for g in layout[f"step0.layer0.b{b}.h{h}"]["distractors"] for t in g]] = True
        assert (v[b, 0, zero] == 0).all()  # distractors add to ℓ, not to the planted sum
        vb = v[b, 0, ~zero]
        assert ((vb > -2) & (vb <= -1)).all()  # |v| in [1, 2): two of them carry
    assert (do < 0).all()


def test_standout_x_features(planted):
    feats = planted.ground_truth["standout_x_features"]
    for s in planted.steps:
        x = planted.read(s, 0, "x").float()  # (B, T, C)
        mean_abs = x.abs().mean(dim=(0, 1))
        assert set(mean_abs.topk(len(feats)).indices.tolist()) == set(feats)
        for f in feats:
            assert (x[..., f].sign() == x[0, 0, f].sign()).all() and mean_abs[f] > 10 * mean_abs.median()


def test_sink_heads_score_sinks_delta_above_noise(planted):
    truth = planted.ground_truth
    delta = truth["sink_strength"]
    assert delta is not None and truth["sink_heads"]
    h = truth["sink_heads"][0]
    q, k = (planted.read(0, 0, n, heads=h, batch=0)[0, 0].float() for n in ("q", "k"))
    S = (q @ k.T) * planted.layer_info(0, 0).scale  # (T, T)
    sink, rest = S[:, :4], S[:, 4:]
    assert abs((sink.mean() - rest.mean()).item() - delta) < 0.2
    assert abs(rest.std().item() - 1.0) < 0.1


def test_previous_token_heads_attend_mostly_to_the_key_before(tmp_path):
    """Each query of a previous-token head has its maximum at the key before it, which holds most of the row's
    mass, so no two rows share their dominant key; the other heads are left as they were."""
    spec = SynthSpec(seq=512, heads=3, head_dim=64, batch=2, steps=1, planted_heads=(1,), seed=3,
                     sink_strength=6.0, previous_token_heads=(2,))
    truth = synth(tmp_path / "p.zarr", spec)
    dump = open_dump(tmp_path / "p.zarr")
    assert truth["previous_token_heads"] == [2] and truth["sink_heads"] == [0]
    T = spec.seq
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    rows = torch.arange(1, T)
    for h, expect_previous in ((2, True), (0, False)):
        q, k = (dump.read(0, 0, n, heads=h).float() for n in ("q", "k"))  # (B, 1, T, D)
        S = (q @ k.transpose(-1, -2) * dump.layer_info(0, 0).scale).masked_fill(causal, float("-inf"))
        p = S.softmax(-1)[:, 0]  # (B, T, T)
        at_previous = (S[:, 0].argmax(-1)[:, 1:] == rows - 1).float().mean().item()
        share = p[:, rows, rows - 1]
        if expect_previous:
            assert at_previous > 0.99
            assert share.median() > 0.6 and share.quantile(0.1) > 0.4
        else:  # a sink head: its maxima are the sinks, not the key before
            assert at_previous < 0.05
    with pytest.raises(ConfigError, match="previous_token_heads"):
        SynthSpec(heads=3, planted_heads=(1,), previous_token_heads=(1,))


def test_stored_o_is_the_bf16_reference(planted):
    q, k, v, o = (planted.read(1, 0, n) for n in ("q", "k", "v", "o"))
    o_lp, _ = bf16_reference(q, k, v)
    assert torch.equal(o, o_lp)


def test_synth_is_reproducible_and_honours_v_skew(tmp_path):
    spec = SynthSpec(seq=96, heads=2, head_dim=16, batch=1, steps=1, ties=3, v_skew=0.5, planted_heads=(0,), seed=7)
    t1 = synth(tmp_path / "a.zarr", spec)
    t2 = synth(tmp_path / "b.zarr", spec)
    a, b = open_dump(tmp_path / "a.zarr"), open_dump(tmp_path / "b.zarr")
    assert t1 == t2 == a.ground_truth
    for n in ("q", "k", "v", "o", "do", "x"):
        assert torch.equal(a.read(0, 0, n).view(torch.int16), b.read(0, 0, n).view(torch.int16))
    v = a.read(0, 0, "v", heads=0)[..., t1["planted_feature"]]
    neg = (v[v != 0] < 0).float().mean().item()  # distractor rows are 0 by design
    assert 0.35 < neg < 0.65
    with pytest.raises(ConfigError, match="already exists"):
        synth(tmp_path / "a.zarr", spec)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"planted_heads": (4,)}, "not in 0..3"), ({"v_skew": 1.5}, r"\[0, 1\]"), ({"ties": 0}, "between 1 and 16"),
     ({"seq": 64, "ties": 8}, "ties: 8 ties need a sequence of at least")],
)
def test_spec_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SynthSpec(**kwargs)


def test_overwrite_that_fails_midway_keeps_the_old_dump(tmp_path, monkeypatch):
    """synth --overwrite writes aside and renames: a failure while writing leaves the old dump whole."""
    from fa_forensics.dump.writer import DumpWriter

    old_spec = SynthSpec(seq=64, heads=2, head_dim=16, batch=1, steps=2, planted_heads=(0,), seed=1)
    synth(tmp_path / "d.zarr", old_spec)
    before = open_dump(tmp_path / "d.zarr").read(1, 0, "q")

    calls = {"n": 0}
    real_write = DumpWriter.write_array

    def failing_write(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(DumpWriter, "write_array", failing_write)
    from fa_forensics.errors import DiskFull

    with pytest.raises(DiskFull, match="no space left on the device .* it needs about"):
        synth(tmp_path / "d.zarr", SynthSpec(seq=64, heads=2, head_dim=16, batch=1, steps=2, planted_heads=(0,),
                                             seed=2), overwrite=True)
    monkeypatch.setattr(DumpWriter, "write_array", real_write)

    d = open_dump(tmp_path / "d.zarr")
    assert d.steps == [0, 1] and d.ground_truth["seed"] == 1
    assert torch.equal(d.read(1, 0, "q").view(torch.int16), before.view(torch.int16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.zarr"]  # no leftovers beside it

    synth(tmp_path / "d.zarr", SynthSpec(seq=64, heads=2, head_dim=16, batch=1, steps=1, planted_heads=(0,), seed=2),
          overwrite=True)
    d = open_dump(tmp_path / "d.zarr")
    assert d.steps == [0] and d.ground_truth["seed"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.zarr"]


def test_seq_too_short_names_the_real_minimum():
    with pytest.raises(ConfigError, match="at least 64"):
        SynthSpec(seq=8)
