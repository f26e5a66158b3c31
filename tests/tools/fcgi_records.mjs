// fcgi_records.mjs - the bytes of one FastCGI request (responder role, request id 1): the
// BEGIN_REQUEST record, the params as name-value pairs, then the body as stdin, each stream
// in records of at most 65,535 bytes and ended by an empty one. Used by tests that talk to
// glmspark-fcgi's socket without nginx (tests/db/fcgi_call.mjs, tests/reliability/scenarios.mjs).

// A record: version 1, type, request id 1, content length, padding to 8 bytes.
const record = (type, content) => {
    const pad = (8 - (content.length % 8)) % 8;
    const h = Buffer.from([1, type, 0, 1, content.length >> 8, content.length & 255, pad, 0]);
    return Buffer.concat([h, content, Buffer.alloc(pad)]);
};

// A name's or value's length: one byte below 128, else four with the top bit set.
const len = (n) => n < 128 ? Buffer.from([n])
    : Buffer.from([(n >>> 24) | 0x80, (n >>> 16) & 255, (n >>> 8) & 255, n & 255]);

// params: an object of FastCGI params (values are turned into strings); body: a string or Buffer.
export function fcgiRequestBytes(params, body = '') {
    const nv = Buffer.concat(Object.entries(params).flatMap(([k, v]) => {
        const kb = Buffer.from(k), vb = Buffer.from(String(v));
        return [len(kb.length), len(vb.length), kb, vb];
    }));
    const stdin = Buffer.from(body);
    const out = [record(1, Buffer.from([0, 1, 0, 0, 0, 0, 0, 0]))];  // BEGIN_REQUEST, responder
    for (let i = 0; i < nv.length; i += 65535) out.push(record(4, nv.subarray(i, i + 65535)));
    out.push(record(4, Buffer.alloc(0)));
    for (let i = 0; i < stdin.length; i += 65535) out.push(record(5, stdin.subarray(i, i + 65535)));
    out.push(record(5, Buffer.alloc(0)));
    return Buffer.concat(out);
}
