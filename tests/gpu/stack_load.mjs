// stack_load.mjs - the load that tests/gpu/run_stack.sh puts on a running stack, through nginx
// over HTTPS with the official `openai` client, and what it measures (figures, not a test):
//   - for each concurrency B of STACK_CONC (1,4,16): a warm-up round (16 tokens each, so the
//     engine has met batch B), then B concurrent streaming chat requests, each a unique prompt
//     of ~2K tokens (no shared prefix to cache) and STACK_TOKENS (256) output tokens. Per
//     request: TTFT (request sent to first delta) and decode tok/s after it. Aggregate: the token
//     rate while all B streams decode (from the last first-delta to the first end), beside
//     `glmspark bench` at batch B (STACK_BENCH, its --json lines) and the engine's own mean
//     decode step and commit over exactly the run (/metrics' decode counters scraped before and
//     after, each after a fresh status publication: the engine publishes every second);
//   - `ops/devstack status` (`glmspark status`) once while the largest batch runs;
//   - cancel: a client that leaves a stream after 8 deltas; the job must end cancelled;
//   - kill -9 of the engine after 32 deltas of a stream, then its restart: the stream must end
//     with every token once (its text equal to the stored output, STACK_TOKENS tokens, attempt 2).
// Prints one line per figure and writes STACK_OUT/stack-STACK_LABEL.json. STACK_CHECKS=0 skips
// the cancel and kill checks. Exit status 1 when one of them fails.
import OpenAI from 'openai';
import { readFileSync, writeFileSync } from 'node:fs';
import { execFile, execFileSync } from 'node:child_process';
import { promisify } from 'node:util';

const env = process.env;
const URL_ = env.STACK_URL, KEY = env.STACK_KEY, MODEL = env.STACK_MODEL;
const N_OUT = Number(env.STACK_TOKENS ?? 256);
const PROMPT_WORDS = Number(env.STACK_PROMPT_WORDS ?? 1990);
const CONC = (env.STACK_CONC ?? '1,4,16').split(',').map(Number);
const TEMPERATURE = env.STACK_TEMPERATURE === undefined ? undefined : Number(env.STACK_TEMPERATURE);
const client = new OpenAI({ baseURL: `${URL_}/v1`, apiKey: KEY, maxRetries: 0, timeout: 600_000 });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const now = () => performance.now();
const f = (x, d = 1) => (x === undefined || x === null || Number.isNaN(x) ? '-' : x.toFixed(d));

const bench = new Map();
for (const line of (env.STACK_BENCH ? readFileSync(env.STACK_BENCH, 'utf8') : '').split('\n'))
    if (line.startsWith('{')) { const b = JSON.parse(line); bench.set(b.batch, b); }

// A prompt of PROMPT_WORDS words, different for every id from its first token on.
const WORDS = ('the of and to in is was for on that with as by at from his her an which are this be '
    + 'river mountain history system engine queue token silver garden window machine theory '
    + 'harbor winter market signal forest letter station question number morning planet '
    + 'language bridge council summer doctor island memory village picture battery').split(' ');
function prompt(id) {
    let x = 2166136261;
    for (const ch of String(id)) x = Math.imul(x ^ ch.charCodeAt(0), 16777619) >>> 0;
    const w = [`Request ${id}:`];
    for (let i = 0; i < PROMPT_WORDS; i++) {
        x = (Math.imul(x, 1103515245) + 12345) >>> 0;
        w.push(WORDS[(x >>> 16) % WORDS.length]);
    }
    return w.join(' ');
}

async function api(path, method = 'GET') {
    const r = await fetch(`${URL_}${path}`, { method, headers: { Authorization: `Bearer ${KEY}` } });
    const text = await r.text();
    return { status: r.status, text, json: text.startsWith('{') ? JSON.parse(text) : null };
}

// /metrics as name -> value (first series; a stat="avg"/"max" label becomes name:avg).
async function metrics() {
    const m = {};
    for (const line of (await api('/metrics')).text.split('\n')) {
        const g = line.match(/^(\w+)(\{[^}]*\})?\s+(\S+)$/);
        if (!g) continue;
        const stat = g[2]?.match(/stat="(\w+)"/);
        const k = stat ? `${g[1]}:${stat[1]}` : g[1];
        if (!(k in m)) m[k] = Number(g[3]);
    }
    return m;
}

// One streaming chat request; onDelta(n, jobId) runs after the n-th delta (return true: leave).
async function chat(id, maxTokens, onDelta) {
    const t0 = now();
    const body = { model: MODEL, messages: [{ role: 'user', content: prompt(id) }],
        max_tokens: maxTokens, stream: true, stream_options: { include_usage: true } };
    if (TEMPERATURE !== undefined) body.temperature = TEMPERATURE;
    const stream = await client.chat.completions.create(body);
    const r = { t0, first: null, end: null, times: [], text: '', usage: null, jobId: null, finish: null };
    for await (const ch of stream) {
        r.jobId ??= ch.id;
        if (ch.usage) r.usage = ch.usage;
        const c = ch.choices?.[0];
        if (c?.finish_reason) r.finish = c.finish_reason;
        const piece = (c?.delta?.reasoning_content ?? '') + (c?.delta?.content ?? '');
        if (!piece) continue;
        const t = now();
        r.first ??= t;
        r.times.push(t);
        r.text += piece;
        if (onDelta && await onDelta(r.times.length, r.jobId)) break;
    }
    r.end = now();
    return r;
}

async function waitJob(id, pred, timeoutMs = 120_000) {
    const t0 = now();
    for (;;) {
        const j = (await api(`/v1/jobs/${id}`)).json;
        if (j && pred(j)) return j;
        if (now() - t0 > timeoutMs) throw new Error(`job ${id} stuck: ${JSON.stringify(j)}`);
        await sleep(100);
    }
}

const pct = (a, p) => { const s = [...a].sort((x, y) => x - y); return s[Math.min(s.length - 1, Math.floor(p * s.length))]; };
const mean = (a) => a.reduce((x, y) => x + y, 0) / a.length;
const summary = { label: env.STACK_LABEL, temperature: TEMPERATURE ?? 'default', tokens: N_OUT, phases: [], checks: {} };
let failed = false;

for (const B of CONC) {
    await Promise.all(Array.from({ length: B }, (_, i) => chat(`warm-${B}-${i}`, 16)));
    await sleep(1200);  // a status publication after the warm-up
    const m0 = await metrics();
    const samples = [];
    let polling = true, statusTaken = B !== Math.max(...CONC);
    const poller = (async () => {
        while (polling) {
            const m = await metrics();
            m.t = now();
            samples.push(m);
            if (!statusTaken && m.glmspark_engine_running_sequences === B) {
                statusTaken = true;
                const { stdout: s } = await promisify(execFile)(env.STACK_DEVSTACK, ['status'], { encoding: 'utf8' });
                writeFileSync(`${env.STACK_OUT}/status.txt`, s);
                console.log(`glmspark status during batch ${B}:\n${s.split('\n').filter((l) => /throughput|kv cache|jobs:/.test(l)).join('\n')}`);
            }
            await sleep(250);
        }
    })();
    const rs = await Promise.all(Array.from({ length: B }, (_, i) => chat(`run-${B}-${i}`, N_OUT)));
    polling = false;
    await poller;
    await sleep(1200);  // a status publication after the run
    const m1 = await metrics();
    const d = (k) => m1[k] - m0[k];
    const nDecode = d('glmspark_engine_decode_steps_total');
    const a = Math.max(...rs.map((r) => r.first)), b = Math.min(...rs.map((r) => r.end));
    let inWin = 0;
    for (const r of rs) {
        const per = r.usage ? r.usage.completion_tokens / r.times.length : 1;  // tokens per delta
        inWin += per * r.times.filter((t) => t > a && t <= b).length;
    }
    const aggregate = b > a ? inWin / ((b - a) / 1000) : NaN;
    const ttft = rs.map((r) => r.first - r.t0);
    const tps = rs.map((r) => (r.usage.completion_tokens - 1) / ((r.end - r.first) / 1000));
    const gaps = rs.flatMap((r) => r.times.slice(1).map((t, i) => t - r.times[i]));
    const be = bench.get(B);
    const ph = {
        batch: B, prompt_tokens: rs[0].usage?.prompt_tokens, completion_tokens: rs.map((r) => r.usage?.completion_tokens),
        finish: [...new Set(rs.map((r) => r.finish))], ttft_ms: { min: Math.min(...ttft), median: pct(ttft, 0.5), max: Math.max(...ttft) },
        req_tok_s: { min: Math.min(...tps), mean: mean(tps) }, aggregate_tok_s: aggregate, window_s: (b - a) / 1000,
        delta_gap_ms: { p50: pct(gaps, 0.5), p90: pct(gaps, 0.9), p99: pct(gaps, 0.99) },
        engine: nDecode > 0 ? { decode_steps: nDecode, step_ms: d('glmspark_engine_decode_step_seconds_total') / nDecode * 1e3,
            commit_ms: d('glmspark_engine_decode_commit_seconds_total') / nDecode * 1e3,
            kv_usage: Math.max(...samples.map((m) => m.glmspark_engine_kv_usage_ratio ?? 0)) } : null,
        bench: be && { decode_tok_s: be.decode_tok_s, decode_ms_step: be.decode_ms_step, prefill_tok_s: be.prefill_tok_s,
            prefill_ms_2k: 2048 / be.prefill_tok_s * 1e3 },
    };
    summary.phases.push(ph);
    console.log(`== batch ${B}: ${ph.prompt_tokens} prompt tokens, ${ph.completion_tokens.join('/')} completion tokens, finish ${ph.finish}`);
    console.log(`  TTFT ms min ${f(ph.ttft_ms.min)} median ${f(ph.ttft_ms.median)} max ${f(ph.ttft_ms.max)}`
        + (be ? ` | bench prefill of 2,048 tokens at batch ${B}: ${f(ph.bench.prefill_ms_2k)} ms (+50 ms: ${f(ph.bench.prefill_ms_2k + 50)})` : ''));
    console.log(`  per request decode tok/s: min ${f(ph.req_tok_s.min)} mean ${f(ph.req_tok_s.mean)}; delta gaps ms p50 ${f(ph.delta_gap_ms.p50, 2)} p90 ${f(ph.delta_gap_ms.p90, 2)} p99 ${f(ph.delta_gap_ms.p99, 2)}`);
    console.log(`  aggregate API tok/s ${f(aggregate)} over ${f(ph.window_s, 2)} s with all ${B} decoding`
        + (be ? ` | bench decode ${f(be.decode_tok_s)} tok/s (${f(be.decode_ms_step, 3)} ms/step): API = ${f(100 * aggregate / be.decode_tok_s)}%` : ''));
    if (ph.engine)
        console.log(`  engine (/metrics, ${ph.engine.decode_steps} decode steps): step ${f(ph.engine.step_ms, 3)} ms, commit ${f(ph.engine.commit_ms, 3)} ms, KV use up to ${f(100 * ph.engine.kv_usage)}%`
            + (be ? `; per token-step: API ${f(B / aggregate * 1e3, 3)} ms = bench ${f(be.decode_ms_step, 3)} + host in the step ${f(ph.engine.step_ms - be.decode_ms_step, 3)} + commit ${f(ph.engine.commit_ms, 3)} + rest ${f(B / aggregate * 1e3 - ph.engine.step_ms - ph.engine.commit_ms, 3)}` : ''));
}

// Cancel: leave a stream after 8 deltas.
if (env.STACK_CHECKS !== '0') {
    const t = {};
    const r = await chat('cancel', N_OUT, (n) => { if (n === 8) { t.left = now(); return true; } return false; });
    const j = await waitJob(r.jobId, (x) => x.state !== 'running' && x.state !== 'queued');
    t.ended = now();
    const ok = j.state === 'cancelled' && j.usage.completion_tokens < N_OUT;
    summary.checks.cancel = { ok, state: j.state, completion_tokens: j.usage.completion_tokens, ms: t.ended - t.left };
    console.log(`cancel: job ${j.state} after ${j.usage.completion_tokens} tokens, ${f(t.ended - t.left)} ms after the client left: ${ok ? 'PASS' : 'FAIL'}`);
    failed ||= !ok;
}

// kill -9 of the engine after 32 deltas, then its restart: the stream goes on where it was.
if (env.STACK_CHECKS !== '0') {
    const t = {};
    const r = await chat('kill', N_OUT, async (n) => {
        if (n !== 32) return false;
        const pid = Number(readFileSync(`${env.GLMSPARK_VAR}/run/engine-1.pid`, 'utf8'));
        process.kill(pid, 'SIGKILL');
        t.killed = now();
        execFileSync(env.STACK_DEVSTACK, ['restart', 'engine'], { stdio: 'inherit' });
        return false;
    });
    const resumed = r.times.find((x) => x > t.killed);
    const j = await waitJob(r.jobId, (x) => x.state !== 'running' && x.state !== 'queued');
    const stored = (j.output?.reasoning_content ?? '') + (j.output?.content ?? '');
    const ok = j.state === 'succeeded' && r.text === stored && r.usage?.completion_tokens === N_OUT
        && j.usage.completion_tokens === N_OUT && j.attempts === 2;
    summary.checks.kill = { ok, state: j.state, attempts: j.attempts, completion_tokens: j.usage.completion_tokens,
        streamed_equals_stored: r.text === stored, gap_ms: resumed - t.killed };
    console.log(`kill -9 after 32 deltas: job ${j.state}, attempt ${j.attempts}, ${j.usage.completion_tokens} tokens, `
        + `streamed text ${r.text === stored ? 'equals' : 'DIFFERS from'} the stored output (${r.text.length} chars), `
        + `stream resumed ${f((resumed - t.killed) / 1000, 1)} s after the kill (engine restart and model load): ${ok ? 'PASS' : 'FAIL'}`);
    failed ||= !ok;
}
writeFileSync(`${env.STACK_OUT}/stack-${env.STACK_LABEL ?? 'run'}.json`, JSON.stringify(summary, null, 1));
process.exit(failed ? 1 : 0);
