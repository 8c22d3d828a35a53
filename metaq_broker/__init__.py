"""metaq: a MetaQ-style message broker (storage, gRPC service, client, tools)."""

__version__ = "0.1.0"
