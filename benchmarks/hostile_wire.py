"""Hostile clients at the coordinator's wire (benchmarks/hostile.py's kinds, second round): each is started by
hostile.py (``python benchmarks/hostile.py KIND ...``), which hands it the run and its arguments.

    smuggler     a worker credential sending every worker route with two Authorization headers (junk first, its
                 own credential last, and the reverse, and with the run secret's place taken by junk), for its own
                 id and for every other id it can guess (w0..w31), and the same routes for those ids with its
                 credential alone; GET /status with its credential (it must see only its own workers)
    ca_bomb      no credential: GET /ca (the one open route) declaring a 16 MiB body, and one with a chunked body,
                 streaming the body until answered
    ca_trickler  no credential, from another address (--source-address, 127.0.0.2: another host, as the server
                 sees it): --half-open connections at once, each trickling GET /ca's request line and headers a byte
                 every --trickle-s, re-opened as the server drops them
    churner      a worker credential registering and leaving in a loop, as fast as it is answered
    bulk_pusher  a worker credential sending --bulk pushes at once, each declaring the largest body the push route takes
                 (read off its 413) and trickled at 4 KiB/s, so that each is held as long as the coordinator lets it:
                 the credential's requests may hold at most its body budget (two of the largest) at once, the rest
                 refused unread (503)

Each ``serve(stop)`` runs until ``stop`` is set; ``report()`` says what it was told.
"""

from __future__ import annotations

import json
import re
import select
import socket
import ssl
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

BOMB_BYTES = 16 << 20  # the body ca_bomb declares (the one that took a coordinator from 477 to 914 MB)


def _status(call) -> str:
    try:
        call()
        return "200"
    except Exception as e:  # noqa: BLE001 (a network boundary: what happened is the result)
        return str(getattr(e, "status", type(e).__name__))


class _Raw:
    """Raw HTTP/1.1 over TLS to the coordinator, verifying nothing (an outsider), or pinned (an insider)."""

    def __init__(self, url: str, source: str | None = None, ca_file: str | None = None):
        host, port = url.split("://")[1].rsplit(":", 1)
        self.addr, self.https, self.source = (host, int(port)), url.startswith("https"), source
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if ca_file:
            self.tls.load_verify_locations(ca_file)
            self.tls.check_hostname, self.server_name = True, "learner.echo2.invalid"
        else:
            self.tls.check_hostname, self.tls.verify_mode, self.server_name = False, ssl.CERT_NONE, "x"

    def connect(self, timeout_s: float = 10.0, handshake: bool = True) -> socket.socket:
        sock = socket.create_connection(self.addr, timeout=timeout_s,
                                        source_address=(self.source, 0) if self.source else None)
        return self.tls.wrap_socket(sock, server_hostname=self.server_name) if self.https and handshake else sock

    def request(self, head: bytes, body: bytes = b"", timeout_s: float = 10.0) -> tuple[str, dict]:
        """Send ``head`` and ``body``; the answer's status and JSON (or what happened instead)."""
        sock = self.connect(timeout_s)
        try:
            sock.sendall(head + body)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return "closed", {}
                data += chunk
            head_in, _, rest = data.partition(b"\r\n\r\n")
            length = next((int(x.split(b":")[1]) for x in head_in.split(b"\r\n") if x.lower().startswith(
                b"content-length")), 0)
            while len(rest) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                rest += chunk
            try:
                reply = json.loads(rest or b"{}")
            except ValueError:
                reply = {"raw": rest[:200].decode(errors="replace")}
            return head_in.split(b" ", 2)[1].decode(), reply
        except OSError as e:
            return type(e).__name__, {}
        finally:
            sock.close()


class Smuggler:
    ROUTES = ("/register", "/heartbeat", "/pull", "/push", "/release", "/leave")

    def __init__(self, run, args):
        self.run, self.args = run, args
        self.raw = _Raw(run.url, ca_file=run.trust.ca_file)
        self.smuggled: dict[str, Counter] = defaultdict(Counter)  # route -> status of two-header requests
        self.alone: dict[str, Counter] = defaultdict(Counter)  # route -> status for another's id, one header
        self.status_seen: set[str] = set()  # worker ids GET /status showed it
        self.own: list[str] = []

    def _post(self, path: str, body: dict, *credentials: str) -> tuple[str, dict]:
        data = json.dumps(body).encode()
        auth = b"".join(b"Authorization: Bearer %s\r\n" % c.encode() for c in credentials)
        head = (b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % (path.encode(), auth, len(data)))
        return self.raw.request(head, data)

    def _body(self, path: str, wid: str) -> dict:
        return {"/register": {}, "/push": {"worker_id": wid, "results": []},
                "/release": {"worker_id": wid, "reason": "push_failed", "group_ids": ["g0"]}}.get(
                    path, {"worker_id": wid})

    def serve(self, stop) -> None:
        cred = self.run.token
        status, reply = self._post("/register", self.run.declared, cred)
        if status == "200":
            self.own.append(reply["worker_id"])
        turn = 0
        while not stop.is_set():  # one guessed id and route a turn, a few turns a second
            wid, path = f"w{turn // len(self.ROUTES) % 32}", self.ROUTES[turn % len(self.ROUTES)]
            turn += 1
            body = self._body(path, wid)
            for order in (("junk", cred), (cred, "junk"), (cred, cred)):
                self.smuggled[path][self._post(path, body, *order)[0]] += 1
            if wid not in self.own and path not in ("/register", "/leave"):
                self.alone[path][self._post(path, body, cred)[0]] += 1
            if turn % len(self.ROUTES) == 0:
                status, reply = self.raw.request(b"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                                                 b"\r\n" % cred.encode())
                if status == "200":
                    self.status_seen.update(reply.get("workers", []))
            stop.wait(self.args.period_s / 4)

    def report(self) -> dict:
        return {"smuggled": {k: dict(v) for k, v in self.smuggled.items()},
                "for_others_alone": {k: dict(v) for k, v in self.alone.items()},
                "own_ids": self.own, "status_showed": sorted(self.status_seen)}


class CaBomb:
    def __init__(self, run_dir: str, args):
        info = json.loads((Path(run_dir) / "coordinator.json").read_text())
        self.raw, self.args = _Raw(info["url"], source=args.source_address), args
        self.statuses: dict[str, Counter] = defaultdict(Counter)
        self.answer_s: list[float] = []
        self.sent_bytes = 0

    def serve(self, stop) -> None:
        while not stop.is_set():
            for kind, head in (("declared", b"GET /ca HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % BOMB_BYTES),
                               ("chunked", b"GET /ca HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")):
                self.statuses[kind][self._bomb(head, chunked=kind == "chunked")] += 1
            stop.wait(self.args.period_s)

    def _bomb(self, head: bytes, chunked: bool) -> str:
        t0, sent = time.monotonic(), 0
        try:
            sock = self.raw.connect()
        except OSError as e:
            return type(e).__name__
        try:
            sock.sendall(head)
            piece = b"[]," * (1 << 18)
            if chunked:
                piece = b"%x\r\n%s\r\n" % (len(piece), piece)
            sock.setblocking(False)
            while sent < BOMB_BYTES and time.monotonic() - t0 < 30:
                readable, writable, _ = select.select([sock], [sock], [], 1.0)
                if readable:
                    break  # answered (or closed) before the body was sent
                if writable:
                    try:
                        sent += sock.send(piece)
                    except (BlockingIOError, ssl.SSLWantWriteError):
                        continue
                    except OSError:
                        break
            sock.setblocking(True)
            sock.settimeout(5.0)
            data = sock.recv(4096)
            status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"
        except OSError as e:
            status = "closed" if isinstance(e, (ConnectionError, ssl.SSLError)) else type(e).__name__
        finally:
            sock.close()
        self.answer_s.append(time.monotonic() - t0)
        self.sent_bytes += sent
        return status

    def report(self) -> dict:
        return {"statuses": {k: dict(v) for k, v in self.statuses.items()}, "max_answer_s": max(self.answer_s, default=None),
                "body_bytes_sent": self.sent_bytes, "source_address": self.args.source_address}


class CaTrickler:
    """Holds ``--half-open`` connections trickling GET /ca, from one address; counts how many the server lets it
    hold at once and how long it keeps each."""

    def __init__(self, run_dir: str, args):
        info = json.loads((Path(run_dir) / "coordinator.json").read_text())
        self.raw, self.args = _Raw(info["url"], source=args.source_address), args
        self.request = b"GET /ca HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 4000 + b"\r\n\r\n"
        self.opened = self.refused = 0
        self.held_s: list[float] = []
        self.most_held = 0

    def serve(self, stop) -> None:
        open_: dict[socket.socket, list] = {}  # socket -> [opened at, bytes sent]
        while not stop.is_set():
            while len(open_) < self.args.half_open and not stop.is_set():
                try:
                    sock = self.raw.connect(timeout_s=5.0)
                    sock.setblocking(False)
                    open_[sock] = [time.monotonic(), 0]
                    self.opened += 1
                except OSError:
                    self.refused += 1
                    break
            time.sleep(min(self.args.trickle_s, 1.0))
            self.most_held = max(self.most_held, len(open_))
            for sock, state in list(open_.items()):
                gone = False
                try:
                    if select.select([sock], [], [], 0)[0]:  # an answer or a close: either way the server let go
                        gone = True
                    else:
                        sock.send(self.request[state[1]:state[1] + 1])
                        state[1] += 1
                except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    pass
                except OSError:
                    gone = True
                if gone:
                    self.held_s.append(time.monotonic() - state[0])
                    del open_[sock]
                    sock.close()
        for sock in open_:
            sock.close()

    def report(self) -> dict:
        held = sorted(self.held_s)
        return {"opened": self.opened, "refused_at_connect": self.refused, "most_held_at_once": self.most_held,
                "dropped": len(held), "held_s_max": held[-1] if held else None,
                "held_s_median": held[len(held) // 2] if held else None, "source_address": self.args.source_address}


class Churner:
    def __init__(self, run, args):
        self.run, self.args = run, args
        self.statuses: Counter = Counter()
        self.ids = 0

    def serve(self, stop) -> None:
        client = self.run.client(timeout_s=10)
        while not stop.is_set():
            def cycle():
                wid = client.post("/register", self.run.declared)["worker_id"]
                self.ids += 1
                client.post("/leave", {"worker_id": wid})

            status = _status(cycle)
            self.statuses[status] += 1
            if status != "200":
                stop.wait(0.2)

    def report(self) -> dict:
        return {"statuses": dict(self.statuses), "ids_registered": self.ids}


class BulkPusher:
    ROUND_S = 30.0  # each push is trickled this long at most, then let go
    RATE_BYTES_PER_S = 4096  # above the coordinator's minimum body rate (1 KiB/s), so only the budget stops it

    def __init__(self, run, args):
        self.run, self.args = run, args
        self.raw = _Raw(run.url, ca_file=run.trust.ca_file)
        self.statuses: Counter = Counter()
        self.admitted_per_round: list[int] = []  # pushes of a round not refused at once (held by the coordinator)
        self.limit: int | None = None

    def _head(self, size: int) -> bytes:
        return (b"POST /push HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (self.run.token.encode(), size))

    def _find_limit(self) -> int | None:
        """The push route's limit, as its refusal of a larger body states it."""
        status, reply = self.raw.request(self._head(1 << 40))
        found = re.search(r"the (\d+)-byte limit", str(reply.get("error", "")))
        return int(found.group(1)) if status == "413" and found else None

    def _push(self, out: list, stop) -> None:
        """One push of the largest body, trickled: (outcome, status, seconds): ("refused", its status) if answered
        before ROUND_S, else ("held", "0")."""
        t0, piece = time.monotonic(), b" " * (self.RATE_BYTES_PER_S // 4)
        try:
            sock = self.raw.connect()
        except OSError as e:
            out.append(("error", type(e).__name__, time.monotonic() - t0))
            return
        try:
            sock.sendall(self._head(self.limit))
            sock.settimeout(0.25)  # not select(): a TLS socket is readable for records that carry no answer
            while time.monotonic() - t0 < self.ROUND_S and not stop.is_set():
                try:
                    data = sock.recv(4096)
                except (TimeoutError, ssl.SSLWantReadError):
                    sock.sendall(piece)
                    continue
                out.append(("refused", data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ")
                            else "closed", time.monotonic() - t0))
                return
            out.append(("held", "0", time.monotonic() - t0))
        except OSError as e:
            out.append(("error", type(e).__name__, time.monotonic() - t0))
        finally:
            sock.close()

    def serve(self, stop) -> None:
        self.limit = self._find_limit()
        if self.limit is None:
            raise RuntimeError("the push route's limit could not be read off a 413")
        while not stop.is_set():
            out: list = []
            threads = [threading.Thread(target=self._push, args=(out, stop), daemon=True) for _ in range(self.args.bulk)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for kind, status, _ in out:
                self.statuses[f"{kind} {status}"] += 1
            # admitted: its body was being read (held to the end, or answered after a second of it)
            self.admitted_per_round.append(sum(1 for kind, status, s in out if kind == "held" or (
                kind != "error" and status != "503" and s >= 1.0)))
            stop.wait(self.args.period_s)

    def report(self) -> dict:
        return {"push_limit_bytes": self.limit, "statuses": dict(self.statuses),
                "admitted_per_round": self.admitted_per_round}
