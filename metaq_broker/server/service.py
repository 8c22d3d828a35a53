"""The gRPC service, a thin layer over the broker's request handler (``handler.py``): each method turns its
protobuf request into the handler's typed request, calls the handler with the caller's principal
(``BrokerAuth.grpc_principal``: authentication fails there) and turns the typed result into its protobuf
reply. A failure is the handler's ``refusal``, answered with its status code (``protocol/status.py``) and
message. ``FetchRaw`` and ``PutRaw`` keep record bytes out of protobuf: fetched batches and put bodies pass
through untouched, so the broker does no per-message work."""
from __future__ import annotations

import functools
import json
import time

import grpc

from metaq_broker.errors import MetaqError
from metaq_broker.proto import metaq_pb2 as pb
from metaq_broker.proto import metaq_pb2_grpc as pb_grpc
from metaq_broker.protocol import lookup as lookup_protocol
from metaq_broker.protocol import rawfetch, rawput, records
from metaq_broker.protocol.services import AUTH_SERVICE, AUTHENTICATE
from metaq_broker.protocol.status import code_of
from metaq_broker.server.handler import FetchRequest, OffsetQuery, RequestHandler


def abort(context, error: MetaqError) -> None:
    """End the call with ``error``'s status code and message (raises, as ``context.abort`` does)."""
    context.abort(code_of(error), str(error))


def rpc(method):
    """Call a method with the caller's principal; a failure ends the call with the handler's refusal. Its
    duration goes to the metrics under the method's name."""
    @functools.wraps(method)
    def serve(self, request, context):
        start = time.perf_counter()
        try:
            return method(self, request, context, self.auth.grpc_principal(context))
        except Exception as e:  # noqa: BLE001 - every failure is answered; refusal logs what is unexpected
            abort(context, self.handler.refusal(e, method.__name__))
        finally:
            self.handler.observe(method.__name__, time.perf_counter() - start)
    return serve


def _pb_put(request: pb.PutRequest) -> rawput.Request:
    """The handler's put request of a ``PutRequest`` (a ``PutRaw`` request unpacks to the same)."""
    given = [request.HasField(f) for f in ("producer_id", "producer_epoch", "base_sequence")]
    producer = None
    if any(given):
        if not all(given):
            raise records.RecordFormatError("producer_id, producer_epoch and base_sequence go together", 0)
        producer = rawput.check_producer(request.producer_id, request.producer_epoch, request.base_sequence)
    b = request.batch
    return rawput.Request(request.topic, request.partition, request.xid,
                          rawput.Batch(b.count, b.attributes, b.body, b.body_crc), request.acks, producer)


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


class BrokerService(pb_grpc.BrokerServicer):
    """``metaq.v1.Broker`` (with ``FetchRaw`` and ``PutRaw``: ``raw_handler``) and ``metaq.v1.Auth``
    (``auth_handler``) over ``handler``."""

    def __init__(self, handler: RequestHandler):
        self.handler = handler
        self.auth = handler.auth

    # -- data -----------------------------------------------------------------------------------------
    @rpc
    def Put(self, request, context, principal):
        """A ``PutRequest``, or (``PutRaw``) a ``PutRaw`` request's bytes as gRPC received them."""
        put = _pb_put(request) if isinstance(request, pb.PutRequest) else rawput.unpack(request)
        r = self.handler.put(principal, put)
        return pb.PutResponse(topic=r.topic, partition=r.partition, base_offset=r.base_offset, count=r.count,
                              base_msg_id=r.base_msg_id, timestamp_ms=r.timestamp_ms, fsynced=r.fsynced,
                              duplicate=r.duplicate)

    def _fetch(self, request, context, principal):
        return self.handler.fetch(principal, FetchRequest(request.topic, request.partition, request.offset,
                                                          request.max_bytes, request.max_messages,
                                                          request.max_wait_ms), context.is_active)

    @rpc
    def Fetch(self, request, context, principal):
        f = self._fetch(request, context, principal)
        r = f.records
        return pb.FetchResponse(start_offset=r.start_offset, end_offset=r.end_offset, records=r.data.tobytes(),
                                batch_positions=r.batch_positions.tolist(), earliest_offset=f.earliest_offset,
                                latest_offset=f.last_stable_offset,
                                aborted=r.aborted.astype(records.ABORTED_DTYPE, copy=False).tobytes(),
                                partition_id=f.partition_id)

    @rpc
    def FetchRaw(self, request, context, principal):
        """``Fetch`` answered as a struct header and the record bytes (``rawfetch``): no protobuf copies."""
        f = self._fetch(request, context, principal)
        r = f.records
        return rawfetch.pack(r.start_offset, r.end_offset, f.earliest_offset, f.last_stable_offset, r.data,
                             r.aborted)

    def raw_handler(self) -> grpc.GenericRpcHandler:
        """Serves ``FetchRaw`` and ``PutRaw`` beside the generated methods of the same service, which they do
        not shadow. ``PutRaw`` hands ``Put`` the request's bytes as gRPC received them."""
        fetch = grpc.unary_unary_rpc_method_handler(self.FetchRaw, request_deserializer=pb.FetchRequest.FromString)
        put = grpc.unary_unary_rpc_method_handler(self.Put, response_serializer=pb.PutResponse.SerializeToString)
        return grpc.method_handlers_generic_handler(rawfetch.SERVICE, {rawfetch.METHOD: fetch, rawput.METHOD: put})

    @rpc
    def Lookup(self, request, context, principal):
        """Messages by key or message id (``protocol.lookup``: a JSON request, an Arrow reply)."""
        return self.handler.lookup(principal, lookup_protocol.unpack_request(request))

    def lookup_handler(self) -> grpc.GenericRpcHandler:
        """Serves ``Lookup`` (not in metaq.proto: a JSON request, an Arrow reply) beside the generated
        methods."""
        return grpc.method_handlers_generic_handler(lookup_protocol.SERVICE, {
            lookup_protocol.METHOD: grpc.unary_unary_rpc_method_handler(self.Lookup)})

    @rpc
    def GetOffsets(self, request, context, principal):
        queries = [OffsetQuery(q.topic, q.partition, _optional(q, "timestamp_ms"), _optional(q, "from_offset"),
                               _optional(q, "max_bytes"), _optional(q, "create_time_from_ms"),
                               _optional(q, "create_time_to_ms")) for q in request.queries]
        return pb.GetOffsetsResponse(offsets=[
            pb.PartitionOffsets(topic=o.topic, partition=o.partition, earliest=o.earliest, latest=o.latest,
                                log_end_offset=o.log_end_offset, for_timestamp=o.for_timestamp,
                                after_bytes=o.after_bytes, high_watermark=o.high_watermark,
                                partition_id=o.partition_id,
                                **({} if o.create_time_range is None else dict(zip(
                                    ("create_time_start", "create_time_end"), o.create_time_range))))
            for o in self.handler.offsets(principal, queries)])

    @rpc
    def InitProducerId(self, request, context, principal):
        pid, epoch = self.handler.init_producer_id(principal, _optional(request, "producer_id"),
                                                   _optional(request, "producer_epoch"))
        return pb.InitProducerIdResponse(producer_id=pid, producer_epoch=epoch)

    # -- admin ----------------------------------------------------------------------------------------
    @rpc
    def ListTopics(self, request, context, principal):
        return pb.ListTopicsResponse(broker_id=self.handler.broker_id, topics=[
            pb.TopicSummary(topic=t.topic, num_partitions=t.num_partitions)
            for t in self.handler.list_topics(principal)])

    @rpc
    def DescribeTopic(self, request, context, principal):
        return _topic(self.handler.describe_topic(principal, request.topic))

    @rpc
    def CreateTopic(self, request, context, principal):
        return _topic(self.handler.create_topic(principal, request.topic, request.num_partitions,
                                                dict(request.config), automatic=request.automatic))

    @rpc
    def ClosePartitions(self, request, context, principal):
        return _topic(self.handler.close_partitions(principal, request.topic, request.start, request.end))

    @rpc
    def OpenPartitions(self, request, context, principal):
        return _topic(self.handler.open_partitions(principal, request.topic))

    @rpc
    def Stats(self, request, context, principal):
        s = self.handler.stats_of(principal, request.topic)
        return pb.StatsResponse(broker_id=s.broker_id, version=s.version, uptime_seconds=s.uptime_seconds,
                                partitions=[pb.PartitionStats(**vars(p)) for p in s.partitions])

    # -- transactions ---------------------------------------------------------------------------------
    @rpc
    def BeginTransaction(self, request, context, principal):
        return _txn(self.handler.begin_transaction(principal, request.xid, request.timeout_ms, request.coordinator))

    @rpc
    def PrepareTransaction(self, request, context, principal):
        return _txn(self.handler.prepare_transaction(principal, request.xid))

    @rpc
    def CommitTransaction(self, request, context, principal):
        return _txn(self.handler.commit_transaction(principal, request.xid))

    @rpc
    def RollbackTransaction(self, request, context, principal):
        return _txn(self.handler.rollback_transaction(principal, request.xid))

    @rpc
    def RecoverTransactions(self, request, context, principal):
        return pb.RecoverTransactionsResponse(transactions=[
            pb.PreparedTransaction(xid=t.xid, coordinator=t.coordinator, messages=t.messages,
                                   prepared_seconds_ago=t.prepared_seconds_ago)
            for t in self.handler.recover_transactions(principal)])

    # -- replication ----------------------------------------------------------------------------------
    @rpc
    def DescribeGroup(self, request, context, principal):
        g = self.handler.describe_group(principal)
        return pb.DescribeGroupResponse(broker_id=g.broker_id, epoch=g.epoch, master=g.master, unclean=g.unclean,
                                        members=[pb.GroupMemberInfo(**vars(m)) for m in g.members])

    # -- login ----------------------------------------------------------------------------------------
    def auth_handler(self) -> grpc.GenericRpcHandler:
        """``metaq.v1.Auth/Authenticate``: one SASL step, messages as JSON (``handler.authenticate``)."""
        return grpc.method_handlers_generic_handler(AUTH_SERVICE, {
            AUTHENTICATE: grpc.unary_unary_rpc_method_handler(self._authenticate)})

    def _authenticate(self, request: bytes, context) -> bytes:
        try:
            return json.dumps(self.handler.authenticate(json.loads(request))).encode()
        except MetaqError as e:
            abort(context, e)
        except (KeyError, TypeError, ValueError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed authentication request")
        except Exception as e:  # noqa: BLE001 - as every other call: the refusal, logged if unexpected
            abort(context, self.handler.refusal(e, "Authenticate"))


def _topic(d) -> pb.TopicDescription:
    return pb.TopicDescription(topic=d.topic, broker_id=d.broker_id, config=d.config, partitions=[
        pb.PartitionDescription(**vars(p)) for p in d.partitions])


def _txn(t) -> pb.TransactionReply:
    return pb.TransactionReply(xid=t.xid, state=t.state, messages=t.messages)
