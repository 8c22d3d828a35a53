// kafkajs against a metaq broker's Kafka listener: produce N messages with keys and headers (gzip), then
// consume them in a consumer group and print them as JSON lines. Usage: node kafkajs_roundtrip.js HOST:PORT TOPIC N
const { Kafka, CompressionTypes, logLevel } = require("kafkajs");

async function main() {
  const [broker, topic, n] = [process.argv[2], process.argv[3], parseInt(process.argv[4], 10)];
  const kafka = new Kafka({ clientId: "metaq-test", brokers: [broker], logLevel: logLevel.ERROR });
  const producer = kafka.producer({ idempotent: true, maxInFlightRequests: 1 });
  await producer.connect();
  const messages = [];
  for (let i = 0; i < n; i++) {
    messages.push({ key: `k${i}`, value: `js${i}`, headers: { via: "kafkajs" } });
  }
  await producer.send({ topic, messages, acks: -1, compression: CompressionTypes.GZIP });
  await producer.disconnect();
  const consumer = kafka.consumer({ groupId: "kafkajs-group" });
  await consumer.connect();
  await consumer.subscribe({ topic, fromBeginning: true });
  let seen = 0;
  await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`only ${seen} of ${n} messages within 60 s`)), 60000);
    consumer.run({
      eachMessage: async ({ partition, message }) => {
        console.log(JSON.stringify({ partition, offset: message.offset, key: message.key && message.key.toString(),
          value: message.value && message.value.toString(), via: message.headers.via && message.headers.via.toString() }));
        if (++seen >= n) { clearTimeout(timer); resolve(); }
      },
    });
  });
  await consumer.disconnect();
}

main().then(() => process.exit(0), (e) => { console.error(e); process.exit(1); });
