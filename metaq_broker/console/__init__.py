"""The read-only web console (``metaq console``): brokers, topics, consumer groups, transactions and a
message browser, served over HTTP from what the client library and ZooKeeper report. A layer above the
client and zk layers; brokers cannot import it."""
