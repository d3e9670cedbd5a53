"""The cached match behind `--preset auto`: kept in the layer's attributes, recomputed when the dump changes."""
from __future__ import annotations

import zarr

import fa_forensics.analyses.match as match_mod
from fa_forensics.analyses.match import CACHE_ATTR, best_recipe
from fa_forensics.dump import open_dump


def test_best_recipe_is_cached_and_a_changed_o_invalidates_it(make_dump, monkeypatch):
    path = make_dump(steps=(0,), seq=32, head_dim=16)
    calls = []
    real = match_mod.match_layer
    monkeypatch.setattr(match_mod, "match_layer", lambda *a, **k: calls.append(1) or real(*a, **k))

    first = best_recipe(open_dump(path), 0, 0)
    assert first.best.o_bits_equal == 1.0 and first.best.preset == "bf16" and len(calls) == 1  # o = the bf16 replay
    again = best_recipe(open_dump(path), 0, 0)
    assert again == first and len(calls) == 1  # read from the layer's attributes
    assert open_dump(path)._layer(0, 0).attrs[CACHE_ATTR]["best"]["preset"] == "bf16"

    o = zarr.open_group(str(path), mode="r+")["step_000000000/layer_000/o"]
    bits = o[...]
    bits[0, 0, 5, 3] ^= 1  # one stored O element one ulp off: the dump changed
    o[...] = bits
    changed = best_recipe(open_dump(path), 0, 0)
    assert len(calls) == 2 and changed.best.o_bits_equal < 1.0
