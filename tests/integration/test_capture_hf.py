"""Capture on Hugging Face models built from small configs (no download): GPT-2 (sdpa, padding mask,
dropout), Llama (grouped-query attention), eager and compiled, library and CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import capture_training, padded_batch, tiny_gpt2, tiny_llama
from toolchain import NEEDS_CXX

import fa_forensics
from fa_forensics.dump import open_dump

T = 16


def _train(model, steps, session=None, compiled=False):
    """Real AdamW steps under bf16 autocast on a padded batch; the losses (tensors)."""
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, attention_mask = padded_batch(T)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(input_ids=ids, attention_mask=attention_mask, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
        if session is not None:
            session.step(loss)
    return losses


def _check_masked_layers(dump, step):
    for layer in dump.layers(step):
        info = dump.layer_info(step, layer)
        assert info.module == f"transformer.h.{layer}.attn" and info.mask == "bool" and info.autocast is True
        q, k, v, o, mask = (dump.read(step, layer, n) for n in ("q", "k", "v", "o", "mask"))
        assert mask.dtype == torch.bool and mask.shape == (2, 1, T, T)
        # the recorded mask is causal & key padding: sample 1 attends to no padded key
        assert not mask[1, 0, :, :5].any() and torch.equal(mask[0, 0], torch.ones(T, T, dtype=torch.bool).tril())
        # stored O is SDPA of the stored Q, K, V under the recorded mask, bit for bit
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=info.scale), o)
        assert not torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=info.scale), o)


def test_gpt2_padding_mask_is_recorded_and_reproduces_o_eager(tmp_path):
    out = tmp_path / "gpt2.zarr"
    model = tiny_gpt2(T)
    with fa_forensics.capture(model, out=out, steps=[1], batch=None) as cap:
        _train(model, 2, cap)
    dump = open_dump(out)
    assert dump.steps == [1] and dump.attrs["model"]["class"] == "GPT2LMHeadModel"
    _check_masked_layers(dump, 1)


@NEEDS_CXX
@pytest.mark.slow
def test_gpt2_compiled_with_padding_mask_is_bit_equal_with_capture(tmp_path):
    torch._dynamo.reset()
    plain = _train(tiny_gpt2(T, n_layer=1), 3, compiled=True)  # one block: compiling is the cost of this test
    torch._dynamo.reset()
    out = tmp_path / "gpt2c.zarr"
    model = tiny_gpt2(T, n_layer=1)
    with fa_forensics.capture(model, out=out, steps=[1], batch=None) as cap:
        captured = _train(model, 3, cap, compiled=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, captured))
    dump = open_dump(out)
    assert dump.attrs["model"]["class"] == "GPT2LMHeadModel"
    _check_masked_layers(dump, 1)


def test_llama_grouped_query_attention_is_expanded_per_query_head(tmp_path):
    model = tiny_llama(T)
    kv_seen = {}
    hooks = [layer.self_attn.k_proj.register_forward_hook(lambda m, a, y, i=i: kv_seen.__setitem__(i, y.detach()))
             for i, layer in enumerate(model.model.layers)]
    ids, _ = padded_batch(T)
    out = tmp_path / "llama.zarr"
    with fa_forensics.capture(model, out=out, steps=[0], batch=None, step_by="manual") as cap:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        cap.step(loss)
    for h in hooks:
        h.remove()
    dump = open_dump(out)
    for layer in (0, 1):
        info = dump.layer_info(0, layer)
        assert info.module == f"model.layers.{layer}.self_attn" and info.n_heads == 4 and info.mask is None
        q, k, v, o = (dump.read(0, layer, n) for n in ("q", "k", "v", "o"))
        assert k.shape == (2, 4, T, 8)
        assert torch.equal(k[:, 0], k[:, 1]) and torch.equal(k[:, 2], k[:, 3]) and not torch.equal(k[:, 0], k[:, 2])
        assert kv_seen[layer].shape == (2, T, 16)  # 2 K/V heads of 8 in the model
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=info.causal, scale=info.scale), o)


SCRIPT = textwrap.dedent('''
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, attn_pdrop=0.1,
                     bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 16))
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[1, :5] = 0
    for step in range(2):
        loss = model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad()
''')


def test_cli_capture_of_gpt2_with_dropout_and_padding(tmp_path):
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from fa_forensics.cli import app

    script, out = tmp_path / "train.py", tmp_path / "run.zarr"
    info_json, st = tmp_path / "info.json", tmp_path / "x.safetensors"
    script.write_text(SCRIPT)
    # step 7 is never reached (the script makes 2 steps): step 1 is recorded, then a warning and exit code 1
    run = subprocess.run([sys.executable, "-m", "fa_forensics", "capture", "--out", str(out), "--steps", "1,7", "--",
                          "python", str(script)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "step(s) 7 were never reached" in run.stderr, run.stderr
    runner = CliRunner()
    assert runner.invoke(app, ["info", str(out), "--json", str(info_json)]).exit_code == 0
    info = json.loads(info_json.read_text())
    assert info["steps"] == [1] and info["model"]["class"] == "GPT2LMHeadModel" and info["device"] == "cpu"
    assert all(info["layer_info"][str(l)]["dropout_p"] == pytest.approx(0.1) for l in (0, 1))
    assert all(info["layer_info"][str(l)]["mask"] == "bool" for l in (0, 1))
    # export writes the mask as step{S}.layer{L}.mask (bool, True = may attend)
    assert runner.invoke(app, ["export", str(out), "--to", str(st)]).exit_code == 0
    mask = load_file(str(st))["step1.layer0.mask"]
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 16, 16) and not mask[1, 0, :, :5].any()


def test_analyses_apply_the_recorded_mask_and_warn_about_dropout(tmp_path):
    from typer.testing import CliRunner

    from fa_forensics.fidelity.recipe import hp_config
    from fa_forensics.layers.selection import load, replay_layer, select
    from fa_forensics.cli import app

    out, report = tmp_path / "drop.zarr", tmp_path / "delta.json"
    model = tiny_gpt2(T, attn_pdrop=0.1)
    with fa_forensics.capture(model, out=out, steps=[0], batch=None) as cap:
        _train(model, 1, cap)
    dump = open_dump(out)
    t = load(dump, select(dump, 0, 0)[0])
    assert t.mask is not None and t.mask.shape == (2, 1, T, T)
    assert any("dropout p=0.1" in w for w in t.warnings) and any("attention mask" in w for w in t.warnings)
    # the replay applies the recorded mask: fp32 replay of the stored inputs = SDPA under the mask
    ref = F.scaled_dot_product_attention(t.q.float(), t.k.float(), t.v.float(), attn_mask=t.mask, scale=t.scale)
    torch.testing.assert_close(replay_layer(t, hp_config(), backward=False).o.float(), ref, atol=1e-5, rtol=1e-5)
    result = CliRunner().invoke(app, ["delta-bias", str(out), "--step", "0", "--json", str(report), "--out",
                                      str(tmp_path)])
    assert result.exit_code == 0, result.output
    warnings = json.loads(report.read_text())["warnings"]
    assert any("stored O includes dropout" in w for w in warnings) and any("attention mask" in w for w in warnings)


# -- eager attention replayed from its recorded op sequence ---------------------------------------------
def _eager_model(name):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    if name == "gemma2":  # soft-capped scores, sliding-window and global layers
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=16, attn_logit_softcapping=5.0,
                                                    sliding_window=8, query_pre_attn_scalar=16))
    if name == "mistral":  # a sliding window shorter than the sequence
        return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=8))
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=64, n_positions=64, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0,
                            resid_pdrop=0.0, embd_pdrop=0.0)
        cfg._attn_implementation = "eager"
        return tf.GPT2LMHeadModel(cfg)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**common))


def _capture_eager(tmp_path, name, bf16):
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    return capture_training(_eager_model(name), tmp_path / f"{name}.zarr", ids, steps=1, record=[0], autocast=bf16)


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral", "gemma2"])
def test_match_reproduces_hf_eager_attention_bit_for_bit(tmp_path, name, bf16):
    from typer.testing import CliRunner

    from fa_forensics.cli import app

    out = _capture_eager(tmp_path, name, bf16)
    result = CliRunner().invoke(app, ["match", str(out), "--json", str(tmp_path / "m.json")])
    assert result.exit_code == 0, result.output
    layers = json.loads((tmp_path / "m.json").read_text())["layers"]
    assert len(layers) == 2
    assert all(lm["best"]["preset"] == "eager-reexec" and lm["best"]["o_bits_equal"] == 1.0 for lm in layers)


@pytest.mark.slow
def test_report_runs_every_analysis_on_the_eager_recipe_of_a_soft_capped_model(tmp_path):
    from typer.testing import CliRunner

    from fa_forensics.cli import app

    out = _capture_eager(tmp_path, "gemma2", bf16=True)
    result = CliRunner().invoke(app, ["report", str(out), "--out", str(tmp_path / "r"), "--json",
                                      str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    sections = json.loads((tmp_path / "r.json").read_text())["sections"]
    assert len(sections) == 7 and all(s["exit_code"] == 0 for s in sections), [(s["name"], s["note"])
                                                                               for s in sections]
    fidelities = [s["json"]["replay_fidelity"] for s in sections if s["json"].get("replay_fidelity")]
    assert len(fidelities) >= 5
    assert all(f["preset"] == "eager-reexec" and f["o_bits_equal"] >= 0.9999 for f in fidelities)
