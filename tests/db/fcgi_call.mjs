// fcgi_call.mjs SOCKET METHOD PATH [BODY] - one request straight on glmspark-fcgi's FastCGI
// socket, without nginx (records: tests/tools/fcgi_records.mjs).
//
// Prints the HTTP status on the first line ("Status:" header, 200 when absent), then the
// body as it arrives, so an SSE stream can be followed in a file while it runs. The key in
// GLMSPARK_KEY goes as "Authorization: Bearer KEY" (glmspark-fcgi authenticates every
// request from it; nginx's auth_request is only a pre-check). FCGI_TIMEOUT_MS (30000)
// bounds the whole request. Exits 0 after a complete response; 1 when the socket cannot
// be reached, the time runs out or the connection ends before the response does.
import net from 'node:net';
import { argv, env, exit, stdout } from 'node:process';

import { fcgiRequestBytes } from '../tools/fcgi_records.mjs';

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

const c = net.createConnection(sock);
const timer = setTimeout(() => {
    console.error(`fcgi_call: ${method} ${path}: no complete response in time`);
    exit(1);
}, Number(env.FCGI_TIMEOUT_MS || 30000));
let buf = Buffer.alloc(0), head = Buffer.alloc(0), isBody = false, isEnded = false;
c.on('connect', () => c.write(fcgiRequestBytes(params, stdin)));
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
