"""Checking what workers return against the policy they claim: the learner's logprobs of their tokens.

A worker reports, with every token, the logprob its weights (version x) gave it. The learner scores the same
tokens under version x too (it keeps the weights of the last S versions for this: echo2/learner/past_policies.py),
so for an honest worker the per-token log-ratio δ is numerics only (0 between two transformers models, the
engines' rounding otherwise), whatever the lag and the learning rate; invented logprobs or tokens the policy
would not sample sit far out (a random token claimed at −0.05 scores about −log |V| under the policy). Under
ZeRO-3 no past weights are kept, and lagged tokens are scored with the current ones: δ then also carries what the
learner learnt since x (its mean is −KL(π_x ‖ π_t), growing with the lag and the learning rate).
The statistic is the per-token *absolute* log-ratio |δ|: a mean of signed ratios lets errors of ±4 nats in
turn cancel out, the absolute values do not (and |mean δ| ≤ mean |δ|, so it catches all the mean did).

**The test** is Page's CUSUM over each principal's (credential's, registry.py) checked batches: with n tokens
and Σ|δ| in a batch, its evidence ``e ← max(0, e + Σ|δ| − b·n)``, b = ``max_abs_log_ratio`` (nats per token):
tokens an honest worker sends pull e down to 0, tokens beyond b on average push it up by their excess. At
``evidence_nats`` (E) the principal is retired (its credential revoked, all it holds dropped as
``untrusted``), at E/4 flagged (a warning). Why this and not a token count: a short-answer task gives few
tokens per check (2-3 per completion on the demo task), and the evidence a forgery needs scales with how far
out it is, not with a fixed count: a fabricated answer whose logprobs are off by 3 nats a token needs
E/(3−b) tokens, one group; and the reset at 0 means honest history banks no credit for cheating later.
Honest tokens never reach E while b is above the engines' numerics (b = 2 leaves room for a half-precision
engine's rounding); scored with the current weights instead (ZeRO-3), they would once the policy moved more than
b nats a token within the lag S: on the tiny model at learning rate 3e-3 lag-2 tokens did, in a few steps.

**A batch found bad is not trained on**: every principal whose batch alone averages more than b per token,
or who is retired by this batch, has its groups in it dropped (``untrusted``) and masked by the learner.

Pure numbers: the learner sends per-worker sums (every ``check_every_steps`` steps); the coordinator adds
them up per principal and applies the verdict.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from echo2.settings import CheckSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    flagged: list  # principals newly flagged (a warning)
    retire: list  # principals to retire now
    reject: list  # principals whose groups in this batch are not trained on (retired ones included)


@dataclass
class Checks:
    settings: CheckSettings = field(default_factory=CheckSettings)  # b and E
    tokens: dict = field(default_factory=dict)  # principal -> tokens scored
    sums: dict = field(default_factory=dict)  # principal -> Σ δ (signed: the mean shows drift in metrics)
    abs_sums: dict = field(default_factory=dict)  # principal -> Σ |δ|
    evidence: dict = field(default_factory=dict)  # principal -> the CUSUM e
    flagged: set = field(default_factory=set)

    def update(self, stats: dict[str, tuple[int, float, float]]) -> Verdict:
        """Add one checked batch, ``{principal: (tokens, Σ δ, Σ |δ|)}``."""
        flagged, retire, reject = [], [], []
        for who, (n, total, total_abs) in stats.items():
            n, total, total_abs = int(n), float(total), float(total_abs)
            if not (math.isfinite(total) and math.isfinite(total_abs)):
                # unscorable: not trained on, and its evidence kept (max(0.0, e + NaN) is 0.0: it would be wiped)
                log.warning("rollout checks: non-finite scores for %s (%s, %s): its groups in this batch are not "
                            "trained on; its evidence is kept", who, total, total_abs)
                reject.append(who)
                continue
            self.tokens[who] = self.tokens.get(who, 0) + n
            self.sums[who] = self.sums.get(who, 0.0) + total
            self.abs_sums[who] = self.abs_sums.get(who, 0.0) + total_abs
            excess = total_abs - self.settings.max_abs_log_ratio * n
            e = self.evidence[who] = max(0.0, self.evidence.get(who, 0.0) + excess)
            if e >= self.settings.evidence_nats:
                retire.append(who)
            elif e >= self.settings.evidence_nats / 4 and who not in self.flagged:
                self.flagged.add(who)
                flagged.append(who)
            if excess > 0 or e >= self.settings.evidence_nats:
                reject.append(who)
        return Verdict(flagged, retire, reject)

    def mean(self, who: str) -> float:
        """Mean signed log-ratio so far (honest: slightly below 0)."""
        return self.sums.get(who, 0.0) / max(self.tokens.get(who, 0), 1)

    def mean_abs(self, who: str) -> float:
        """Mean |log-ratio| so far: the statistic the test bounds by ``max_abs_log_ratio``."""
        return self.abs_sums.get(who, 0.0) / max(self.tokens.get(who, 0), 1)
