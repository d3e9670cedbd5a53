"""Every engine equals the spec bit for bit on the golden corpus (fa_forensics/replay/corpus.py), and the
engine interface routes the work: the compiled kernels run under Engine.COMPILED and never under Engine.SPEC."""
import pytest
import torch

from fa_forensics.enums import Engine
from fa_forensics.errors import ConfigError, InvalidSetting
from fa_forensics.numerics import accumulate_jit, matmul
from fa_forensics.numerics.engines import available, available_engines, current_engine, resolve_engine, use_engine
from fa_forensics.replay import ReplayConfig, replay
from fa_forensics.replay.config import PRESETS
from fa_forensics.replay.corpus import FIELDS, SMALL_INPUTS, STATS, run_case, small_cases
from fa_forensics.replay.emulate import fused

_FAST_ENGINES = [e for e in available_engines() if e is not Engine.SPEC]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a float tensor (fp32 view of every value; NaNs keep their payload)."""
    return x.float().contiguous().view(torch.int32)


def _differences(got, spec) -> list[str]:
    """The outputs of one replay whose bits differ from the spec's (a refusal must be the same line)."""
    if isinstance(got, str) or isinstance(spec, str):
        return [] if got == spec else [f"{got!r} vs {spec!r}"]
    bad = []
    for f in FIELDS:
        a, b = getattr(got, f), getattr(spec, f)
        if a is None or b is None:
            same = a is b
        else:
            same = a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
        if not same:
            bad.append(f)
    bad += [f for f in STATS if not torch.equal(getattr(got.stats, f), getattr(spec.stats, f))]
    return bad


def test_the_compiled_engine_is_available_and_the_default():
    assert Engine.COMPILED in _FAST_ENGINES  # numba is a dependency: the golden test below is never empty
    assert current_engine() is Engine.COMPILED


@pytest.mark.parametrize("engine", _FAST_ENGINES, ids=lambda e: e.value)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_engine_gives_the_specs_bits_on_the_golden_corpus(preset, engine):
    """Both models, no mask, a bool and an additive mask (rows that see no key), causal and not, tied
    scores: O, lse, δ, dQ, dK, dV and the P̄ statistics, bit for bit (the forward alone where a kernel
    model refuses the masked backward; a refusal must be the same line)."""
    differ = {}
    replayed = 0
    for case in small_cases(preset):
        spec = run_case(case, Engine.SPEC, forward_when_refused=True)
        got = run_case(case, engine, forward_when_refused=True)
        replayed += not isinstance(spec, str)
        if bad := _differences(got, spec):
            differ[case.key] = bad
    assert not differ, f"{engine.value} differs from the spec: {differ}"
    assert replayed >= 4  # the GPU kernel models replay masks (bool and additive) forward only


def _counting(monkeypatch, module, name, calls):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kw: calls.append(name) or original(*args, **kw))


def test_the_engine_decides_which_kernels_run(monkeypatch):
    """Engine.SPEC never enters a compiled kernel (matmul or row stage); Engine.COMPILED runs both, whether
    chosen by the argument of replay or by use_engine."""
    calls = []
    for module, name in ((accumulate_jit, "ieee_matmul"), (fused, "_forward_block"), (fused, "_backward_probs")):
        _counting(monkeypatch, module, name, calls)
    q, k, v, do = SMALL_INPUTS[0].tensors()
    cfg = ReplayConfig.preset("bf16")
    spec = replay(q, k, v, cfg, do=do, engine=Engine.SPEC)
    assert calls == []
    with use_engine(Engine.SPEC):
        assert replay(q, k, v, cfg, do=do).o.equal(spec.o) and calls == []
        compiled = replay(q, k, v, cfg, do=do, engine="compiled")  # the argument wins over the context
    assert {"ieee_matmul", "_forward_block", "_backward_probs"} <= set(calls)
    assert not _differences(compiled, spec)


def test_use_engine_nests_and_restores_and_matmul_keeps_its_names():
    assert current_engine() is Engine.COMPILED
    with use_engine("spec") as outer:
        assert outer is Engine.SPEC and current_engine() is Engine.SPEC
        with use_engine(Engine.COMPILED):
            assert current_engine() is Engine.COMPILED
        with use_engine(None):  # None keeps the current engine
            assert current_engine() is Engine.SPEC
        assert current_engine() is Engine.SPEC
    assert current_engine() is Engine.COMPILED
    assert resolve_engine("auto") is Engine.COMPILED and resolve_engine("torch") is Engine.SPEC
    assert available(Engine.SPEC) and available()
    a, b = torch.tensor([[1.5, -2.0]]), torch.tensor([[0.25], [3.0]])
    assert matmul(a, b, engine="torch").equal(matmul(a, b, engine=Engine.COMPILED))


def test_an_unknown_engine_and_an_engine_for_the_triton_backend_are_refused_in_one_line():
    q, k, v, _ = SMALL_INPUTS[0].tensors()
    with pytest.raises(InvalidSetting, match="engine: 'fast' is not one of: spec, compiled"):
        with use_engine("fast"):
            pass
    with pytest.raises(InvalidSetting, match="engine: 'numba' is not one of"):
        replay(q, k, v, ReplayConfig(), engine="numba")
    with pytest.raises(ConfigError, match="backend triton runs its own kernels"):
        replay(q, k, v, ReplayConfig(), backend="triton", engine=Engine.SPEC)
