"""``notify.webhook``: one JSON POST per event (failed, restarted, succeeded); never fails the job.

The URL may hold ``${NAME}`` parts, filled from the job's secrets (its ``launch.env_file``, or a
secret-named ``launch.env`` value): a Slack or Teams hook's token stays out of the job file,
the job record, the plan and the logs, as every other secret does. Only the controller's
supervisor posts; the nodes never see the URL.

A receiver that is down, slow or answers an error costs at most ``notify.timeout_s`` (plus the
moment it takes to close the socket) and one line in the supervision record: the job goes on (or
ends) exactly as without it. One attempt per event, no retries: a restart must not wait on a chat
service. ``timeout_s`` bounds the whole POST, not each read: urllib's own timeout is per socket
operation, so a receiver that drips its answer a line at a time would hold it for as long as it drips.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from ...errors import SpecError
from ...spec.recovery import URL_SECRET, NotifySpec

PAYLOAD_VERSION = 1


def webhook_url(spec: NotifySpec, secrets: dict[str, str], where: str) -> str:
    """The URL with its ``${NAME}`` parts filled; a name the job's secrets lack is bad input (exit 2)."""
    missing = [name for name in URL_SECRET.findall(spec.webhook) if name not in secrets]
    if missing:
        raise SpecError(
            f"{where}: notify.webhook names ${{{missing[0]}}}, which is not among the job's secrets",
            fix=f"add {missing[0]}=VALUE to the file launch.env_file names (or a secret-named launch.env entry)",
        )
    return URL_SECRET.sub(lambda m: secrets[m.group(1)], spec.webhook)


def payload(event: str, *, job: str, job_id: str, state: str, first_failure: dict | None, **extra) -> dict:
    """What the receiver gets: the job, its state, the first failure, and the event's own facts."""
    return {
        "version": PAYLOAD_VERSION,
        "event": event,
        "job": job,
        "job_id": job_id,
        "state": state,
        "first_failure": first_failure,
        "time": time.time(),
        **extra,
    }


def post(url: str, body: dict, timeout_s: float) -> dict:
    """POST ``body`` as JSON within ``timeout_s`` in all; returns the outcome (``ok``, ``status`` or ``error``).

    Never raises. The POST runs in a daemon thread that the caller waits for at most ``timeout_s``:
    past it, the connection's socket is shut down, which ends a read in progress at once, and the
    outcome says the receiver did not answer in time. (A name lookup that hangs cannot be
    interrupted: its thread is left to end on its own, the caller does not wait for it.)
    """
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", "User-Agent": "dzctl"}
    )
    connections: list[http.client.HTTPConnection] = []
    answered: dict = {}  # the sender's outcome, filled by its thread
    started = time.monotonic()

    def send() -> None:
        try:
            with _opener(connections).open(request, timeout=timeout_s) as answer:
                status = answer.status
            answered.update(ok=200 <= status < 300, status=status)
        except urllib.error.HTTPError as exc:
            answered.update(ok=False, status=exc.code)
        except Exception as exc:  # down, refused, DNS, TLS, timeout: recorded, never raised
            answered.update(ok=False, error=f"{type(exc).__name__}: {exc}")

    sender = threading.Thread(target=send, name="dzctl-notify", daemon=True)
    sender.start()
    sender.join(timeout_s)
    outcome = dict(answered)
    if sender.is_alive():
        for connection in connections:
            _shut(connection)
        sender.join(0.5)  # the shut socket ends the read now: its thread is gone, not left to drip
        outcome = {
            "ok": False,
            "error": f"TimeoutError: timed out: no whole answer within notify.timeout_s ({timeout_s:g} s)",
        }
    if "error" in outcome:
        outcome["error"] = redact(str(outcome["error"]), url)
    outcome["seconds"] = round(time.monotonic() - started, 3)
    return outcome


def _opener(connections: list) -> urllib.request.OpenerDirector:
    """urllib's opener (proxies from the environment included), keeping each connection it opens."""

    def keeping(connection_class):
        def make(*args, **kwargs):
            connection = connection_class(*args, **kwargs)
            connections.append(connection)
            return connection

        return make

    class Keeping(urllib.request.AbstractHTTPHandler):
        def do_open(self, http_class, req, **kwargs):
            return super().do_open(keeping(http_class), req, **kwargs)

    class Http(Keeping, urllib.request.HTTPHandler):
        pass

    class Https(Keeping, urllib.request.HTTPSHandler):
        pass

    return urllib.request.build_opener(Http, Https)


def _shut(connection: http.client.HTTPConnection) -> None:
    sock = connection.sock
    if sock is not None:
        # socket.socket's own shutdown, also for a TLS socket: it wakes the thread blocked in recv.
        with contextlib.suppress(OSError):  # already closed
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


def redact(text: str, url: str) -> str:
    """``text`` without the URL or any part of it that may hold a secret, in any form a message quotes.

    urllib's messages quote the whole URL, or only its path and query (``InvalidURL``: "URL can't
    contain control characters. '/services/abc def'"), as written, as Python's repr escapes it
    (a tab as ``\\t``) or percent-encoded; a secret filled into any of them must not reach the
    supervision record, the log or ``status --json``.
    """
    parts = _split(url)
    secret_parts = {url, *parts}
    forms = set()
    for part in secret_parts:
        if len(part.strip("/")) < 2:
            continue  # "/" or empty: nothing secret, and replacing it would garble the message
        forms |= {part, repr(part)[1:-1], urllib.parse.quote(part, safe="/"), urllib.parse.unquote(part)}
    for form in sorted(forms, key=len, reverse=True):  # the whole URL first, then its parts
        if form:
            text = text.replace(form, "<webhook>")
    return text


def _split(url: str) -> tuple[str, ...]:
    """The URL's user info, path+query (what urllib sends and quotes), path, query and fragment, as written.

    Not ``urllib.parse.urlsplit``: it drops tabs and newlines, so its parts would not be found in a
    message that quotes them.
    """
    scheme_end = url.find("://")
    rest = url[scheme_end + 3 :] if scheme_end >= 0 else url
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, target = rest[:cut], rest[cut:]
    userinfo = netloc.rpartition("@")[0]  # the host itself is no secret: messages may name it
    selector, _, fragment = target.partition("#")
    path, _, query = selector.partition("?")
    return (userinfo, *userinfo.split(":", 1), selector, path, query, fragment)
