"""The launcher's pieces for ranks: --local-rank back to the script, SDPA names bound before the patch."""
from __future__ import annotations

import types

from fa_forensics.capture import sdpa
from fa_forensics.capture.launch import script_argv
from fa_forensics.capture.spawned import point_bindings_at


def test_the_local_rank_torch_distributed_launch_passes_goes_back_to_the_script():
    assert script_argv(["--local-rank=1", "train.py", "--lr", "1"]) == ["train.py", "--local-rank=1", "--lr", "1"]
    assert script_argv(["--local_rank=0", "--module", "pkg.train", "x"]) == ["--module", "pkg.train", "--local_rank=0",
                                                                             "x"]
    assert script_argv(["train.py", "--local-rank=3"]) == ["train.py", "--local-rank=3"]  # already the script's


def test_names_bound_to_sdpa_before_the_patch_point_at_the_patched_function(monkeypatch):
    script = types.ModuleType("__mp_main__")
    script.attention = sdpa.original_sdpa()  # `from torch.nn.functional import scaled_dot_product_attention as ...`
    script.other = len
    monkeypatch.setitem(__import__("sys").modules, "__mp_main__", script)
    assert point_bindings_at(sdpa.original_sdpa(), sdpa.patched_sdpa) == ["__mp_main__.attention"]
    assert script.attention is sdpa.patched_sdpa and script.other is len
    assert sdpa.original_sdpa() is not sdpa.patched_sdpa  # fa-forensics' own reference is left as it is
