"""Per-worker credentials: make one for a named worker, or revoke one during a run.

    export ECHO2_TOKEN=<the run secret>                  # on the learner's machine only
    python -m echo2.credential box17                     # prints box17's credential: give it to that worker
    python -m echo2.credential --revoke box17 --coordinator https://LEARNER:PORT --ca-file RUN_DIR/tls/ca.pem

A credential is ``name:HMAC-SHA256(run secret, name)`` (worker_credential below): the coordinator
recognises it without a table, a worker never holds the run secret, and revoking one name (``POST /revoke``,
run secret only) refuses that worker's requests from then on and re-queues its in-flight work (``lost:
revoked``), while every other worker carries on. Revocations are kept in ``<run dir>/revoked.txt``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import math
import os
import re
import string
import sys
import zlib

from echo2.net.http import Client

from echo2.net.tls import LEARNER_NAME



WORKER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MIN_SECRET_BITS = 128
"""The least a run secret must carry on a run strangers can reach. Every credential is HMAC(secret, name) and every
worker holds one, so a worker can test guesses of the secret offline, as fast as it can compute HMACs, with no
server to slow it down; whoever finds it is the learner (it signs snapshots and revokes credentials). 128 bits is
out of reach; ``secrets.token_urlsafe(24)`` (192) or ``token_hex(16)`` (128) clear it."""
_CLASSES = ((string.ascii_lowercase, 26), (string.ascii_uppercase, 26), (string.digits, 10))


def secret_bits(secret: str) -> float:
    """At most how many bits of entropy ``secret`` can hold: the lesser of its length x log2(the alphabets it draws
    from: lower case 26, upper case 26, digits 10, anything else 33) and 8 x its size compressed (less zlib's own
    ~8 bytes), which a repeated pattern does not survive. An upper bound: a random string scores about what it holds,
    a short, narrow or repetitive one far less; a passphrase of dictionary words scores more than it holds (only a
    generator is sure: secrets.token_urlsafe(24))."""
    if not secret:
        return 0.0
    alphabet = sum(size for chars, size in _CLASSES if any(c in chars for c in secret))
    alphabet += 33 if any(not any(c in chars for chars, _ in _CLASSES) for c in secret) else 0
    compressed = 8 * max(0, len(zlib.compress(secret.encode(), 9)) - 8)
    return min(len(secret) * math.log2(alphabet), float(compressed))


def check_run_secret(secret: str, exposed: bool) -> None:
    """Refuse a run secret weaker than MIN_SECRET_BITS on a run strangers can reach (``exposed``: the coordinator
    listens off loopback); a loopback run's secret never leaves the machine."""
    bits = secret_bits(secret)
    if exposed and bits < MIN_SECRET_BITS:
        raise ValueError(f"the run secret ($ECHO2_TOKEN) holds at most ~{bits:.0f} bits; a coordinator others can "
                         f"reach needs >= {MIN_SECRET_BITS} (every worker's credential lets it guess the secret "
                         "offline). Make one with: export ECHO2_TOKEN=$(python -c 'import secrets; "
                         "print(secrets.token_urlsafe(24))'), or unset it to have the learner generate one")


def worker_credential(run_secret: str, name: str) -> str:
    """Worker ``name``'s own credential, ``name:HMAC-SHA256(run secret, name)``: the learner recognises it without
    a table, and revoking one name leaves every other worker's credential valid."""
    if not WORKER_NAME.fullmatch(name):
        raise ValueError(f"worker name {name!r}: 1-64 of A-Z a-z 0-9 _ . -")
    mac = hmac.new(run_secret.encode(), b"echo2-worker:" + name.encode(), hashlib.sha256).hexdigest()
    return f"{name}:{mac}"


def credential_name(run_secret: str, credential: str) -> str | None:
    """The worker name a valid worker credential carries; None if it is not one."""
    name, sep, _ = credential.partition(":")
    if not sep or not WORKER_NAME.fullmatch(name):
        return None
    return name if hmac.compare_digest(credential.encode(), worker_credential(run_secret, name).encode()) else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m echo2.credential", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help="the worker's name (1-64 of A-Z a-z 0-9 _ . -)")
    p.add_argument("--revoke", action="store_true", help="revoke this worker's credential in the running coordinator")
    p.add_argument("--coordinator", help="the coordinator's URL (with --revoke)")
    p.add_argument("--ca-file", help="the run's CA, <run dir>/tls/ca.pem (with --revoke over https)")
    args = p.parse_args(argv)
    secret = os.environ.get("ECHO2_TOKEN")
    if not secret:
        p.error("set $ECHO2_TOKEN to the run secret (the learner's)")
    try:
        credential = worker_credential(secret, args.name)
    except ValueError as e:
        p.error(str(e))
    if not args.revoke:
        print(credential)
        return
    if not args.coordinator:
        p.error("--revoke needs --coordinator")
    client = Client(args.coordinator, secret, timeout_s=30, ca_file=args.ca_file, server_name=LEARNER_NAME)
    print(json.dumps(client.post("/revoke", {"name": args.name})))


if __name__ == "__main__":
    sys.exit(main())
