"""The rollout checks' verdicts, applied: the learner's scores of a batch judged per credential (trust.py), and a
credential found cheating retired whole. Runs while the caller (Coordinator.check) holds the coordinator's lock.

    learner: {worker id: (tokens, Σ log-ratio, Σ |log-ratio|)} ──► per credential ──► trust.Checks.update
        ├─ flagged: logged
        ├─ retire: credential revoked (in effect even when revoked.txt cannot be written: gate.revoke(verdict=True)),
        │          its buffered groups dropped (untrusted, prompts re-queued), every id retired, the relay re-keyed
        └─ reject: its groups in the judged batch booked as dropped (untrusted); the learner does not train on them
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

log = logging.getLogger(__name__)


def judge(coord: Any, stats: dict[str, tuple]) -> list[str]:
    """Apply the checks' verdict on the last batch taken; returns the worker ids not to train on."""
    reg, checks = coord.reg, coord.checks
    per: dict[str, list] = {}
    for wid, (n, total, *rest) in stats.items():
        acc = per.setdefault(reg.owner(wid) or f"#{wid}", [0, 0.0, 0.0])
        acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + total, acc[2] + (rest[0] if rest else abs(total))
    verdict = checks.update({k: tuple(v) for k, v in per.items()})
    for key in verdict.flagged:
        log.warning("worker %s flagged: mean |log-ratio| %.2f against the learner's logprobs (credential %s)",
                    ",".join(sorted(_ids(coord, key))) or key, checks.mean_abs(key), key)
    for key in verdict.retire:
        distrust(coord, key)
    bad = {wid for wid in stats if (reg.owner(wid) or f"#{wid}") in set(verdict.reject)}
    judged = [(gid, row) for gid, wid, row in coord.last_taken if wid in bad]
    coord.ledger.distrusted([gid for gid, _ in judged], [row for _, row in judged], "untrusted")
    coord.last_taken = []  # judged once
    return sorted(bad)


def _ids(coord: Any, key: str) -> set[str]:
    principal = coord.reg.principals.get(key)
    return set(principal.ids) if principal is not None else set()


def drop_buffered(coord: Any, key: str, reason: str) -> None:
    """Drop the groups of principal ``key`` waiting in the buffer (booked as dropped with ``reason``, their prompts
    re-queued): a credential found cheating or revoked is not trained on, whatever it pushed before."""
    keep = deque()
    for x, group in coord.buffer.groups:
        if coord.reg.owner(group.worker_id) == key:
            coord.ledger.drop(group.group_id, reason, requeue=True)
        else:
            keep.append((x, group))
    coord.buffer.groups = keep


def distrust(coord: Any, key: str) -> None:
    """Retire a principal as untrusted: revoke its credential, drop its buffered groups, retire its ids."""
    principal = coord.reg.principals.get(key)
    ids = _ids(coord, key)
    if principal is not None and principal.name is not None:
        # else it would come back under a new id; in effect even if the disk is full (then logged and counted)
        coord.gate.revoke(principal.name, verdict=True)
    drop_buffered(coord, key, "untrusted")
    for wid in sorted(ids):
        coord._retire(wid, "untrusted")
        log.warning("worker %s retired as untrusted (credential %s: mean |log-ratio| %.2f over %d tokens)", wid, key,
                    coord.checks.mean_abs(key), coord.checks.tokens.get(key, 0))
    if coord.broadcaster is not None and principal is not None and principal.name is not None:
        coord.broadcaster.rekey()  # its credential was revoked: off the relay too
