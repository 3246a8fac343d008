"""Tests of `dayzero.serving.sampling`: the batched sampler, per-request keys, parameter validation, stop checks.

Oracles: numpy argmax / log_softmax and a numpy reference of the filtered distribution (temperature, top-k,
top-p, min-p) against empirical frequencies of many draws; a brute-force stop check that decodes every prefix.
Inputs are fresh random draws every run; each test prints its seed and puts it in every assertion message.
Set DAYZERO_TEST_SEED=<int> to replay a failing draw.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from dayzero.model.errors import RequestError
from dayzero.serving.sampling import (SamplingParams, StopChecker, key_stream, request_key, request_keys, sample,
                                      stream_keys)

sample_jit = jax.jit(sample)

N_DRAWS = 5000  # identical rows per distribution check: std of a frequency <= 0.0071, tolerance 0.03 is > 4 std
V = 48


def run(logits, temperature, top_k=None, top_p=None, min_p=None, keys=None, rng=None):
    """Calls the jitted sampler with per-row arrays (scalars broadcast); returns numpy (ids, logprobs)."""
    logits = np.asarray(logits, np.float32)
    b = logits.shape[0]

    def row(x, default, dtype):
        return np.broadcast_to(np.asarray(default if x is None else x, dtype), (b,)).copy()

    if keys is None:
        keys = rng.integers(0, 2**32, (b, 2), dtype=np.uint32)
    ids, lps = sample_jit(logits, row(temperature, 1.0, np.float32), row(top_k, -1, np.int32),
                          row(top_p, 1.0, np.float32), row(min_p, 0.0, np.float32), keys)
    return np.asarray(ids), np.asarray(lps)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def reference_probs(logits, temperature, top_k=-1, top_p=1.0, min_p=0.0):
    """Filtered, renormalised distribution f64[V] of one row (temperature, top-k, top-p on the top-k
    distribution, min-p relative to the top token; the top token always kept)."""
    probs = np.exp(log_softmax(np.asarray(logits, np.float64) / temperature))
    order = np.argsort(-probs, kind="stable")
    p = probs[order]
    keep = np.arange(len(p)) < (top_k if top_k > 0 else len(p))
    q = np.where(keep, p, 0.0) / p[keep].sum()
    before = np.cumsum(q) - q
    if top_p < 1:
        keep &= before < top_p
    keep &= p >= min_p * p[0]
    keep[0] = True
    out = np.zeros_like(probs)
    out[order[keep]] = p[keep] / p[keep].sum()
    return out


def nucleus_top_p(logits, temperature, rng, top_k=-1):
    """A top_p halfway between two cumulative masses (no float ties at the boundary), nucleus >= 2 tokens."""
    p = np.sort(np.exp(log_softmax(np.asarray(logits, np.float64) / temperature)))[::-1]
    if top_k > 0:
        p = p[:top_k] / p[:top_k].sum()
    cum = np.cumsum(p)
    m = int(rng.integers(1, min(len(p), 8)))
    return float((cum[m - 1] + cum[m]) / 2)


def between_ratios(logits, temperature, rng):
    """A min_p halfway between two consecutive p/p_max ratios (keeps 2..8 tokens)."""
    p = np.sort(np.exp(log_softmax(np.asarray(logits, np.float64) / temperature)))[::-1]
    r = p / p[0]
    m = int(rng.integers(2, 9))
    return float((r[m - 1] + r[m]) / 2)


def check_distribution(ids, expected, msg):
    """Support of `ids` within expected's support; each frequency within 5 standard errors of its probability
    (a false alarm about once in a million per token; a sampler off by a few percent still fails)."""
    allowed = set(np.flatnonzero(expected > 0).tolist())
    seen = set(np.unique(ids).tolist())
    assert seen <= allowed, f"{msg}: tokens {sorted(seen - allowed)} outside the allowed set {sorted(allowed)}"
    freq = np.bincount(ids, minlength=len(expected)) / len(ids)
    diff = np.abs(freq - expected)
    bound = 5 * np.sqrt(expected * (1 - expected) / len(ids)) + 1e-3
    support = sorted(allowed)
    assert np.all(diff <= bound), (f"{msg}: |freq - p| = {diff[support]} over 5 standard errors {bound[support]}"
                                   f"\nfreq={freq[support]}\np={expected[support]}")


def random_logits(rng, shape, scale=1.5):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ------------------------------------------------------------------------------------------------ sampler
def test_greedy_rows_are_argmax_and_logprobs_are_raw_log_softmax(seed):
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, (16, V))
    ids, lps = run(logits, 0.0, top_k=rng.integers(-1, 5, 16), top_p=0.5, min_p=0.3, rng=rng)
    np.testing.assert_array_equal(ids, logits.argmax(-1), err_msg=f"seed={seed}")
    expected = log_softmax(logits)[np.arange(16), ids]
    np.testing.assert_allclose(lps, expected, rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")


def test_all_greedy_variant_has_no_sampling_path_and_no_device_branch(seed):
    """`all_greedy=True` (the host knows every row is greedy) gives the same ids and logprobs as the other
    variants; True and False do not branch on the device (a conditional would make a GPU wait for its predicate
    on the host every decode step), None does."""
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, (4, V))
    args = (logits, np.zeros(4, np.float32), np.full(4, -1, np.int32), np.full(4, 0.9, np.float32),
            np.zeros(4, np.float32), rng.integers(0, 2**32, (4, 2), dtype=np.uint32))
    greedy = jax.jit(sample, static_argnames="all_greedy")
    fast = greedy(*args, all_greedy=True)
    np.testing.assert_array_equal(np.asarray(fast[0]), logits.argmax(-1))
    for other in (False, None):
        general = greedy(*args, all_greedy=other)
        np.testing.assert_array_equal(np.asarray(fast[0]), np.asarray(general[0]))
        np.testing.assert_allclose(np.asarray(fast[1]), np.asarray(general[1]), rtol=1e-6)
    for all_greedy in (True, False, None):
        jaxpr = str(jax.make_jaxpr(functools.partial(sample, all_greedy=all_greedy))(*args))
        assert ("cond[" in jaxpr) == (all_greedy is None), all_greedy
        assert ("top_k[" in jaxpr) == (all_greedy is not True), all_greedy  # the sampling path sorts with top_k


def test_top_k_one_is_argmax_at_any_temperature(seed):
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, (16, V))
    temps = rng.uniform(0.1, 3.0, 16)
    ids, _ = run(logits, temps, top_k=1, rng=rng)
    np.testing.assert_array_equal(ids, logits.argmax(-1), err_msg=f"seed={seed} temps={temps}")


def test_mixed_greedy_and_sampled_rows(seed):
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, (16, V))
    temps = np.where(np.arange(16) % 2 == 0, 0.0, 1.0)
    ids, _ = run(logits, temps, top_k=3, rng=rng)
    np.testing.assert_array_equal(ids[::2], logits[::2].argmax(-1), err_msg=f"seed={seed}")
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    for r in range(1, 16, 2):
        assert ids[r] in top3[r], f"seed={seed}: row {r} drew {ids[r]} outside top-3 {top3[r]}"


@pytest.mark.parametrize("case", ["temperature", "top_k", "top_p", "min_p", "all"])
def test_filtered_distribution_matches_reference(seed, case):
    rng = np.random.default_rng(seed)
    row = random_logits(rng, (V,))
    t = float(rng.uniform(0.6, 1.6))
    k, p, mp = -1, 1.0, 0.0
    if case in ("top_k", "all"):
        k = int(rng.integers(2, 12))
    if case in ("top_p", "all"):
        p = nucleus_top_p(row, t, rng, top_k=k)
    if case in ("min_p", "all"):
        mp = between_ratios(row, t, rng)
    expected = reference_probs(row, t, k, p, mp)
    ids, lps = run(np.tile(row, (N_DRAWS, 1)), t, k, p, mp, rng=rng)
    check_distribution(ids, expected, f"seed={seed} case={case} T={t} top_k={k} top_p={p} min_p={mp}")
    np.testing.assert_allclose(lps, log_softmax(row)[ids], rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")


def test_mixed_settings_in_one_batch_are_honoured_row_by_row(seed):
    rng = np.random.default_rng(seed)
    n = N_DRAWS // 2
    groups = []  # (logits row, T, top_k, top_p, min_p)
    for kind in ("plain", "top_k", "top_p", "min_p", "greedy"):
        row = random_logits(rng, (V,))
        t = float(rng.uniform(0.6, 1.6))
        k, p, mp = -1, 1.0, 0.0
        if kind == "top_k":
            k = int(rng.integers(2, 8))
        elif kind == "top_p":
            p = nucleus_top_p(row, t, rng)
        elif kind == "min_p":
            mp = between_ratios(row, t, rng)
        elif kind == "greedy":
            t = 0.0
        groups.append((kind, row, t, k, p, mp))
    logits = np.concatenate([np.tile(g[1], (n, 1)) for g in groups])
    per_row = [np.repeat([g[i] for g in groups], n) for i in range(2, 6)]
    perm = rng.permutation(len(logits))  # interleave the groups
    ids, _ = run(logits[perm], *(a[perm] for a in per_row), rng=rng)
    ids = ids[np.argsort(perm)]
    for g, (kind, row, t, k, p, mp) in enumerate(groups):
        got = ids[g * n:(g + 1) * n]
        expected = reference_probs(row, t, k, p, mp) if t > 0 else np.eye(V)[row.argmax()]
        check_distribution(got, expected, f"seed={seed} group={kind} T={t} top_k={k} top_p={p} min_p={mp}")


def test_large_vocab_under_jit_smoke(seed):
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, (4, 160_000), scale=3.0)
    ids, lps = run(logits, [0.0, 0.8, 1.0, 1.3], top_k=[-1, 20, 0, 0], top_p=[1.0, 1.0, 0.9, 1.0],
                   min_p=[0.0, 0.0, 0.0, 0.2], rng=rng)
    assert ids.dtype == np.int32 and lps.dtype == np.float32, (ids.dtype, lps.dtype)
    assert ids[0] == logits[0].argmax(), f"seed={seed}"
    assert ids[1] in np.argsort(-logits[1])[:20], f"seed={seed}"
    p3 = np.exp(log_softmax(logits[3] / 1.3))
    assert p3[ids[3]] >= 0.2 * p3.max(), f"seed={seed}"
    np.testing.assert_allclose(lps, log_softmax(logits)[np.arange(4), ids], rtol=1e-5, atol=1e-4,
                               err_msg=f"seed={seed}")


# ------------------------------------------------------------------------------------------------- keys
def test_request_key_is_deterministic_and_depends_on_seed_and_step(seed):
    rng = np.random.default_rng(seed)
    s, idx = int(rng.integers(0, 2**63)), int(rng.integers(0, 1000))
    k = request_key(s, idx, 3)
    assert k.shape == (2,) and k.dtype == np.uint32
    np.testing.assert_array_equal(k, request_key(s, idx + 17, 3), err_msg="a seeded key ignores request_index")
    keys = {tuple(request_key(s, 0, t)) for t in range(64)} | {tuple(request_key(s + j, 0, 0)) for j in range(1, 64)}
    assert len(keys) == 127, f"seed={seed}: colliding keys"
    unseeded = {tuple(request_key(None, i, 0)) for i in range(64)}
    assert len(unseeded) == 64 and tuple(request_key(None, idx, 0)) != tuple(request_key(idx, idx, 0)), seed
    batch = request_keys([s, None], [0, idx], [5, 6])
    np.testing.assert_array_equal(batch, np.stack([request_key(s, 0, 5), request_key(None, idx, 6)]))


@pytest.mark.parametrize("n", [1, 3, 40])  # 40: the vectorised path (over 32 keys), the others the Python one
def test_stream_keys_equal_request_keys(seed, n):
    """The engine's batched keys are `request_key`'s, seeds of any size, on both of its paths."""
    rng = np.random.default_rng(seed)
    seeds = [int(rng.integers(0, 2**63)), 2**64 - 1, -5, None, 0]
    first = rng.integers(0, 1 << 40, len(seeds))
    got = stream_keys([key_stream(sd, 7) for sd in seeds], first.tolist(), n)
    want = np.array([[request_key(sd, 7, int(t) + s) for s in range(n)] for sd, t in zip(seeds, first)])
    assert got.shape == (len(seeds), n, 2) and got.dtype == np.uint32
    np.testing.assert_array_equal(got, want, err_msg=f"seed={seed}")


def test_same_seed_and_step_same_token_different_steps_vary(seed):
    rng = np.random.default_rng(seed)
    s = int(rng.integers(0, 2**31))
    logits = np.zeros((32, V), np.float32)  # uniform: any key change shows up in the draws
    keys = request_keys([s] * 32, [0] * 32, range(32))
    a, _ = run(logits, 1.0, keys=keys)
    b, _ = run(logits, 1.0, keys=keys)
    np.testing.assert_array_equal(a, b, err_msg=f"seed={seed}")
    typed, _ = run(logits, 1.0, keys=jax.random.wrap_key_data(keys, impl="threefry2x32"))
    np.testing.assert_array_equal(typed, a, err_msg=f"seed={seed}: typed keys draw as their raw data")
    assert len(set(a.tolist())) > 5, f"seed={seed}: draws over 32 steps {a.tolist()}"
    other = request_keys(list(range(s + 1, s + 33)), [0] * 32, [0] * 32)
    c, _ = run(logits, 1.0, keys=other)
    assert len(set(c.tolist())) > 5, f"seed={seed}: draws over 32 seeds {c.tolist()}"


def test_request_result_does_not_depend_on_batch(seed):
    rng = np.random.default_rng(seed)
    n = 16
    logits = random_logits(rng, (n, V))
    temps = rng.uniform(0.5, 1.5, n) * (rng.random(n) > 0.2)
    top_k = rng.integers(-1, 10, n)
    top_p = rng.uniform(0.3, 1.0, n)
    min_p = rng.uniform(0.0, 0.2, n)
    keys = request_keys(rng.integers(0, 2**31, n).tolist(), [0] * n, rng.integers(0, 100, n).tolist())
    ids, lps = run(logits, temps, top_k, top_p, min_p, keys=keys)

    pick = rng.choice(n, 5, replace=False)  # the same 5 requests among 22 strangers, in another order
    m = 27
    slots = rng.choice(m, 5, replace=False)
    lg2 = random_logits(rng, (m, V))
    t2, k2, p2, mp2 = rng.uniform(0, 2, m), rng.integers(-1, 10, m), rng.uniform(0.1, 1, m), rng.uniform(0, 0.5, m)
    keys2 = rng.integers(0, 2**32, (m, 2), dtype=np.uint32)
    for arr, src in ((lg2, logits), (t2, temps), (k2, top_k), (p2, top_p), (mp2, min_p), (keys2, keys)):
        arr[slots] = src[pick]
    ids2, lps2 = run(lg2, t2, k2, p2, mp2, keys=keys2)
    np.testing.assert_array_equal(ids2[slots], ids[pick], err_msg=f"seed={seed}")
    np.testing.assert_allclose(lps2[slots], lps[pick], rtol=1e-6, atol=1e-6, err_msg=f"seed={seed}")


# ---------------------------------------------------------------------------------------------- validate
@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "hot"),
    ("top_k", -2), ("top_k", 2.5),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")),
    ("min_p", -0.01), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -3),
    ("stop_token_ids", [3, -1]), ("stop_token_ids", ["a"]),
    ("stop", ["ok", 7]), ("stop", [""]),
    ("seed", "abc"),
])
def test_validate_names_the_bad_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(RequestError) as err:
        params.validate("req-7")
    assert f"'{field}'" in str(err.value) and err.value.request_id == "req-7", str(err.value)


def test_validate_accepts_good_params_and_lists_become_tuples():
    params = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=1.0, max_tokens=1,
                            stop_token_ids=[5, 6], stop=["a", "bc"], seed=-3)
    assert params.validate("r") is params
    assert params.stop == ("a", "bc") and params.stop_token_ids == (5, 6)
    assert SamplingParams(stop="###").stop == ("###",) and SamplingParams(stop_token_ids=9).stop_token_ids == (9,)
    hash(params)  # frozen and hashable once lists are tuples
    SamplingParams().validate()


# -------------------------------------------------------------------------------------------------- stop
VOCAB = ["<eos>", "he", "llo", " wo", "rld", "!", "ST", "OP", "S", "TOP", "x", "<pad>"]
EOS = 0


def decode(ids):
    """Toy tokenizer: skips special tokens (<...>) like skip_special_tokens=True."""
    return "".join(VOCAB[i] for i in ids if not VOCAB[i].startswith("<"))


def test_stop_on_eos_unless_ignore_eos():
    ids = [1, 2, EOS]
    c = StopChecker(SamplingParams(max_tokens=10), eos_token_ids=[EOS], decode=decode)
    assert c.check(ids[:2]) == (None, None)
    assert c.check(ids) == ("stop", 5) and c.text == "hello" and c.stop_reason == EOS
    c = StopChecker(SamplingParams(max_tokens=10, ignore_eos=True), eos_token_ids=EOS, decode=decode)
    assert c.check(ids) == (None, None)
    assert c.check(ids + [1] * 7) == ("length", None) and c.num_tokens == 10
    c = StopChecker(SamplingParams(max_tokens=10), eos_token_ids=[EOS])  # no tokenizer: no text to trim
    assert c.check(ids) == ("stop", None)


def test_stop_token_ids_text_excludes_the_stop_token():
    c = StopChecker(SamplingParams(stop_token_ids=[5]), eos_token_ids=[EOS], decode=decode)
    reason, trim = c.check([1, 2, 3, 4, 5])
    assert reason == "stop" and c.stop_reason == 5
    assert decode([1, 2, 3, 4, 5])[:trim] == c.text == "hello world"


def test_stop_string_spanning_two_tokens():
    c = StopChecker(SamplingParams(stop=["STOP"], max_tokens=20), eos_token_ids=[EOS], decode=decode)
    ids = [1, 2, 6, 7, 5]
    assert c.check(ids[:3]) == (None, None)  # "helloST": not yet
    reason, trim = c.check(ids[:4])
    assert (reason, trim, c.text, c.stop_reason) == ("stop", 5, "hello", "STOP")
    assert decode(ids[:4])[:trim] == "hello"
    # several tokens at once (and a different split of the stop string): stops at the completing token
    c = StopChecker(SamplingParams(stop=["STOP", "zz"]), eos_token_ids=[EOS], decode=decode)
    assert c.check([3, 4, 8, 9, 5, 5]) == ("stop", 6) and c.num_tokens == 4 and c.text == " world"


def test_max_tokens_gives_length_and_stop_wins_on_the_same_token():
    c = StopChecker(SamplingParams(max_tokens=3), eos_token_ids=[EOS], decode=decode)
    assert c.check([1, 2]) == (None, None)
    assert c.check([1, 2, 3]) == ("length", None) and c.text == "hello wo"
    c = StopChecker(SamplingParams(max_tokens=2), eos_token_ids=[EOS], decode=decode)
    assert c.check([1, EOS])[0] == "stop"


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(RequestError, match="'stop'"):
        StopChecker(SamplingParams(stop=["x"]), eos_token_ids=[EOS], decode=None, request_id="r1")


def test_multibyte_text_is_held_back_until_complete():
    """Byte-level tokens: a UTF-8 character split across tokens decodes to U+FFFD until its last byte."""

    def byte_decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    text = "naïve café, stop: é!"
    ids = list(text.encode())
    c = StopChecker(SamplingParams(stop=["é!"], max_tokens=100), decode=byte_decode)
    for n in range(1, len(ids) + 1):
        reason, trim = c.check(ids[:n])
        assert "\ufffd" not in c.text, (n, c.text)
        if reason:
            break
    assert (reason, c.text) == ("stop", "naïve café, stop: ") and byte_decode(ids[:n])[:trim] == c.text


def test_stop_checker_matches_brute_force(seed):
    """Random ids and stop strings: incremental checks (one id or many at a time) equal decoding every prefix."""
    rng = np.random.default_rng(seed)
    alphabet = "abcd"
    vocab = ["<eos>"] + [alphabet[i % 4] * (1 + i // 4) for i in range(8)] + ["ab", "cd", "bca"]

    def dec(ids):
        return "".join(vocab[i] for i in ids if i != 0)

    for trial in range(200):
        ids = rng.integers(0, len(vocab), 30).tolist()
        stops = ["".join(rng.choice(list(alphabet), int(rng.integers(2, 6)))) for _ in range(int(rng.integers(0, 3)))]
        stop_ids = rng.integers(1, len(vocab), int(rng.integers(0, 2))).tolist()
        params = SamplingParams(stop=stops, stop_token_ids=stop_ids, max_tokens=int(rng.integers(1, 31)),
                                ignore_eos=bool(rng.random() < 0.3))
        expected = (None, None, len(ids))
        for j in range(1, len(ids) + 1):
            if ids[j - 1] in stop_ids or (ids[j - 1] == 0 and not params.ignore_eos):
                expected = ("stop", len(dec(ids[:j - 1])), j)
                break
            pos = [p for s in stops if (p := dec(ids[:j]).find(s)) >= 0]
            if pos:
                expected = ("stop", min(pos), j)
                break
            if j == params.max_tokens:
                expected = ("length", None, j)
                break
        msg = f"seed={seed} trial={trial} ids={ids} stops={stops} stop_ids={stop_ids} params={params}"
        one = StopChecker(params, eos_token_ids=[0], decode=dec)
        for j in range(1, len(ids) + 1):
            if one.check(ids[:j])[0]:
                break
        chunked = StopChecker(params, eos_token_ids=[0], decode=dec)
        cuts = sorted(rng.choice(np.arange(1, 31), 3, replace=False).tolist()) + [30]
        for cut in cuts:
            if chunked.check(ids[:cut])[0]:
                break
        for c in (one, chunked):
            got = (c.finish_reason, c._trim, c.num_tokens)
            assert got == expected, f"{msg}: got {got}, expected {expected}"
            if expected[0] == "stop":
                assert c.text == dec(ids[:expected[2]])[:expected[1]], msg


def test_final_text_agrees_with_a_full_decode_that_is_not_piecewise(seed):
    """A decode that cleans up spaces (" !" -> "!") differs piecewise; the finished text still equals
    decode(generated[:num_tokens])[:text_trim] and the output without its stop id."""
    rng = np.random.default_rng(seed)
    vocab = ["<eos>", "a", "b", " ", "!", " .", "ab"]

    def dec(ids):
        return "".join(vocab[i] for i in ids if i != 0).replace(" !", "!").replace(" .", ".")

    for trial in range(100):
        ids = rng.integers(0, len(vocab), 25).tolist()
        params = SamplingParams(stop=["b!"] if trial % 2 else [], stop_token_ids=[6], max_tokens=20)
        c = StopChecker(params, eos_token_ids=[0], decode=dec)
        for j in range(1, len(ids) + 1):
            reason, trim = c.check(ids[:j])
            if reason:
                break
        n = c.num_tokens
        msg = f"seed={seed} trial={trial} ids={ids[:n]} reason={reason} text={c.text!r}"
        assert reason is not None and n <= 20, msg
        if reason == "length":
            assert trim is None and c.text == dec(ids[:n]), msg
        else:
            assert dec(ids[:n])[:trim] == c.text, msg
            if isinstance(c.stop_reason, int):
                assert c.text == dec(ids[:n - 1]) and ids[n - 1] in (0, 6), msg
            else:
                assert "b!" not in c.text and "b!" in dec(ids[:n]), msg


def test_stop_checker_restarts_on_a_list_that_is_not_an_extension():
    c = StopChecker(SamplingParams(stop=["lo w"]), eos_token_ids=[EOS], decode=decode)
    assert c.check([10, 10, 1]) == (None, None)
    assert c.check([1, 2, 3]) == ("stop", 3) and c.text == "hel"
