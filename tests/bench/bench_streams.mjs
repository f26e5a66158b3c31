// bench_streams.mjs - open N concurrent /v1/jobs/{id}/events streams through nginx and
// measure, for every chunk, the time from its commit (stamped in the chunk's text by
// bench_chunk_writer) to its arrival here. Prints percentiles in milliseconds, and the
// writer's run time with the chunk rate it sustained (a one-commit-per-chunk writer and a
// batched one offer very different rates, so latencies compare only with their rates).
//   node bench_streams.mjs URL KEY MODEL N WRITER_CMD...
import { spawn } from 'node:child_process';

const [url, key, model, nStr, ...writer] = process.argv.slice(2);
const n = Number(nStr);
const h = { Authorization: `Bearer ${key}`, 'Content-Type': 'application/json' };
const ids = [];
for (let i = 0; i < n; i++) {
    const r = await fetch(`${url}/v1/jobs`, {
        method: 'POST', headers: h,
        body: JSON.stringify({ model, messages: [{ role: 'user', content: 'x' }], max_tokens: 1000 }),
    });
    if (r.status !== 202) throw new Error(`submit: ${r.status} ${await r.text()}`);
    ids.push((await r.json()).id);
}
const lat = [];
let nDone = 0;
async function stream(id) {
    const res = await fetch(`${url}/v1/jobs/${id}/events`, { headers: h });
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    let buf = '';
    for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const now = (performance.timeOrigin + performance.now()) * 1000;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf('\n\n')) >= 0) {
            const block = buf.slice(0, i);
            buf = buf.slice(i + 2);
            const m = block.match(/"text":"t=(\d+)"/);
            if (m) lat.push((now - Number(m[1])) / 1000);
            if (block.includes('data: [DONE]')) { nDone++; return; }
        }
    }
}
const streams = Promise.all(ids.map(stream));
await new Promise((r) => setTimeout(r, 500));  // let every stream attach first
const t0 = performance.now();
const child = spawn(writer[0], writer.slice(1), { stdio: 'inherit' });
const code = await new Promise((r) => child.on('exit', r));
const writerS = (performance.now() - t0) / 1000;
await streams;
lat.sort((a, b) => a - b);
const pct = (p) => lat[Math.min(lat.length - 1, Math.floor(p * lat.length))].toFixed(2);
console.log(`streams=${n} done=${nDone} chunks=${lat.length} writer_exit=${code}` +
    ` writer_s=${writerS.toFixed(1)} chunks_per_s=${(lat.length / writerS).toFixed(0)}`);
console.log(`chunk latency ms: p50=${pct(0.5)} p90=${pct(0.9)} p99=${pct(0.99)} max=${lat[lat.length - 1].toFixed(2)}`);
