"""The metaq client library: ``Producer``, ``Consumer`` and ``Admin`` (gRPC to brokers, the data port for
bulk fetches, ZooKeeper for discovery and consumer groups)::

    from metaq_broker.client import Producer, Consumer, Admin
"""
from metaq_broker.client.admin import Admin
from metaq_broker.client.consumer import Consumer
from metaq_broker.client.producer import Producer

__all__ = ["Admin", "Consumer", "Producer"]
