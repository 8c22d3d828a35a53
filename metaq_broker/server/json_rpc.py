"""The broker's gRPC methods whose messages are JSON (``protocol.services``), served alike: the caller's
principal first (``BrokerAuth``: authentication fails here), then the request parsed and handed to the
method; a metaq error becomes its status (``code_of``), bad input INVALID_ARGUMENT, ZooKeeper away
UNAVAILABLE (nothing was done: clients try another broker)."""
from __future__ import annotations

import json
from typing import Callable

import grpc
from kazoo.exceptions import KazooException

from metaq_broker.errors import MetaqError
from metaq_broker.protocol.status import code_of


def json_method(auth, method: Callable[[str, dict], dict], what: str) -> grpc.RpcMethodHandler:
    """A unary handler calling ``method(principal, request)`` and answering its dict; ``what`` names the
    service in errors."""
    def serve(request: bytes, context) -> bytes:
        try:
            principal = auth.grpc_principal(context)
            m = json.loads(request or b"{}")
            if not isinstance(m, dict):
                raise ValueError("expected a JSON object")
            return json.dumps(method(principal, m)).encode()
        except MetaqError as e:
            context.abort(code_of(e), str(e))
        except (ValueError, TypeError, KeyError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {type(e).__name__}: {e}")
        except KazooException as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"ZooKeeper did not answer: {type(e).__name__}")
    return grpc.unary_unary_rpc_method_handler(serve)


def connected(zk: Callable):
    """The broker's ZooKeeper client now; KazooException (UNAVAILABLE) while ZooKeeper is away."""
    client = zk()
    if client is None:
        raise KazooException("no ZooKeeper session")
    return client
