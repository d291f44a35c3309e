"""The LPMM ops (lpmm.txt Algorithm 1) against their pure-PyTorch twins, and the unbiasedness of every
quantizer they use: linear stochastic rounding for parameters and accumulators, dynamic-map stochastic
rounding for momentum (section 5.1)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowbit
from lowbit import _ops, _reference
from lowbit._reference import optim as reference_optim
from lowbit.functional import create_dynamic_map
from tests.conftest import DTYPES, sample

SGD, ADAM = 1, 0
DECOUPLED, NESTEROV = 1, 2


def _linear(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _ops.quantize_linear(x.reshape(-1).float().contiguous(), bits, group, False, 0, 0)


def _step_args(
    n_list: list[int],
    *,
    rule: int,
    param_bits: int,
    grad_bits: int,
    state_bits: int,
    group: int,
    n_states: int,
    seed: int,
    device: str = "cpu",
    stochastic: bool = True,
    offsets: list[int] | None = None,
) -> list:
    """Arguments of lowbit::lpmm_step_ for random tensors of the given sizes."""
    params, pabs, grads, gabs, s1, s2, a1, a2 = ([] for _ in range(8))
    m1 = create_dynamic_map(signed=True, total_bits=state_bits).to(device)
    m2 = create_dynamic_map(signed=False, total_bits=state_bits).to(device)
    for i, n in enumerate(n_list):
        c, a = _linear(sample("normal", n, seed=seed + i), param_bits, group)
        params.append(c.to(device))
        pabs.append(a.to(device))
        c, a = _linear(sample("heavy", n, seed=seed + 100 + i) * 1e-2, grad_bits, group)
        grads.append(c.to(device))
        gabs.append(a.to(device))
        for k, (lst, amx, m) in enumerate(((s1, a1, m1), (s2, a2, m2))[:n_states]):
            v = sample("normal", n, seed=seed + 200 + i + k) * 1e-2
            if k == 1:
                v = v * v
            c, a = _ops.quantize_blockwise(v, m.cpu(), state_bits, group, False, 0, 0)
            lst.append(c.to(device))
            amx.append(a.to(device))
    if rule == SGD:
        hyper, flags = [0.1, 0.9, 0.0, 1.0, 0.0, 0.0, 1e-3, 1.0, 0.0, 0.0, 0.0], NESTEROV if seed % 2 else 0
        scalars = [0.1, 1.0, float(seed % 3 == 0)] * len(n_list)
    else:
        hyper, flags = [1e-2, 0.9, 0.999, 0.1, 0.001, 1e-8, 0.1, 1 - 1e-3, 0.0, 0.0, 0.0], DECOUPLED
        scalars = [1e-2 / (1 - 0.9**3), (1 - 0.999**3) ** 0.5, 0.0] * len(n_list)
    return [
        params,
        pabs,
        grads,
        gabs,
        s1,
        s2,
        a1,
        a2,
        list(n_list),
        scalars,
        m1,
        m2,
        rule,
        hyper,
        flags,
        n_states,
        group,
        param_bits,
        grad_bits,
        state_bits,
        stochastic,
        stochastic,
        seed,
        offsets,
    ]


def _clone(args: list) -> list:
    return [[t.clone() for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor) else a for a in args]


@given(
    n=st.integers(1, 9000),
    bits=st.integers(2, 16),
    group=st.sampled_from([64, 256, 2048, 4096]),
    dtype=st.sampled_from(DTYPES),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**40),
)
def test_accumulate_matches_reference(n, bits, group, dtype, stochastic, seed):
    codes, absmax = _linear(sample("heavy", n, seed=1), bits, group)
    grad = sample("normal", n, seed=2, dtype=dtype)
    ref_codes, ref_absmax = codes.clone(), absmax.clone()
    _ops.lpmm_accumulate_(grad, codes, absmax, bits, group, stochastic, seed)
    _reference.lpmm_accumulate_(grad, ref_codes, ref_absmax, bits, group, stochastic, seed)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(absmax, ref_absmax)


def test_accumulate_into_empty_accumulator_is_the_quantized_gradient():
    n, bits, group = 5000, 8, 2048
    codes = torch.zeros(_ops.packed_bytes(n, bits), dtype=torch.uint8)
    absmax = torch.zeros(_ops.num_blocks(n, group))
    grad = sample("normal", n, seed=3)
    _ops.lpmm_accumulate_(grad, codes, absmax, bits, group, False, 0)
    expected = _ops.quantize_linear(grad, bits, group, False, 0, 0)
    assert torch.equal(codes, expected[0]) and torch.equal(absmax, expected[1])


@pytest.mark.parametrize("cpu_kernels", ["avx512-gather-vbmi", "avx2", "portable"], indirect=True)
@pytest.mark.parametrize("rule,n_states", [(SGD, 1), (SGD, 0), (ADAM, 2)])
@pytest.mark.parametrize("bits", [(12, 8, 8), (8, 8, 8), (16, 4, 4), (5, 13, 6)])
@pytest.mark.parametrize("group", [64, 2048])
def test_step_matches_reference(cpu_kernels, rule, n_states, bits, group):
    pb, gb, sb = bits
    for seed, sizes in ((0, [1, 4095, 4097]), (7, [2048, 100, 70000])):
        args = _step_args(
            sizes, rule=rule, param_bits=pb, grad_bits=gb, state_bits=sb, group=group, n_states=n_states, seed=seed
        )
        ref = _clone(args)
        _ops.lpmm_step_(*args)
        _reference.lpmm_step_(*ref)
        for got, want in zip(args[:8], ref[:8], strict=True):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
        assert all(float(a.abs().sum()) == 0 for a in args[3])


@pytest.mark.parametrize("cpu_kernels", ["avx512-gather-vbmi", "portable"], indirect=True)
@pytest.mark.parametrize(("param_bits", "grad_bits"), [(12, 8), (8, 12)])
@pytest.mark.parametrize("where", ["params", "grads"])
def test_step_decodes_every_linear_code_exactly(cpu_kernels, param_bits, grad_bits, where):
    # lpmm_step_ decodes parameters and gradients by linear_decode, ((code - qmax) / qmax) * absmax, whose AVX-512
    # loop divides by one FMA correction (lpmm_avx512.cpp: linear_quotient16). Every code of the width, each alone
    # in its group of 64 (the rest the code of 0) with absmax 1, so that a group's new parameter absmax is its
    # decoded value's magnitude: SGD without momentum at lr 1 (p - 1 * g), with the codes in the parameters and
    # zero gradients, or in the gradients and zero parameters. The reference is torch's fp32 division.
    group = 64
    bits = param_bits if where == "params" else grad_bits
    qmax = 2 ** (bits - 1) - 1
    codes = torch.arange(2 * qmax + 1)
    n = codes.numel() * group
    tensors = {}
    for name, b in (("params", param_bits), ("grads", grad_bits)):
        q = 2 ** (b - 1) - 1
        full = torch.full((codes.numel(), group), q, dtype=torch.int64)
        if name == where:
            full[:, 0] = codes
        tensors[name] = (_reference.pack_bits(full, b), torch.ones(codes.numel()))
    hyper = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    maps = [create_dynamic_map(signed=True, total_bits=8), create_dynamic_map(signed=False, total_bits=8)]
    args = [[tensors["params"][0]], [tensors["params"][1]], [tensors["grads"][0]], [tensors["grads"][1]]]
    args += [[], [], [], [], [n], [1.0, 1.0, 0.0], *maps, SGD, hyper, 0, 0, group, param_bits, grad_bits, 8]
    args += [False, False, 0, None]
    _ops.lpmm_step_(*args)
    want = ((codes - qmax).float() / qmax).abs()
    assert torch.equal(args[1][0], want)
    assert bool((want[:qmax] > 0).all()) and float(want[qmax]) == 0.0  # every code but qmax's moves its group


# Sizes around the 16-element chunks of the AVX-512 loops (lpmm_avx512.h) and the 512-element tiles of
# the portable ones: empty, partial and whole chunks at group ends, and groups that end in a short tail.
_TAIL_SIZES = [1, 7, 15, 16, 17, 31, 33, 520, 2047, 2049, 4111]


def _step_and_codes(kernels: str, args: list) -> list:
    """lpmm_step_ on a copy of ``args`` with the CPU kernels set as the ``cpu_kernels`` fixture sets them."""
    avx512 = kernels.startswith("avx512")
    assert lowbit._C._set_cpu_avx512(avx512) or not avx512
    lowbit._C._set_cpu_avx2(kernels != "portable")
    lowbit._C._set_cpu_gather_encode(1 if kernels in ("avx512-gather-vbmi", "avx2") else 0)
    try:
        out = _clone(args)
        _ops.lpmm_step_(*out)
        return out[:8]
    finally:
        lowbit._C._set_cpu_avx512(True)
        lowbit._C._set_cpu_avx2(True)
        lowbit._C._set_cpu_gather_encode(-1)


@pytest.mark.skipif(not lowbit._C._set_cpu_avx512(True), reason="this CPU has no AVX-512F")
@pytest.mark.parametrize("rule,n_states", [(SGD, 1), (SGD, 0), (ADAM, 2)])
@pytest.mark.parametrize("bits", [(12, 8, 8), (8, 12, 8)])
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("group", [64, 2048])
def test_step_vector_loops_equal_portable_loops_on_tails(rule, n_states, bits, stochastic, group):
    # The AVX-512 loops of the 8- and 12-bit linear codes and of the 8-bit momentum codes take whole
    # 16-element chunks and leave each group's tail to the portable loops; both must give the twin's codes
    # bit for bit, whichever encoder (gather or table) is chosen. Tensor i starts 20 counters below
    # (i + 1) * 2^32, so from its 21st element on the counter's low half wraps and the carry reaches
    # the high half inside a chunk.
    pb, gb, sb = bits
    args = _step_args(
        _TAIL_SIZES,
        rule=rule,
        param_bits=pb,
        grad_bits=gb,
        state_bits=sb,
        group=group,
        n_states=n_states,
        seed=3,
        stochastic=stochastic,
        offsets=[((i + 1) << 32) - 20 for i in range(len(_TAIL_SIZES))],
    )
    want = _clone(args)
    _reference.lpmm_step_(*want)
    portable = _step_and_codes("portable", args)
    for kernels in ("avx512-gather-vbmi", "avx512"):
        got = _step_and_codes(kernels, args)
        for g, p, w in zip(got, portable, want[:8], strict=True):
            for a, b, c in zip(g, p, w, strict=True):
                assert torch.equal(a, b), kernels
                assert torch.equal(a, c), kernels


@pytest.mark.skipif(not lowbit._C._set_cpu_avx512(True), reason="this CPU has no AVX-512F")
@pytest.mark.parametrize("bits", [8, 12])
@pytest.mark.parametrize("stochastic", [True, False])
def test_accumulate_vector_loops_equal_portable_loops_on_tails(bits, stochastic):
    # Accumulation decodes and re-encodes the linear codes with the same loops as the step.
    for n in _TAIL_SIZES:
        codes, absmax = _linear(sample("heavy", n, seed=n), bits, 64)
        grad = sample("normal", n, seed=n + 1)
        want = (codes.clone(), absmax.clone())
        _reference.lpmm_accumulate_(grad, *want, bits, 64, stochastic, 11)
        results = []
        for avx512 in (True, False):
            lowbit._C._set_cpu_avx512(avx512)
            try:
                got = (codes.clone(), absmax.clone())
                _ops.lpmm_accumulate_(grad, *got, bits, 64, stochastic, 11)
            finally:
                lowbit._C._set_cpu_avx512(True)
            results.append(got)
        for got in results:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), n
        assert torch.equal(results[0][0], results[1][0]), n


def _one_tensor(args: list, i: int) -> list:
    """The arguments of ``args`` (from :func:`_step_args`) for its tensor ``i`` alone."""
    lists = [[lst[i]] if lst else [] for lst in args[:8]]
    offsets = args[23]
    return [*lists, [args[8][i]], args[9][3 * i : 3 * i + 3], *args[10:23], None if offsets is None else [offsets[i]]]


@pytest.mark.parametrize("rule,n_states", [(SGD, 1), (ADAM, 2)])
def test_step_with_offsets_rounds_each_tensor_as_if_alone(rule, n_states):
    # The LPMM optimizers give each parameter a counter range of its own, so that it rounds the same
    # whichever parameters step in the same call (gradient release steps them one at a time): the fused
    # call over three tensors with offsets must equal the twin stepping each tensor alone at its offset.
    sizes, offsets = [4095, 100, 5000], [3 << 40, 7, 1 << 40]
    kw = dict(rule=rule, param_bits=12, grad_bits=8, state_bits=4, group=2048, n_states=n_states, seed=5)
    args = _step_args(sizes, **kw, offsets=offsets)
    untouched = _clone(args)
    _ops.lpmm_step_(*args)
    for i in range(len(sizes)):
        alone = _one_tensor(untouched, i)
        _reference.lpmm_step_(*alone)
        for got, want in zip(args[:8], alone[:8], strict=True):
            if want:
                assert torch.equal(got[i], want[0]), i
    # The offsets are what makes it so: with the default ones (tensor 1 continuing at counter 4095) the
    # second tensor's draws, hence its stochastically rounded codes, differ.
    default = _clone(untouched)
    default[23] = None
    _ops.lpmm_step_(*default)
    assert not torch.equal(default[0][1], args[0][1])


def test_eager_step_is_the_op_and_bumps_versions():
    args = _step_args([3000], rule=SGD, param_bits=12, grad_bits=8, state_bits=8, group=2048, n_states=1, seed=1)
    ref = _clone(args)
    before = args[0][0]._version
    _ops.lpmm_step_eager(_ops.LpmmStepArgs(*args))
    _ops.lpmm_step_(*ref)
    assert torch.equal(args[0][0], ref[0][0]) and torch.equal(args[4][0], ref[4][0])
    assert args[0][0]._version > before


def _mean_over_seeds(fn, seeds: int) -> torch.Tensor:
    return torch.stack([fn(s) for s in range(seeds)]).double().mean(0)


def test_accumulator_is_unbiased():
    # E[Q(g + x)] = g + x (lpmm.txt Lemma 1). Per element the rounding error is bounded by one step
    # delta = absmax / qmax, so the mean of K draws has standard deviation <= delta / (2 sqrt(K)).
    n, bits, group, seeds = 4096, 8, 2048, 400
    g0 = sample("normal", n, seed=4)
    x = sample("normal", n, seed=5) * 0.3
    c0, a0 = _linear(g0, bits, group)
    exact = _ops.dequantize_linear(c0, a0, bits, group, n, torch.float32).double() + x.double()

    def once(seed: int) -> torch.Tensor:
        c, a = c0.clone(), a0.clone()
        _ops.lpmm_accumulate_(x, c, a, bits, group, True, seed)
        return _ops.dequantize_linear(c, a, bits, group, n, torch.float32)

    mean = _mean_over_seeds(once, seeds)
    delta = float(exact.abs().max()) / 127
    bound = 6 * delta / (2 * seeds**0.5)
    assert float((mean - exact).abs().max()) < bound
    # Round-to-nearest is biased per element: its error does not shrink with more draws.
    c, a = c0.clone(), a0.clone()
    _ops.lpmm_accumulate_(x, c, a, bits, group, False, 0)
    nearest = _ops.dequantize_linear(c, a, bits, group, n, torch.float32).double()
    assert float((nearest - exact).abs().mean()) > 10 * float((mean - exact).abs().mean())


@pytest.mark.parametrize("rule,n_states", [(SGD, 1), (ADAM, 2)])
def test_step_is_unbiased_for_parameters_and_states(rule, n_states):
    # Stochastic re-encoding of p (linear) and of the states (dynamic map) is unbiased: averaged over
    # seeds, the decoded results approach the fp32 update of the decoded inputs (the twin with
    # nothing rounded after the update). Adam's second moment is stored as its root (state_form.h),
    # so the root is what is unbiased.
    n, group, seeds = 2048, 2048, 300
    base = _step_args([n], rule=rule, param_bits=8, grad_bits=8, state_bits=8, group=group, n_states=n_states, seed=3)
    m1, m2 = base[10], base[11]
    p = _ops.dequantize_linear(base[0][0], base[1][0], 8, group, n, torch.float32)
    g = _ops.dequantize_linear(base[2][0], base[3][0], 8, group, n, torch.float32)
    stored = [
        _ops.dequantize_blockwise(base[4 + k][0], base[6 + k][0], (m1, m2)[k], 8, group, n, torch.float32)
        for k in range(n_states)
    ] + [torch.zeros(n)] * (2 - n_states)
    root = rule == ADAM
    states = [stored[0], stored[1].square() if root else stored[1]]
    sc = torch.tensor(base[9][:3])
    u, s1, s2 = reference_optim._rule_step(rule, _ops.StepHyper(*base[13]), base[14], sc, p, g, states[0], states[1])
    if rule == ADAM:
        p = p * torch.tensor(base[13][7], dtype=torch.float32)
    exact = [(p - u).double(), s1.double(), s2.double().sqrt() if root else s2.double()]

    def once(seed: int) -> torch.Tensor:
        args = _clone(base)
        args[22] = seed
        _ops.lpmm_step_(*args)
        out = [_ops.dequantize_linear(args[0][0], args[1][0], 8, group, n, torch.float32)]
        for k in range(n_states):
            out.append(
                _ops.dequantize_blockwise(args[4 + k][0], args[6 + k][0], (m1, m2)[k], 8, group, n, torch.float32)
            )
        return torch.stack(out)

    mean = _mean_over_seeds(once, seeds)
    for k in range(1 + n_states):
        err = (mean[k] - exact[k]).abs()
        # The dynamic map's step near x is at most 2 * the distance to the farther neighbour; bound the
        # per-element step by the group absmax times the map's largest gap (linear: 1 / qmax).
        gap = 1 / 127 if k == 0 else float((m1 if k == 1 else m2).diff().max())
        bound = 6 * float(exact[k].abs().max()) * gap / (2 * seeds**0.5)
        assert float(err.max()) < bound, (k, float(err.max()), bound)


def test_step_errors_name_the_argument():
    args = _step_args([100], rule=SGD, param_bits=12, grad_bits=8, state_bits=8, group=64, n_states=1, seed=0)
    bad = _clone(args)
    bad[17] = 17
    with pytest.raises(ValueError, match="param_bits"):
        _ops.lpmm_step_eager(_ops.LpmmStepArgs(*bad))
    bad = _clone(args)
    bad[8] = [101]
    with pytest.raises(ValueError, match=r"params\[0\] codes"):
        _ops.lpmm_step_eager(_ops.LpmmStepArgs(*bad))
    bad = _clone(args)
    bad[12] = 3
    with pytest.raises(ValueError, match="rule"):
        _ops.lpmm_step_eager(_ops.LpmmStepArgs(*bad))
    bad = _clone(args)
    bad[4] = []
    with pytest.raises(ValueError, match="state1"):
        _ops.lpmm_step_eager(_ops.LpmmStepArgs(*bad))
    before = [t.clone() for t in args[0]]
    bad = _clone(args)
    bad[16] = 100
    with pytest.raises(ValueError, match="blocksize"):
        _ops.lpmm_step_eager(_ops.LpmmStepArgs(*bad))
    assert torch.equal(args[0][0], before[0])


def test_accumulate_errors_name_the_argument():
    codes, absmax = _linear(torch.zeros(100), 8, 64)
    with pytest.raises(ValueError, match="accumulator codes"):
        _ops.lpmm_accumulate_(torch.zeros(101), codes, absmax, 8, 64, True, 0)
    with pytest.raises(TypeError, match="grad"):
        _ops.lpmm_accumulate_(torch.zeros(100, dtype=torch.float64), codes, absmax, 8, 64, True, 0)
    with pytest.raises(ValueError, match="bits"):
        _ops.lpmm_accumulate_(torch.zeros(100), codes, absmax, 1, 64, True, 0)


def test_ops_pass_opcheck():
    codes, absmax = _linear(sample("normal", 300), 8, 64)
    torch.library.opcheck(_ops.lpmm_accumulate_, (sample("normal", 300, seed=9), codes, absmax, 8, 64, True, 5))
    args = _step_args([300, 70], rule=ADAM, param_bits=12, grad_bits=8, state_bits=8, group=64, n_states=2, seed=2)
    torch.library.opcheck(_ops.lpmm_step_, tuple(args))
