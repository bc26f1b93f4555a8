"""``notify.webhook``: one JSON POST per event (failed, restarted, succeeded); never fails the job.

The URL may hold ``${NAME}`` parts, filled from the job's secrets (its ``launch.env_file``, or a
secret-named ``launch.env`` value): a Slack or Teams hook's token stays out of the job file,
the job record, the plan and the logs, as every other secret does. Only the controller's
supervisor posts; the nodes never see the URL.

A receiver that is down, slow or answers an error costs at most ``notify.timeout_s`` and one
line in the supervision record: the job goes on (or ends) exactly as without it. One attempt
per event, no retries: a restart must not wait on a chat service.
"""

from __future__ import annotations

import json
import time
import urllib.error
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
    """POST ``body`` as JSON; returns the outcome (``ok``, ``status`` or ``error``), never raises."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", "User-Agent": "dzctl"}
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            status = answer.status
        outcome = {"ok": 200 <= status < 300, "status": status}
    except urllib.error.HTTPError as exc:
        outcome = {"ok": False, "status": exc.code}
    except Exception as exc:  # down, refused, DNS, TLS, timeout: recorded, never raised
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {_without(str(exc), url)}"}
    outcome["seconds"] = round(time.monotonic() - started, 3)
    return outcome


def _without(text: str, url: str) -> str:
    # urllib's messages may quote the URL, and with it a filled-in secret.
    return text.replace(url, "<webhook>")
