// Interop test: MQTT.js (`mqtt` 5.x from npm) against a running fleetmq
// broker.
//
// Usage: node mqttjs_test.mjs PORT
//
// Runs every check over MQTT 3.1.1 (protocolVersion 4) and MQTT 5:
// connect / subscribe / publish at QoS 0, 1 and 2, retained messages, a will
// published when a client's stream is destroyed without DISCONNECT, a
// persistent session that gets the messages published while it was away,
// shared subscriptions, and, over MQTT 5, the features MQTT.js exposes: user
// properties, response topic and correlation data, content type and payload
// format, message expiry, subscription identifiers, topic aliases both ways
// (MQTT.js resolves the broker's and assigns its own), No Local.
//
// Exits 0 when everything passed; otherwise prints which check failed and
// why, and exits 1. Run by shards/tests/e2e/interop.rs; scripts/test.sh
// runs `npm install` here.

let mqtt;
try {
  mqtt = await import('mqtt');
} catch (e) {
  console.error(`mqttjs_test: the mqtt package is not installed (${e.message}); run scripts/test.sh`);
  process.exit(2);
}

const WAIT = 5000;
const QUIET = 500;
const RUN = `js${process.pid}`;
const port = Number(process.argv[2]);
if (!port) {
  console.error('usage: node mqttjs_test.mjs PORT');
  process.exit(2);
}

class Failure extends Error {}

function check(cond, what) {
  if (!cond) throw new Failure(what);
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// A connected client whose messages land in a queue.
class Conn {
  static async open(clientId, protocolVersion, opts = {}) {
    const conn = new Conn();
    conn.id = clientId;
    conn.queue = [];
    conn.waiters = [];
    conn.client = mqtt.connect(`mqtt://127.0.0.1:${port}`, {
      clientId,
      protocolVersion,
      reconnectPeriod: 0,
      connectTimeout: WAIT,
      keepalive: 30,
      ...opts,
    });
    conn.client.on('message', (topic, payload, packet) => {
      const m = { topic, payload: payload.toString(), packet };
      const waiter = conn.waiters.shift();
      if (waiter) waiter(m);
      else conn.queue.push(m);
    });
    conn.connack = await new Promise((resolve, reject) => {
      conn.client.once('connect', resolve);
      conn.client.once('error', reject);
      setTimeout(() => reject(new Failure(`${clientId}: no CONNACK within ${WAIT} ms`)), WAIT);
    });
    return conn;
  }

  next(wait = WAIT) {
    if (this.queue.length) return Promise.resolve(this.queue.shift());
    return new Promise((resolve) => {
      const waiter = (m) => {
        clearTimeout(timer);
        resolve(m);
      };
      const timer = setTimeout(() => {
        this.waiters = this.waiters.filter((w) => w !== waiter);
        resolve(null);
      }, wait);
      this.waiters.push(waiter);
    });
  }

  async expect(what) {
    const m = await this.next();
    check(m, `${this.id}: no message within ${WAIT} ms (${what})`);
    return m;
  }

  async expectNone(what) {
    const m = await this.next(QUIET);
    check(!m, `${this.id}: unexpected message on ${m && m.topic}: ${m && m.payload} (${what})`);
  }

  async drain() {
    const all = [];
    for (let m = await this.next(QUIET); m; m = await this.next(QUIET)) all.push(m);
    return all;
  }

  async subscribe(topic, opts) {
    const granted = await this.client.subscribeAsync(topic, opts);
    const qos = granted.map((g) => g.qos);
    check(qos.length === 1 && qos[0] === opts.qos, `${this.id}: SUBACK for ${topic}: ${JSON.stringify(granted)}`);
  }

  publish(topic, payload, opts = {}) {
    return this.client.publishAsync(topic, payload, opts);
  }

  end() {
    return this.client.endAsync();
  }

  // Drops the TCP connection without DISCONNECT.
  kill() {
    this.client.stream.destroy();
    this.client.end(true);
  }
}

async function qosAndRetained(v, tag) {
  const t = `${RUN}/${tag}/qos`;
  const sub = await Conn.open(`${RUN}-${tag}-sub`, v);
  await sub.subscribe(`${t}/#`, { qos: 2 });
  const pub = await Conn.open(`${RUN}-${tag}-pub`, v);
  for (const qos of [0, 1, 2]) {
    await pub.publish(`${t}/${qos}`, `at ${qos}`, { qos });
    const m = await sub.expect(`QoS ${qos}`);
    check(m.topic === `${t}/${qos}` && m.payload === `at ${qos}` && m.packet.qos === qos,
      `QoS ${qos}: got ${m.topic} ${m.payload} qos ${m.packet.qos}`);
    check(!m.packet.retain, 'live delivery with RETAIN=1');
  }
  const retained = `${RUN}/${tag}/retained`;
  await pub.publish(retained, 'kept', { qos: 1, retain: true });
  const late = await Conn.open(`${RUN}-${tag}-late`, v);
  await late.subscribe(retained, { qos: 1 });
  const m = await late.expect('retained on subscribe');
  check(m.packet.retain && m.payload === 'kept', `retained: ${m.payload} retain=${m.packet.retain}`);
  await pub.publish(retained, '', { qos: 1, retain: true });
  const later = await Conn.open(`${RUN}-${tag}-later`, v);
  await later.subscribe(retained, { qos: 1 });
  await later.expectNone('cleared retained message');
  await Promise.all([sub, pub, late, later].map((c) => c.end()));
}

async function will(v, tag) {
  const topic = `${RUN}/${tag}/will`;
  const watcher = await Conn.open(`${RUN}-${tag}-watch`, v);
  await watcher.subscribe(topic, { qos: 1 });
  const dying = await Conn.open(`${RUN}-${tag}-dying`, v, { will: { topic, payload: 'gone', qos: 1, retain: false } });
  dying.kill();
  const m = await watcher.expect('will after an abnormal close');
  check(m.payload === 'gone', `will payload ${m.payload}`);
  const polite = await Conn.open(`${RUN}-${tag}-polite`, v, { will: { topic, payload: 'not sent', qos: 1, retain: false } });
  await polite.end();
  await watcher.expectNone('will after a clean DISCONNECT');
  await watcher.end();
}

async function persistentSession(v, tag) {
  const topic = `${RUN}/${tag}/session`;
  const id = `${RUN}-${tag}-worker`;
  // 3.1.1 keeps the session only with clean session 0; MQTT 5 keeps it for
  // its Session Expiry Interval.
  const keep = v === 5 ? { clean: true, properties: { sessionExpiryInterval: 60 } } : { clean: false };
  const first = await Conn.open(id, v, keep);
  await first.subscribe(topic, { qos: 1 });
  await first.end();
  const pub = await Conn.open(`${RUN}-${tag}-spub`, v);
  for (let i = 0; i < 3; i++) await pub.publish(topic, `while away ${i}`, { qos: 1 });
  const resume = v === 5 ? { clean: false, properties: { sessionExpiryInterval: 60 } } : { clean: false };
  const back = await Conn.open(id, v, resume);
  check(back.connack.sessionPresent, 'session present after reconnect');
  const got = (await back.drain()).map((m) => m.payload);
  check(JSON.stringify(got) === JSON.stringify([0, 1, 2].map((i) => `while away ${i}`)), `resumed session got ${got}`);
  await Promise.all([back.end(), pub.end()]);
}

async function sharedSubscription(v, tag) {
  const t = `${RUN}/${tag}/shared`;
  const members = [];
  for (let i = 0; i < 2; i++) {
    const m = await Conn.open(`${RUN}-${tag}-m${i}`, v);
    await m.subscribe(`$share/${tag}workers/${t}`, { qos: 1 });
    members.push(m);
  }
  const pub = await Conn.open(`${RUN}-${tag}-shpub`, v);
  for (let i = 0; i < 10; i++) await pub.publish(t, String(i), { qos: 1 });
  const got = await Promise.all(members.map(async (m) => (await m.drain()).map((x) => x.payload)));
  const all = got.flat().map(Number).sort((a, b) => a - b);
  check(JSON.stringify(all) === JSON.stringify([...Array(10).keys()]), `shared: each message once, got ${JSON.stringify(got)}`);
  check(got.every((g) => g.length > 0), `shared: every member gets some, got ${JSON.stringify(got)}`);
  await Promise.all([...members, pub].map((c) => c.end()));
}

async function v5Properties(tag) {
  const t = `${RUN}/${tag}/props`;
  // Announcing a Topic Alias Maximum lets the broker alias its PUBLISHes;
  // MQTT.js resolves them.
  const sub = await Conn.open(`${RUN}-${tag}-psub`, 5, { properties: { topicAliasMaximum: 5 } });
  await sub.subscribe(`${t}/#`, { qos: 1, properties: { subscriptionIdentifier: 42 } });
  // autoAssignTopicAlias: MQTT.js sends its own aliases (up to the
  // broker's Topic Alias Maximum).
  const pub = await Conn.open(`${RUN}-${tag}-ppub`, 5, { autoAssignTopicAlias: true });
  check(pub.connack.properties && pub.connack.properties.topicAliasMaximum > 0, 'CONNACK Topic Alias Maximum');
  const props = {
    userProperties: { k: ['v1', 'v2'], a: 'x' },
    responseTopic: `${t}/reply`,
    correlationData: Buffer.from([0, 1, 0x63, 0x6f]),
    contentType: 'text/plain',
    payloadFormatIndicator: true,
    messageExpiryInterval: 60,
  };
  await pub.publish(`${t}/req`, 'ping', { qos: 1, properties: props });
  const m = await sub.expect('request with properties');
  const p = m.packet.properties || {};
  check(JSON.stringify(p.userProperties) === JSON.stringify({ k: ['v1', 'v2'], a: 'x' }), `user properties ${JSON.stringify(p.userProperties)}`);
  check(p.responseTopic === `${t}/reply`, `response topic ${p.responseTopic}`);
  check(Buffer.compare(p.correlationData, props.correlationData) === 0, `correlation data ${p.correlationData}`);
  check(p.contentType === 'text/plain', `content type ${p.contentType}`);
  check(p.payloadFormatIndicator === true, `payload format ${p.payloadFormatIndicator}`);
  check(p.messageExpiryInterval >= 58 && p.messageExpiryInterval <= 60, `message expiry ${p.messageExpiryInterval}`);
  const ids = [].concat(p.subscriptionIdentifier);
  check(JSON.stringify(ids) === JSON.stringify([42]), `subscription identifier ${p.subscriptionIdentifier}`);

  // Topic aliases both ways: the publisher aliases its topic after the
  // first PUBLISH; the broker aliases towards the subscriber.
  const aliasedTopic = `${t}/aliased`;
  for (let i = 0; i < 4; i++) await pub.publish(aliasedTopic, `a${i}`, { qos: 1 });
  let brokerAliased = 0;
  for (let i = 0; i < 4; i++) {
    const a = await sub.expect(`aliased ${i}`);
    check(a.topic === aliasedTopic && a.payload === `a${i}`, `alias ${i}: got ${a.topic} ${a.payload}`);
    const alias = a.packet.properties && a.packet.properties.topicAlias;
    if (alias !== undefined) {
      check(alias >= 1 && alias <= 5, `broker alias ${alias} above our maximum 5`);
      brokerAliased++;
    }
  }
  check(brokerAliased > 0, 'the broker never sent a Topic Alias to a client that allows 5');

  // No Local.
  const nl = `${RUN}/${tag}/nolocal`;
  const self = await Conn.open(`${RUN}-${tag}-self`, 5);
  await self.subscribe(nl, { qos: 1, nl: true });
  await self.publish(nl, 'mine', { qos: 1 });
  await pub.publish(nl, 'theirs', { qos: 1 });
  const n = await self.expect('No Local');
  check(n.payload === 'theirs', `No Local: got ${n.payload}`);
  await self.expectNone('own message with No Local');

  // A message that expires while queued is never sent.
  const id = `${RUN}-${tag}-expiring`;
  const away = await Conn.open(id, 5, { properties: { sessionExpiryInterval: 60 } });
  await away.subscribe(`${t}/exp`, { qos: 1 });
  await away.end();
  await pub.publish(`${t}/exp`, 'short', { qos: 1, properties: { messageExpiryInterval: 1 } });
  await pub.publish(`${t}/exp`, 'long', { qos: 1, properties: { messageExpiryInterval: 100 } });
  await sleep(2100);
  const back = await Conn.open(id, 5, { clean: false, properties: { sessionExpiryInterval: 60 } });
  const got = await back.drain();
  check(JSON.stringify(got.map((x) => x.payload)) === '["long"]', `expiry: got ${got.map((x) => x.payload)}`);
  const left = got[0].packet.properties.messageExpiryInterval;
  check(left >= 1 && left <= 98, `expiry left after 2 s: ${left}`);
  await Promise.all([sub, pub, self, back].map((c) => c.end()));
}

const checks = [];
for (const [v, name] of [[4, 'v311'], [5, 'v5']]) {
  checks.push([`${name} QoS 0/1/2 and retained`, () => qosAndRetained(v, name)]);
  checks.push([`${name} will`, () => will(v, name)]);
  checks.push([`${name} persistent session`, () => persistentSession(v, name)]);
  checks.push([`${name} shared subscription`, () => sharedSubscription(v, name)]);
}
checks.push(['v5 properties, aliases, No Local, expiry', () => v5Properties('v5')]);

// The checks share nothing (own client ids and topics): run them at once.
const results = await Promise.all(checks.map(async ([name, run]) => {
  const started = Date.now();
  try {
    await Promise.race([run(), sleep(60000).then(() => { throw new Failure('did not finish within 60 s'); })]);
    return `ok   ${name} (${((Date.now() - started) / 1000).toFixed(1)}s)`;
  } catch (e) {
    return `FAIL ${name}: ${e instanceof Failure ? e.message : e.stack}`;
  }
}));
const failed = results.filter((r) => !r.startsWith('ok')).length;
for (const r of results) console.log(r);
console.log(`MQTT.js: ${results.length - failed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
