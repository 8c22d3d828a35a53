"""The calling side of a SASL login over gRPC (``metaq.v1.Auth/Authenticate``, JSON messages; docs/security.md):
PLAIN in one round, SCRAM-SHA-256 in two. Clients and a group member logging in to its master both use it.
The SCRAM arithmetic is ``security/scram.py``'s, which this layer may not import (siblings): SCRAM callers
pass ``scram.ScramClient`` as ``new_scram``."""
from __future__ import annotations

import json
import time
from typing import Callable, Optional

import grpc

from metaq_broker.protocol.status import to_error

BUSY_ATTEMPTS = 20  # the broker refuses logins as "busy" while it checks others' (server/auth.py)


def authenticate(call: Callable, mechanism: str, username: str, password: str, timeout: float, address: str,
                 new_scram: Optional[Callable] = None) -> tuple:
    """(session token, lifetime in seconds) after a login through ``call`` (the channel's
    ``unary_unary(AUTH_PATH)``); a refusal raises the matching metaq error (``RemoteAuthenticationError``
    for a wrong password), a "busy" broker is asked again with a growing pause."""
    def step(message: str, **more) -> dict:
        request = json.dumps({"mechanism": mechanism, "message": message, **more}).encode()
        for attempt in range(BUSY_ATTEMPTS):
            try:
                return json.loads(call(request, timeout=timeout, wait_for_ready=True))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAUTHENTICATED or "busy" not in (e.details() or "") \
                        or attempt == BUSY_ATTEMPTS - 1:
                    raise to_error(e, address) from None
            time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    if mechanism == "PLAIN":
        done = step(f"\0{username}\0{password}")
    else:
        client = new_scram(username, password)
        first = step(client.first())
        done = step(client.final(first["message"]), handshake=first["handshake"])
        client.verify(done["message"])
    return done["session"], float(done["lifetime_s"])
