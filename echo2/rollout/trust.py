"""Checking what workers return against the policy they claim: the learner's logprobs of their tokens.

A worker reports, with every token, the logprob its weights (version x) gave it. The learner, at version t,
scores the same tokens; for an honest worker the per-token log-ratio ``log π_t − log π_x`` is small and centred
just below 0 (its mean is −KL(π_x ‖ π_t), which grows with the lag t − x and the learning rate), while invented
logprobs or tokens the policy would not sample sit far out (a random token claimed at −0.05 scores about
−log |V| under the policy). Per worker the mean log-ratio over many tokens separates the two.

Pure numbers: the learner sends per-worker sums (every ``check_every_steps`` steps), ``Checks.update`` says
who is flagged (warned, counted) and who is retired (its buffered rollouts dropped as ``untrusted``, its
credential revoked). Not done here: a per-lag calibration of the threshold (one bound for every lag).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Checks:
    max_abs_log_ratio: float = 1.0  # |mean per-token log-ratio| above this is implausible, in nats
    min_tokens: int = 256  # tokens scored before a worker can be retired (a quarter of them: flagged)
    tokens: dict = field(default_factory=dict)  # worker -> tokens scored
    sums: dict = field(default_factory=dict)  # worker -> sum of per-token log-ratios
    flagged: set = field(default_factory=set)

    def update(self, stats: dict[str, tuple[int, float]]) -> tuple[list[str], list[str]]:
        """Add ``{worker: (tokens, sum of log-ratios)}``; returns (newly flagged, to retire)."""
        newly, retire = [], []
        for worker, (n, total) in stats.items():
            self.tokens[worker] = self.tokens.get(worker, 0) + int(n)
            self.sums[worker] = self.sums.get(worker, 0.0) + float(total)
            n_all = self.tokens[worker]
            implausible = abs(self.sums[worker] / max(n_all, 1)) > self.max_abs_log_ratio
            if implausible and n_all >= self.min_tokens:
                retire.append(worker)
            elif implausible and n_all >= self.min_tokens / 4 and worker not in self.flagged:
                self.flagged.add(worker)
                newly.append(worker)
        return newly, retire

    def mean(self, worker: str) -> float:
        return self.sums.get(worker, 0.0) / max(self.tokens.get(worker, 0), 1)
