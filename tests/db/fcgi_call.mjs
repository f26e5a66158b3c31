// fcgi_call.mjs SOCKET METHOD PATH [BODY] - one request straight on glmspark-fcgi's FastCGI
// socket, without nginx (the record framing of tests/reliability/scenarios.mjs's fcgiRequest).
//
// Prints the HTTP status on the first line ("Status:" header, 200 when absent), then the
// body as it arrives, so an SSE stream can be followed in a file while it runs. The key in
// GLMSPARK_KEY goes as "Authorization: Bearer KEY" (glmspark-fcgi authenticates every
// request from it; nginx's auth_request is only a pre-check). FCGI_TIMEOUT_MS (30000)
// bounds the whole request. Exits 0 after a complete response; 1 when the socket cannot
// be reached, the time runs out or the connection ends before the response does.
import net from 'node:net';
import { argv, env, exit, stdout } from 'node:process';

const [sock, method, path, body = ''] = argv.slice(2);
if (!sock || !method || !path) {
    console.error('usage: node fcgi_call.mjs SOCKET METHOD PATH [BODY]');
    exit(2);
}
const stdin = Buffer.from(body);
const params = {
    REQUEST_METHOD: method, DOCUMENT_URI: path.split('?')[0], REQUEST_URI: path,
    QUERY_STRING: path.includes('?') ? path.slice(path.indexOf('?') + 1) : '',
    CONTENT_TYPE: 'application/json', CONTENT_LENGTH: String(stdin.length),
    SERVER_PROTOCOL: 'HTTP/1.1', REMOTE_ADDR: '127.0.0.1',
};
if (env.GLMSPARK_KEY) params.HTTP_AUTHORIZATION = `Bearer ${env.GLMSPARK_KEY}`;

// A record: version 1, type, request id 1, content length, padding to 8 bytes.
const record = (type, content) => {
    const pad = (8 - (content.length % 8)) % 8;
    const h = Buffer.from([1, type, 0, 1, content.length >> 8, content.length & 255, pad, 0]);
    return Buffer.concat([h, content, Buffer.alloc(pad)]);
};
const len = (n) => n < 128 ? Buffer.from([n])
    : Buffer.from([(n >>> 24) | 0x80, (n >>> 16) & 255, (n >>> 8) & 255, n & 255]);
const nv = Buffer.concat(Object.entries(params).flatMap(([k, v]) => {
    const kb = Buffer.from(k), vb = Buffer.from(v);
    return [len(kb.length), len(vb.length), kb, vb];
}));
const out = [record(1, Buffer.from([0, 1, 0, 0, 0, 0, 0, 0]))];  // BEGIN_REQUEST, responder
for (let i = 0; i < nv.length; i += 65535) out.push(record(4, nv.subarray(i, i + 65535)));
out.push(record(4, Buffer.alloc(0)));
for (let i = 0; i < stdin.length; i += 65535) out.push(record(5, stdin.subarray(i, i + 65535)));
out.push(record(5, Buffer.alloc(0)));

const c = net.createConnection(sock);
const timer = setTimeout(() => {
    console.error(`fcgi_call: ${method} ${path}: no complete response in time`);
    exit(1);
}, Number(env.FCGI_TIMEOUT_MS || 30000));
let buf = Buffer.alloc(0), head = Buffer.alloc(0), isBody = false, isEnded = false;
c.on('connect', () => c.write(Buffer.concat(out)));
c.on('data', (d) => {
    buf = Buffer.concat([buf, d]);
    while (buf.length >= 8) {
        const type = buf[1], n = buf.readUInt16BE(4), pad = buf[6];
        if (buf.length < 8 + n + pad) break;
        const content = buf.subarray(8, 8 + n);
        buf = buf.subarray(8 + n + pad);
        if (type === 3) isEnded = true;  // END_REQUEST
        if (type !== 6 || n === 0) continue;  // only STDOUT carries the response
        if (isBody) {
            stdout.write(content);
            continue;
        }
        head = Buffer.concat([head, content]);
        const end = head.indexOf('\r\n\r\n');
        if (end < 0) continue;
        const m = head.subarray(0, end).toString().match(/^Status: (\d+)/m);
        stdout.write(`${m ? m[1] : 200}\n`);
        stdout.write(head.subarray(end + 4));
        isBody = true;
    }
});
c.on('error', (e) => {
    console.error(`fcgi_call: ${sock}: ${e.message}`);
    exit(1);
});
c.on('close', () => {
    clearTimeout(timer);
    const ok = isEnded && isBody;
    if (!ok) console.error(`fcgi_call: ${method} ${path}: the connection ended early`);
    stdout.write('', () => exit(ok ? 0 : 1));
});
