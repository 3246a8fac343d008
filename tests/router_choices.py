"""The routers' choices in a model's step, to tell a choice moved at a near tie from a wrong result where two paths
of the same step round differently (a random bf16 model has near-tied router scores at some seeds)."""

from __future__ import annotations

import numpy as np


def spy_router_choices(monkeypatch) -> list:
    """Wraps `dayzero.model.moe.Router.__call__`; each call, in layer order, appends (chosen, scores): per token row
    the set of routed experts chosen (the shared MLP's parts left out), and the scores [N, E] float64 the choice
    ranks (the router's activation of the logits, plus the correction bias where the router has one)."""
    from dayzero.model import moe

    calls = []
    routed = moe.Router.__call__

    def spy(self, x, shared_parts=0, logits=None, chosen=None, schedule_rows=0):
        out = routed(self, x, shared_parts, logits, chosen, schedule_rows)
        cfg, params = self.config, self.variables["params"]
        if logits is None:
            logits = np.asarray(x, np.float64) @ np.asarray(params["weight"], np.float64).T
        logits = np.asarray(logits, np.float64)
        if cfg.router_activation == "sigmoid":
            scores = 1.0 / (1.0 + np.exp(-logits))
        else:
            exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
            scores = exp / exp.sum(axis=-1, keepdims=True)
        if "e_score_correction_bias" in params:
            scores = scores + np.asarray(params["e_score_correction_bias"], np.float64)
        chosen_sets = [{int(e) for e in row if e < cfg.num_experts} for row in np.asarray(out[0])[:x.shape[0]]]
        assert all(len(s) == cfg.num_experts_per_token for s in chosen_sets), chosen_sets
        calls.append((chosen_sets, scores))
        return out

    monkeypatch.setattr(moe.Router, "__call__", spy)
    return calls


def taken(calls: list) -> list:
    """The choices `spy_router_choices` recorded so far, its list emptied for the next run."""
    out = list(calls)
    calls.clear()
    return out


def rows_that_held(plain: list, given: list, top_k: int, tie: float = 1e-3) -> np.ndarray:
    """bool [N]: the token rows whose every routed choice is the same in two runs of a step (`spy_router_choices`'
    lists). A row's first moved choice must have been a near tie in the first run (asserted: every expert chosen
    instead scores within `tie` of the k-th best); after it the row's later layers see other inputs, so only the rows
    that held are comparable."""
    assert len(plain) == len(given) and plain, (len(plain), len(given))
    held = np.ones(len(plain[0][0]), bool)
    for (want_sets, scores), (got_sets, _) in zip(plain, given):
        for row, (want, got) in enumerate(zip(want_sets, got_sets)):
            if held[row] and want != got:
                kth = np.sort(scores[row])[::-1][top_k - 1]
                assert all(scores[row, e] >= kth - tie for e in got - want), (
                    row, want, got, np.sort(scores[row])[::-1][:top_k + 2])
                held[row] = False
    return held
