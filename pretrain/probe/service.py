"""Where a learned task goes: the artifact's ``tasks/`` and/or a running service.

The service client is the standard library's ``urllib`` (no HTTP package needed
on a plain install). If the PUT fails, the learned mix is not lost: it is
written to a fallback file and the error says where.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from elmo_service.artifact import write_task
from elmo_service.errors import InputError
from elmo_service.scalar_mix import MixSpec


def _request(
    method: str, url: str, admin_key: str | None, body: Any = None, timeout: float = 10
) -> None:
    """One request; raises urllib's HTTPError for a non-2xx answer, URLError/OSError if none."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def _service_error(service: str, e: Exception) -> str:
    if isinstance(e, urllib.error.HTTPError):
        text = e.read().decode("utf-8", "replace")
        try:
            detail = json.loads(text).get("message", text)
        except (ValueError, AttributeError):
            detail = text
        return f"{service} answered {e.code}: {detail}"
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    return f"{service} is not reachable: {reason}"


def check_service(service: str, admin_key: str | None) -> None:
    """Before any work: the service answers and knows the key (InputError naming --service)."""
    try:
        _request("GET", f"{service.rstrip('/')}/v1/tasks", admin_key)
    except (OSError, ValueError) as e:  # URLError/HTTPError are OSErrors; ValueError: bad URL
        raise InputError(_service_error(service, e), field="service") from None


def save_task(
    spec: MixSpec,
    name: str,
    model_dir: Path | None = None,
    service: str | None = None,
    admin_key: str | None = None,
    fallback: Path | None = None,
) -> list[str]:
    """Store the mix with the artifact and/or PUT it to a running service."""
    done = []
    if model_dir is not None:
        done.append(str(write_task(model_dir, name, spec)))
    if service:
        url = f"{service.rstrip('/')}/v1/tasks/{name}"
        try:
            _request("PUT", url, admin_key, body=spec.to_dict(), timeout=30)
        except (OSError, ValueError) as e:
            msg = _service_error(service, e)
            if fallback is not None:
                fallback.parent.mkdir(parents=True, exist_ok=True)
                fallback.write_text(json.dumps(spec.to_dict(), indent=2, sort_keys=True) + "\n")
                msg += f"; the learned task is saved in {fallback} (PUT it to {url} later)"
            raise InputError(msg, field="service") from None
        done.append(url)
    return done
