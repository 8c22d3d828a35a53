"""The metaq client library: Producer, Consumer and Admin (gRPC to brokers, ZooKeeper for discovery
and consumer groups)."""
