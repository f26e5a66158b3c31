// scenarios.mjs - the fault, security, input-hardening and load scenarios.
//
// run.sh starts a throwaway serving stack (ops/devstack, loopback only) and passes its URL,
// keys and paths in the environment; REL_PROFILE is "short" (CI) or "full". Every scenario
// drives real processes (kill -9, pg_ctl, pg_terminate_backend) and checks its outcome against
// PostgreSQL, the store of record: streams must equal job_chunks and the stored output.
// Results go to REL_RESULTS as JSON (one object per scenario); the exit status is 1 when any
// scenario failed. Random choices come from a seeded generator (REL_SEED), so a failing
// sequence can be replayed.
import assert from 'node:assert/strict';
import { execFile, execFileSync, spawn } from 'node:child_process';
import { readFileSync, statSync, writeFileSync } from 'node:fs';
import { setMaxListeners } from 'node:events';
import net from 'node:net';
import { promisify } from 'node:util';

const env = process.env;
const URL_ = env.GLMSPARK_URL;
const VAR = env.GLMSPARK_VAR;
const DEVSTACK = env.GLMSPARK_DEVSTACK;
const MODEL = env.GLMSPARK_MODEL;
const K = {
    admin: env.GLMSPARK_ADMIN_KEY, user: env.GLMSPARK_USER_KEY, other: env.GLMSPARK_OTHER_KEY,
    revoked: env.GLMSPARK_REVOKED_KEY, conc3: env.GLMSPARK_CONC3_KEY, rpm10: env.GLMSPARK_RPM10_KEY,
};
const FULL = env.REL_PROFILE === 'full';
const N = FULL
    ? { engineKill: 50, fcgiKill: 20, pgRestart: 2, resume: 1000, cancel: 10, notify: 3, revoke: 20 }
    : { engineKill: 10, fcgiKill: 5, pgRestart: 1, resume: 100, cancel: 3, notify: 1, revoke: 5 };
// The database outage with open streams: REL_OUTAGE_S seconds (60), REL_STREAMS
// streams (100), keep-alives every REL_KEEPALIVE_S (5) seconds.
const OUTAGE = {
    seconds: Number(env.REL_OUTAGE_S || 60), streams: Number(env.REL_STREAMS || 100),
    keepalive: Number(env.REL_KEEPALIVE_S || 5),
};
const only = env.REL_ONLY ? env.REL_ONLY.split(',') : null;

// Deterministic PRNG (mulberry32).
let seed = Number(env.REL_SEED || 12345) >>> 0;
const rand = () => {
    seed = (seed + 0x6d2b79f5) >>> 0;
    let t = seed;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
};
const randInt = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const now = () => performance.now();

// Every HTTP status seen outside the windows where a component is down on purpose.
const statusCounts = {};
let faultWindow = false;
const note = (s) => { if (!faultWindow) statusCounts[s] = (statusCounts[s] || 0) + 1; };

function psql(sql) {
    return execFileSync('psql', [env.GLMSPARK_DB_OWNER, '-qAtX', '-v', 'ON_ERROR_STOP=1', '-c', sql],
        { encoding: 'utf8' }).trim();
}
const devstack = (...args) => execFileSync(DEVSTACK, args, { stdio: ['ignore', 'ignore', 'inherit'] });
// devstack's first engine and first (here only) fcgi process.
const pidOf = (name) => Number(readFileSync(`${VAR}/run/${name}-1.pid`, 'utf8'));
const alive = (pid) => { try { process.kill(pid, 0); return true; } catch { return false; } };

async function api(path, { key = K.user, method = 'GET', body, headers = {}, auth = true } = {}) {
    const h = { 'Content-Type': 'application/json', ...headers };
    if (auth) h.Authorization = `Bearer ${key}`;
    const res = await fetch(`${URL_}${path}`, {
        method, headers: h,
        body: body === undefined ? undefined : typeof body === 'string' || body instanceof Uint8Array
            ? body : JSON.stringify(body),
    });
    const text = await res.text();
    note(res.status);
    let json = null;
    try { json = JSON.parse(text); } catch { /* not JSON */ }
    return { status: res.status, headers: res.headers, json, text };
}

const chatBody = (extra = {}) => ({
    model: MODEL, messages: [{ role: 'user', content: 'Tell me a story' }], max_tokens: 8, ...extra,
});

async function submit(extra = {}, key = K.user, headers = {}) {
    const r = await api('/v1/jobs', { key, method: 'POST', body: chatBody(extra), headers });
    assert.equal(r.status, 202, `submit: ${r.status} ${r.text}`);
    return r.json.id;
}

// Read /v1/jobs/{id}/events from `after` on. Stops at the end, or (abortAtByte) after that
// many bytes, keeping only the events that arrived whole. Returns the events, the end event
// and whether [DONE] came.
async function readEvents(id, { key = K.user, after, abortAtByte = Infinity, timeoutMs = 120000, signal, onBytes } = {}) {
    const ac = new AbortController();
    const timer = setTimeout(() => ac.abort(), timeoutMs);
    if (signal) signal.addEventListener('abort', () => ac.abort());
    const headers = { Authorization: `Bearer ${key}` };
    if (after !== undefined) headers['Last-Event-ID'] = String(after);
    try {
        let res;
        try {
            res = await fetch(`${URL_}/v1/jobs/${id}/events`, { headers, signal: ac.signal });
        } catch (e) {
            if (signal?.aborted) return { events: [], end: null, done: false, bytes: 0, keepalives: 0, aborted: true };
            throw e;
        }
        note(res.status);
        assert.equal(res.status, 200, `events ${id}: ${res.status}`);
        const events = [];
        let end = null, done = false, buf = '', bytes = 0;
        const reader = res.body.getReader();
        const dec = new TextDecoder();
        let keepalives = 0;
        outer: for (;;) {
            let value, eof;
            try {
                ({ value, done: eof } = await reader.read());
            } catch (e) {
                if (signal?.aborted) return { events, end, done, bytes, keepalives, aborted: true };
                throw e;
            }
            if (eof) break;
            let chunk = value;
            onBytes?.(now());
            if (bytes + chunk.length >= abortAtByte) chunk = chunk.subarray(0, abortAtByte - bytes);
            bytes += chunk.length;
            buf += dec.decode(chunk, { stream: true });
            let i;
            while ((i = buf.indexOf('\n\n')) >= 0) {
                const block = buf.slice(0, i);
                buf = buf.slice(i + 2);
                let eid = null, data = null;
                for (const line of block.split('\n')) {
                    if (line.startsWith('id: ')) eid = Number(line.slice(4));
                    else if (line.startsWith('data: ')) data = line.slice(6);
                }
                if (block.startsWith(': keep-alive')) keepalives++;
                if (data === null) continue;
                if (data === '[DONE]') { done = true; break outer; }
                const obj = JSON.parse(data);
                if (eid !== null) { assert.equal(obj.seq, eid); events.push(obj); } else end = obj;
            }
            if (bytes >= abortAtByte) { ac.abort(); break; }
        }
        return { events, end, done, bytes, keepalives };
    } finally {
        clearTimeout(timer);
    }
}

async function job(id, key = K.admin) {
    const r = await api(`/v1/jobs/${id}`, { key });
    assert.equal(r.status, 200, `job ${id}: ${r.status}`);
    return r.json;
}

async function waitJob(id, pred, timeoutMs = 60000) {
    const t0 = now();
    for (;;) {
        const j = await job(id);
        if (pred(j)) return j;
        if (now() - t0 > timeoutMs) throw new Error(`job ${id} stuck: ${JSON.stringify(j)}`);
        await sleep(20);
    }
}
const terminal = (j) => ['succeeded', 'failed', 'cancelled'].includes(j.state);

// The stream's text equals the stored output and job_chunks, with seq 0..n-1.
async function checkStream(id, events) {
    events.forEach((e, i) => assert.equal(e.seq, i, `job ${id}: seq ${e.seq} at ${i}`));
    const j = await job(id);
    const text = (kind) => events.filter((e) => e.kind === kind).map((e) => e.text).join('');
    assert.equal(text('content'), j.output.content, `job ${id}: content differs`);
    assert.equal(text('reasoning'), j.output.reasoning_content, `job ${id}: reasoning differs`);
    const n = Number(psql(`SELECT count(*) FROM job_chunks c JOIN jobs j ON j.id = c.job_id WHERE j.public_id = '${id}'`));
    assert.equal(events.length, n, `job ${id}: ${events.length} events, ${n} chunks`);
    return j;
}

async function restartEngine() {
    for (let t = 0; t < 50; t++) {
        devstack('restart', 'engine');
        await sleep(300);
        if (alive(pidOf('engine'))) return;
        await sleep(200);  // the killed engine's backend still held the queue lock
    }
    throw new Error('the engine did not restart');
}

function pctl(xs, p) {
    if (!xs.length) return NaN;
    const s = [...xs].sort((a, b) => a - b);
    return s[Math.min(s.length - 1, Math.ceil((p / 100) * s.length) - 1)];
}
const ms = (x) => `${x.toFixed(1)} ms`;

// ---------------------------------------------------------------------------
// Fault scenarios

async function engineKillLoop() {
    const points = ['before-claim', 'before-first-chunk', 'mid-generation', 'before-completion'];
    const byPoint = {}, attempts = {};
    let maxRecover = 0;
    for (let i = 0; i < N.engineKill; i++) {
        const point = points[i % points.length];
        const maxTokens = 30;
        let id;
        faultWindow = true;
        if (point === 'before-claim') {
            process.kill(pidOf('engine'), 'SIGKILL');
            id = await submit({ max_tokens: maxTokens, seed: i });
            await sleep(randInt(0, 100));
        } else {
            id = await submit({ max_tokens: maxTokens, seed: i });
            if (point === 'before-first-chunk') await sleep(randInt(0, 30));
            else if (point === 'mid-generation') {
                const k = randInt(2, maxTokens - 5);
                await waitJob(id, (j) => terminal(j) || j.usage.completion_tokens >= k);
            } else await waitJob(id, (j) => terminal(j) || j.usage.completion_tokens >= maxTokens - 1);
            process.kill(pidOf('engine'), 'SIGKILL');
        }
        await restartEngine();
        faultWindow = false;
        const t0 = now();
        const ev = await readEvents(id);
        assert.ok(ev.done && ev.end, `job ${id}: stream did not end`);
        const j = await waitJob(id, terminal);
        maxRecover = Math.max(maxRecover, now() - t0);
        assert.equal(j.state, 'succeeded', `job ${id} (${point}): ${j.state} ${j.error ?? ''}`);
        await checkStream(id, ev.events);
        byPoint[point] = (byPoint[point] || 0) + 1;
        attempts[j.attempts] = (attempts[j.attempts] || 0) + 1;
    }
    const stuck = Number(psql("SELECT count(*) FROM jobs WHERE state IN ('queued','running')"));
    assert.equal(stuck, 0, `${stuck} jobs not terminal after the loop`);
    return {
        iterations: N.engineKill,
        figures: `points ${JSON.stringify(byPoint)}; attempts ${JSON.stringify(attempts)}; ` +
            `0 lost, 0 stuck; slowest restart-to-terminal ${ms(maxRecover)}`,
    };
}

// Pipeline rank killed: the engine runs as two local CPU ranks (--pp 2); kill -9
// of rank 1 mid-generation makes every engine process exit non-zero within 10 s (rank 0
// names the rank and hands its job back: state queued at once, no lease to wait for); a
// restarted engine finishes the job with a contiguous stream equal to the stored output.
async function pipelineRankKilled() {
    const args = `${env.GLMSPARK_ENGINE_ARGS ?? ''} --pp 2`;
    const restartWith = (a) => execFileSync(DEVSTACK, ['restart', 'engine'],
        { stdio: ['ignore', 'ignore', 'inherit'], env: { ...env, GLMSPARK_ENGINE_ARGS: a } });
    const children = (pid) => execFileSync('ps', ['-o', 'pid=', '--ppid', String(pid)], { encoding: 'utf8' })
        .split('\n').map(Number).filter((p) => p > 0);
    const rankOf = (pid) => {
        try { return readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').join(' ').match(/--rank (\d+) /)?.[1]; }
        catch { return undefined; }
    };
    const exits = [];
    const n = FULL ? 3 : 1;
    try {
        for (let i = 0; i < n; i++) {
            restartWith(args);
            const id = await submit({ max_tokens: 60, seed: 100 + i });
            await waitJob(id, (j) => terminal(j) || j.usage.completion_tokens >= 5);
            const launcher = pidOf('engine');
            const ranks = children(launcher);
            const rank1 = ranks.find((p) => rankOf(p) === '1');
            assert.ok(rank1, `no rank 1 among ${ranks} (children of ${launcher})`);
            faultWindow = true;
            const t0 = now();
            process.kill(rank1, 'SIGKILL');
            while ([launcher, ...ranks].some(alive) && now() - t0 < 15000) await sleep(20);
            const dt = now() - t0;
            assert.ok(![launcher, ...ranks].some(alive), 'engine processes still run 15 s after rank 1 died');
            assert.ok(dt < 10000, `the engine took ${dt} ms to exit`);
            const log = readFileSync(`${VAR}/log/engine-1.log`, 'utf8');
            assert.match(log, /pipeline failed .* handing 1 jobs back/);
            assert.equal(psql(`SELECT state FROM jobs WHERE public_id = '${id}'`), 'queued');
            exits.push(dt);
            restartWith(args);
            faultWindow = false;
            const ev = await readEvents(id);
            assert.ok(ev.done && ev.end, `job ${id}: stream did not end`);
            const j = await checkStream(id, ev.events);
            assert.equal(j.state, 'succeeded');
            assert.equal(j.attempts, 2);
        }
    } finally {
        faultWindow = false;
        restartWith(env.GLMSPARK_ENGINE_ARGS ?? '');
    }
    return { iterations: n, figures: `every engine process gone ${exits.map(ms).join(', ')} after kill -9 of rank 1; ` +
        'job handed back and resumed contiguous' };
}

async function fcgiKillEnqueue() {
    let firstAnswered = 0, firstLost = 0, committedUnanswered = 0, unavailable = 0;
    const firstStatus = {};
    for (let i = 0; i < N.fcgiKill; i++) {
        const idem = `rel-fcgi-${process.pid}-${i}`;
        const h = { 'Idempotency-Key': idem };
        faultWindow = true;
        const first = api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 2 }), headers: h })
            .catch((e) => ({ status: 0, error: e }));
        await sleep(randInt(0, 40));
        process.kill(pidOf('fcgi'), 'SIGKILL');
        const a = await first;
        devstack('restart', 'fcgi');
        if (a.status === 202) firstAnswered++; else firstLost++;
        firstStatus[a.status] = (firstStatus[a.status] || 0) + 1;
        if (a.status >= 500) {  // nginx's answer for the cut request: the JSON 503, never HTML
            assert.equal(a.status, 503, `cut request: ${a.status} ${a.text.slice(0, 100)}`);
            assert.equal(a.json?.error?.code, 'unavailable');
        }
        // Cut before the answer, yet committed: the case the key exists for.
        if (a.status !== 202 && Number(psql(`SELECT count(*) FROM jobs WHERE idem_key = '${idem}'`)) === 1)
            committedUnanswered++;
        let b;
        // Until the new fcgi accepts, nginx answers 502 (or 500 from the failed auth_request).
        for (let t = 0; t < 200; t++) {
            b = await api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 2 }), headers: h });
            if (b.status < 500) break;
            // nginx's answer while the app is away: a JSON 503 to retry, never an HTML 500/502.
            assert.equal(b.status, 503, `fcgi down: ${b.status} ${b.text.slice(0, 100)}`);
            assert.equal(b.json?.error?.code, 'unavailable');
            assert.ok(Number(b.headers.get('retry-after')) >= 1);
            unavailable++;
            await sleep(100);
        }
        faultWindow = false;
        assert.equal(b.status, 202, `retry: ${b.status} ${b.text}`);
        if (a.status === 202) assert.equal(b.json.id, a.json.id, 'the retry got another job');
        const n = Number(psql(`SELECT count(*) FROM jobs WHERE idem_key = '${idem}'`));
        assert.equal(n, 1, `${n} jobs for one Idempotency-Key`);
        await waitJob(b.json.id, terminal);
    }
    return {
        iterations: N.fcgiKill,
        figures: `first request answered before the kill ${firstAnswered}, cut ${firstLost} ` +
            `(${committedUnanswered} of them committed but unanswered; statuses of the cut requests ` +
            `${JSON.stringify(firstStatus)}); ` +
            `${unavailable} retries answered 503 (JSON, Retry-After) while fcgi was away; ` +
            'every retry returned exactly one job (DB count per key = 1)',
    };
}

async function pgRestart() {
    const pgbin = execFileSync('bash', ['-c', 'ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1'],
        { encoding: 'utf8' }).trim();
    const asPg = process.getuid() === 0 ? ['runuser', '-u', 'postgres', '--'] : [];
    const figures = [];
    for (let i = 0; i < N.pgRestart; i++) {
        for (const mode of ['fast', 'immediate']) {
            const id = await submit({ max_tokens: 60, seed: 100 + i });
            await waitJob(id, (j) => j.state === 'running' && j.usage.completion_tokens >= 5);
            const reading = readEvents(id, { timeoutMs: 180000 });
            await sleep(200);
            faultWindow = true;
            const t0 = now();
            const cmd = [...asPg, `${pgbin}/pg_ctl`, '-D', `${VAR}/pg/data`, '-m', mode, '-w', 'stop'];
            execFileSync(cmd[0], cmd.slice(1), { stdio: 'ignore' });
            await sleep(randInt(200, 1500));
            devstack('restart', 'postgres');
            faultWindow = false;
            const ev = await reading;
            const dt = now() - t0;
            assert.ok(ev.done, `${mode}: the stream did not end`);
            assert.equal(ev.end.state, 'succeeded', `${mode}: ${JSON.stringify(ev.end)}`);
            await checkStream(id, ev.events);
            const after = await api('/v1/chat/completions', { method: 'POST', body: chatBody({ max_tokens: 2 }) });
            assert.equal(after.status, 200);
            assert.ok(alive(pidOf('engine')) && alive(pidOf('fcgi')), 'a component died');
            figures.push(`${mode}: stream whole, done ${ms(dt)} after stop`);
        }
    }
    return { iterations: N.pgRestart * 2, figures: figures.join('; ') };
}

// NOTIFY suppressed (a no-op public.pg_notify shadows the built-in for the engine's role)
// and every fcgi listener connection terminated mid-stream: the 1 s polling fallback must
// carry the streams.
async function notifySuppressed() {
    const figures = [];
    const base = await submit({ max_tokens: 40, seed: 9 });
    let t0 = now();
    let ev = await readEvents(base);
    const normal = now() - t0;
    await checkStream(base, ev.events);
    psql('CREATE FUNCTION public.pg_notify(text, text) RETURNS void LANGUAGE sql AS $$ SELECT $$;' +
        ' ALTER ROLE glmspark_app SET search_path = public, pg_catalog');
    try {
        await restartEngine();
        for (let i = 0; i < N.notify; i++) {
            const id = await submit({ max_tokens: 40, seed: 9 });
            await waitJob(id, (j) => j.state === 'running');
            t0 = now();
            const reading = readEvents(id);
            await sleep(300);
            const killed = psql("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity" +
                " WHERE usename = 'glmspark_app' AND query LIKE '%job_chunks%'" +
                " AND pid <> pg_backend_pid()");
            ev = await reading;
            const dt = now() - t0;
            assert.ok(ev.done, 'the stream did not end');
            const j = await checkStream(id, ev.events);
            assert.equal(j.state, 'succeeded');
            const notes = Number(psql("SELECT count(*) FROM pg_stat_activity WHERE usename='glmspark_app'"));
            figures.push(`terminated ${killed} backends; stream ${ms(dt)} vs ${ms(normal)} with NOTIFY; ` +
                `${notes} app connections after`);
        }
    } finally {
        psql('ALTER ROLE glmspark_app RESET search_path; DROP FUNCTION public.pg_notify(text, text)');
        await restartEngine();
    }
    return { iterations: N.notify, figures: figures.join('; ') };
}

// Disconnect at random byte offsets and resume with Last-Event-ID until the stream ends.
async function resumeLoop() {
    let disconnects = 0, jobs = 0, reconnectMs = [];
    while (disconnects < N.resume) {
        const id = await submit({ max_tokens: 150, seed: 1000 + jobs });
        jobs++;
        const all = [];
        let last, done = false, end = null;
        while (!done) {
            const cut = disconnects < N.resume ? randInt(1, 600) : Infinity;
            const t0 = now();
            const r = await readEvents(id, { after: last, abortAtByte: cut });
            reconnectMs.push(now() - t0);
            all.push(...r.events);
            if (r.events.length) last = r.events[r.events.length - 1].seq;
            if (r.done) { done = true; end = r.end; } else disconnects++;
        }
        assert.equal(end.state, 'succeeded');
        await checkStream(id, all);
    }
    return {
        iterations: disconnects,
        figures: `${jobs} jobs, reassembled streams byte-identical to job_chunks and output; ` +
            `per connection p50 ${ms(pctl(reconnectMs, 50))} p99 ${ms(pctl(reconnectMs, 99))}`,
    };
}

async function cancelLoop() {
    const stopMs = [];
    for (let i = 0; i < N.cancel; i++) {
        const running = await submit({ max_tokens: 400 });
        const queued = [];
        // The engine batches; fill it so that the last ones wait in the queue.
        for (let q = 0; q < 3; q++) queued.push(await submit({ max_tokens: 400 }));
        await waitJob(running, (j) => j.state === 'running' && j.usage.completion_tokens > 0);
        const waiting = [];
        for (const q of queued) if ((await job(q)).state === 'queued') waiting.push(q);
        for (const q of waiting) {
            const r = await api(`/v1/jobs/${q}/cancel`, { method: 'POST' });
            assert.equal(r.status, 200);
            assert.equal(r.json.state, 'cancelled');
        }
        for (const id of [running, ...queued.filter((q) => !waiting.includes(q))]) {
            const t0 = now();
            const r = await api(`/v1/jobs/${id}/cancel`, { method: 'POST' });
            assert.equal(r.status, 200);
            const j = await waitJob(id, terminal);
            stopMs.push(now() - t0);
            assert.equal(j.state, 'cancelled');
            assert.ok(j.usage.completion_tokens < 400);
            const ev = await readEvents(id);
            assert.ok(ev.done && ev.end.state === 'cancelled');
            await checkStream(id, ev.events);
        }
        await sleep(300);
        for (const q of waiting) {
            const j = await job(q);
            assert.equal(j.state, 'cancelled');
            assert.equal(j.attempts, 0, 'a cancelled queued job was claimed');
        }
    }
    return {
        iterations: N.cancel,
        figures: `running job stop p50 ${ms(pctl(stopMs, 50))} max ${ms(Math.max(...stopMs))}; ` +
            'cancelled queued jobs never claimed (attempts 0)',
    };
}

// ---------------------------------------------------------------------------
// Security

async function security() {
    const jobsBefore = Number(psql('SELECT count(*) FROM jobs'));
    const checks = [];
    const expect = async (what, p, status, code) => {
        const r = await p;
        assert.equal(r.status, status, `${what}: ${r.status} ${r.text.slice(0, 200)}`);
        if (code) assert.equal(r.json?.error?.code, code, `${what}: ${r.text.slice(0, 200)}`);
        checks.push(what);
    };
    const post = (key, extra = {}) => api('/v1/chat/completions', { key, method: 'POST', body: chatBody(extra) });
    await expect('no key', api('/v1/models', { auth: false }), 401);
    await expect('no key, POST', api('/v1/jobs', { auth: false, method: 'POST', body: chatBody() }), 401);
    await expect('malformed key', api('/v1/models', { key: 'not-a-key' }), 401);
    await expect('well-formed unknown key', post('gsk_AAAAAAAAAAAA_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA'), 401);
    await expect('revoked key', post(K.revoked), 401);
    await expect('user key on /metrics', api('/metrics'), 403);
    await expect('key in query string', api(`/v1/models?api_key=${K.user}`), 401, 'api_key_in_query');
    await expect('key in query string, no header', api(`/v1/models?key=${K.user}`, { auth: false }), 401);
    assert.equal(Number(psql('SELECT count(*) FROM jobs')), jobsBefore, 'a rejected request wrote a job');
    const id = await submit({ max_tokens: 2 });
    for (const [p, m] of [[`/v1/jobs/${id}`, 'GET'], [`/v1/jobs/${id}/events`, 'GET'], [`/v1/jobs/${id}/cancel`, 'POST']])
        await expect(`another key's job ${m} ${p.split('/').pop()}`, api(p, { key: K.other, method: m }), 404);
    await waitJob(id, terminal);

    // 50 parallel submits against max_concurrent 3 and rpm 10. The peak is exact: the
    // largest number of the key's jobs whose [created_at, finished_at) overlap.
    const burst = async (key, max, maxTokens) => {
        const rs = await Promise.all(Array.from({ length: 50 },
            () => api('/v1/jobs', { key: K[key], method: 'POST', body: chatBody({ max_tokens: maxTokens }) })));
        const ok = rs.filter((r) => r.status === 202);
        const limited = rs.filter((r) => r.status === 429);
        for (const r of limited) assert.ok(Number(r.headers.get('retry-after')) >= 1);
        for (const r of ok) await api(`/v1/jobs/${r.json.id}/cancel`, { key: K[key], method: 'POST' });
        for (const r of ok) await waitJob(r.json.id, terminal);
        const peak = Number(psql('SELECT coalesce(max(n), 0) FROM (SELECT (SELECT count(*) FROM jobs b' +
            ' WHERE b.api_key_id = a.api_key_id AND b.created_at <= a.created_at' +
            ' AND (b.finished_at IS NULL OR b.finished_at > a.created_at)) AS n' +
            ` FROM jobs a JOIN api_keys k ON k.id = a.api_key_id WHERE k.name = '${key}') x`));
        assert.equal(ok.length + limited.length, 50, `statuses: ${rs.map((r) => r.status)}`);
        assert.ok(ok.length >= 1 && ok.length <= max && peak <= max,
            `${key}: ${ok.length} accepted, peak ${peak}, limit ${max}`);
        return `${key}: 50 parallel -> ${ok.length}x202 ${limited.length}x429, peak unfinished ${peak}`;
    };
    const c = await burst('conc3', 3, 400);
    const r = await burst('rpm10', 10, 2);
    return { iterations: checks.length + 2, figures: `${checks.length} auth checks; ${c}; ${r}` };
}

// ---------------------------------------------------------------------------
// Serving hardening: forged identity on the socket, Idempotency-Key races,
// revocation latency, streams across a database outage.

// run.sh runs a copy of this file from tests/: the records module is tests/tools/.
const { fcgiRequestBytes } = await import(new URL('./tools/fcgi_records.mjs', import.meta.url));
const execFileP = promisify(execFile);
const BIN = env.GLMSPARK_BIN_DIR;
const SOCK = `${VAR}/run/fcgi-1.sock`;
const newKey = (name, ...args) => execFileSync(`${BIN}/glmspark`, ['keys', 'create', '--db', env.GLMSPARK_DB_OWNER,
    '--name', name, ...args], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] }).trim();

// One FastCGI request straight on glmspark-fcgi's socket, bypassing nginx: params are the
// FastCGI params (whatever we like, identity included), body the stdin. Resolves to the
// status and the response text.
function fcgiRequest(params, body = '', timeoutMs = 10000) {
    return new Promise((resolve, reject) => {
        const c = net.createConnection(SOCK);
        const timer = setTimeout(() => { c.destroy(); reject(new Error('FastCGI request timed out')); }, timeoutMs);
        let buf = Buffer.alloc(0), text = Buffer.alloc(0);
        c.on('connect', () => c.write(fcgiRequestBytes(params, body)));
        c.on('data', (d) => {
            buf = Buffer.concat([buf, d]);
            while (buf.length >= 8) {
                const n = buf.readUInt16BE(4), pad = buf[6];
                if (buf.length < 8 + n + pad) break;
                if (buf[1] === 6) text = Buffer.concat([text, buf.subarray(8, 8 + n)]);  // STDOUT
                buf = buf.subarray(8 + n + pad);
            }
        });
        c.on('error', (e) => { clearTimeout(timer); reject(e); });
        c.on('close', () => {
            clearTimeout(timer);
            const t = text.toString();
            const m = t.match(/^Status: (\d+)/);
            resolve({ status: m ? Number(m[1]) : 200, text: t });
        });
    });
}

// The routes every check below walks, for a key that owns job `id`.
const routesFor = (id) => [
    ['GET', '/v1/models'], ['GET', `/v1/models/${MODEL}`], ['POST', '/v1/chat/completions'],
    ['POST', '/v1/completions'], ['POST', '/v1/jobs'], ['GET', '/v1/jobs'], ['GET', `/v1/jobs/${id}`],
    ['GET', `/v1/jobs/${id}/events`], ['POST', `/v1/jobs/${id}/cancel`], ['GET', '/metrics'],
    ['GET', '/v1/no-such-route'],
];

// A process on the socket sets every identity parameter nginx ever passed (admin scope)
// and sends no key, a malformed key, or a revoked key: 401 on every route. The same
// request with a real key works, so it is the key, not the socket, that authenticates.
async function forgedIdentity() {
    const st = statSync(SOCK);
    const mode = (st.mode & 0o777).toString(8);
    assert.equal(mode, '660', `fcgi socket mode ${mode}`);
    let group = String(st.gid);
    try { group = execFileSync('getent', ['group', String(st.gid)], { encoding: 'utf8' }).split(':')[0]; } catch { /* numeric */ }
    if (process.getuid() === 0) assert.equal(group, 'www-data', `fcgi socket group ${group}`);
    const id = await submit({ max_tokens: 2 });
    await waitJob(id, terminal);
    const adminId = psql("SELECT id FROM api_keys WHERE scope = 'admin' ORDER BY id LIMIT 1");
    const body = JSON.stringify(chatBody({ max_tokens: 2 }));
    const jobsBefore = Number(psql('SELECT count(*) FROM jobs'));
    const forged = {
        GLMSPARK_KEY_ID: adminId, GLMSPARK_KEY_SCOPE: 'admin', GLMSPARK_KEY_PREFIX: 'gsk_forged',
        GLMSPARK_KEY_RPM: '0', GLMSPARK_KEY_MAX_CONCURRENT: '0',
    };
    const variants = [['no key', {}], ['malformed key', { HTTP_AUTHORIZATION: 'Bearer forged' }],
        ['revoked key', { HTTP_AUTHORIZATION: `Bearer ${K.revoked}` }],
        ['unknown key', { HTTP_AUTHORIZATION: 'Bearer gsk_AAAAAAAAAAAA_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA' }]];
    let n = 0;
    for (const [what, auth] of variants) {
        for (const [method, path] of [...routesFor(id), ['GET', '/internal/auth']]) {
            const isPost = method === 'POST';
            const r = await fcgiRequest({
                REQUEST_METHOD: method, DOCUMENT_URI: path, REQUEST_URI: path, QUERY_STRING: '',
                CONTENT_TYPE: 'application/json', CONTENT_LENGTH: isPost ? Buffer.byteLength(body) : '',
                ...forged, ...auth,
            }, isPost ? body : '');
            assert.equal(r.status, 401, `forged identity, ${what}, ${method} ${path}: ${r.text.slice(0, 200)}`);
            assert.ok(!/X-Key-Id/i.test(r.text), `${what}: /internal/auth vouched for a forged request`);
            n++;
        }
    }
    assert.equal(Number(psql('SELECT count(*) FROM jobs')), jobsBefore, 'a forged request wrote a job');
    const real = await fcgiRequest({ REQUEST_METHOD: 'GET', DOCUMENT_URI: '/v1/models', QUERY_STRING: '',
        HTTP_AUTHORIZATION: `Bearer ${K.user}`, ...forged });
    assert.equal(real.status, 200, `a real key on the socket: ${real.text.slice(0, 200)}`);
    const asUser = await fcgiRequest({ REQUEST_METHOD: 'GET', DOCUMENT_URI: '/metrics', QUERY_STRING: '',
        HTTP_AUTHORIZATION: `Bearer ${K.user}`, ...forged });
    assert.equal(asUser.status, 403, 'a user key with forged admin scope reached /metrics');
    return { iterations: n + 2, figures: `socket mode ${mode} group ${group}; ${n} forged requests ` +
        `(${variants.length} key variants x ${n / variants.length} routes, admin identity params set) all 401, 0 jobs written; ` +
        'a real user key on the socket: 200, its forged admin scope ignored (403 on /metrics)' };
}

// N concurrent POST /v1/jobs with one Idempotency-Key, for a key without limits and one
// with limits: all 2xx with one job id, exactly one job row.
async function idempotencyRace() {
    const keys = { unlimited: newKey('idem-unlimited'), limited: newKey('idem-limited', '--max-concurrent', '2', '--rpm', '100000') };
    const figures = [];
    let rounds = 0;
    for (const n of [20, 200]) {
        for (const [kind, key] of Object.entries(keys)) {
            const idem = `rel-idem-${process.pid}-${kind}-${n}`;
            const t0 = now();
            const rs = await Promise.all(Array.from({ length: n }, () => api('/v1/jobs', {
                key, method: 'POST', body: chatBody({ max_tokens: 2 }), headers: { 'Idempotency-Key': idem },
            })));
            const dt = now() - t0;
            const statuses = {};
            for (const r of rs) statuses[r.status] = (statuses[r.status] || 0) + 1;
            assert.ok(rs.every((r) => r.status >= 200 && r.status < 300), `${kind} N=${n}: ${JSON.stringify(statuses)} ` +
                rs.find((r) => r.status >= 300)?.text.slice(0, 200));
            const ids = new Set(rs.map((r) => r.json.id));
            assert.equal(ids.size, 1, `${kind} N=${n}: ${ids.size} job ids`);
            const rows = Number(psql(`SELECT count(*) FROM jobs WHERE idem_key = '${idem}'`));
            assert.equal(rows, 1, `${kind} N=${n}: ${rows} job rows`);
            await waitJob([...ids][0], terminal);
            figures.push(`N=${n} ${kind}: ${JSON.stringify(statuses)}, 1 id, 1 row, ${ms(dt)}`);
            rounds++;
        }
    }
    return { iterations: rounds, figures: figures.join('; ') };
}

// A key in use (cached by fcgi, requests in flight) is revoked with `glmspark keys
// revoke`: every route answers 401 within 1 s of the command's return.
async function revocationLatency() {
    const first = [], all = [];
    for (let i = 0; i < N.revoke; i++) {
        const name = `rel-revoke-${process.pid}-${i}`;
        const key = newKey(name);
        const id = await submit({ max_tokens: 2 }, key);
        await waitJob(id, terminal);
        for (let k = 0; k < 3; k++) assert.equal((await api('/v1/models', { key })).status, 200);
        // Keep requests of the key in flight across the revocation (each lookup may race it).
        let stop = false, hammerOk = 0;
        const hammer = Promise.all(Array.from({ length: 4 }, async () => {
            while (!stop) if ((await api('/v1/models', { key })).status === 200) hammerOk++;
        }));
        for (let t = 0; t < 100 && !hammerOk; t++) await sleep(50);
        await execFileP(`${BIN}/glmspark`, ['keys', 'revoke', name, '--db', env.GLMSPARK_DB_OWNER]);
        const t0 = now();
        let tFirst = null;
        const routes = routesFor(id);
        const pending = new Set(routes.map((r) => r.join(' ')));
        // A request sent 1 s or more after the revocation must be refused (judged by when it
        // was sent, so a slow machine's latency does not count against the server).
        while (pending.size) {
            for (const [method, path] of routes) {
                if (!pending.has(`${method} ${path}`)) continue;
                const sent = now() - t0;
                const r = await api(path, { key, method, body: method === 'POST' ? chatBody({ max_tokens: 2 }) : undefined });
                if (r.status === 401) {
                    pending.delete(`${method} ${path}`);
                    tFirst ??= now() - t0;
                } else {
                    assert.ok(sent < 1000, `revoked key accepted ${ms(sent)} after the revocation: ${method} ${path} ${r.status}`);
                }
            }
        }
        const tAll = now() - t0;
        stop = true;
        await hammer;
        // Every request started from here on is refused, whatever route.
        for (const [method, path] of routes) {
            const r = await api(path, { key, method, body: method === 'POST' ? chatBody({ max_tokens: 2 }) : undefined });
            assert.equal(r.status, 401, `revoked key: ${method} ${path} ${r.status}`);
        }
        first.push(tFirst);
        all.push(tAll);
        assert.ok(hammerOk > 0);
    }
    return { iterations: N.revoke, figures: `after \`glmspark keys revoke\` returned: first 401 p50 ${ms(pctl(first, 50))} ` +
        `max ${ms(Math.max(...first))}; every one of ${routesFor('x').length} routes 401 max ${ms(Math.max(...all))} ` +
        '(4 clients hammering the key across the revocation)' };
}

// Connected sockets on glmspark-fcgi's listening path: one per request in flight, since
// nginx does not keep FastCGI connections (so: busy handler threads).
function fcgiConnections() {
    return readFileSync('/proc/net/unix', 'utf8').split('\n')
        .filter((l) => l.endsWith(` ${SOCK}`) && l.trim().split(/\s+/)[5] === '03').length;
}
const appConnections = () => Number(psql("SELECT count(*) FROM pg_stat_activity WHERE usename = 'glmspark_app'"));
const fcgiThreads = () => Number(readFileSync(`/proc/${pidOf('fcgi')}/status`, 'utf8').match(/Threads:\s+(\d+)/)[1]);

function pgStop() {
    const pgbin = execFileSync('bash', ['-c', 'ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1'], { encoding: 'utf8' }).trim();
    const asPg = process.getuid() === 0 ? ['runuser', '-u', 'postgres', '--'] : [];
    const cmd = [...asPg, `${pgbin}/pg_ctl`, '-D', `${VAR}/pg/data`, '-m', 'fast', '-w', 'stop'];
    execFileSync(cmd[0], cmd.slice(1), { stdio: 'ignore' });
}

const restartFcgi = (extraEnv) => execFileSync(DEVSTACK, ['restart', 'fcgi'],
    { stdio: ['ignore', 'ignore', 'inherit'], env: { ...env, ...extraEnv } });

// Streams across a database outage: OUTAGE.streams readers of running jobs' events, then
// PostgreSQL stopped for OUTAGE.seconds. Keep-alives go on; the readers that leave during
// the outage free their handler thread within two keep-alive periods; the rest resume and
// get every committed chunk. Then a stream that gives up (fcgi with --stream-outage-s 3)
// ends with an error event and [DONE]. No thread or connection is left behind.
async function outageStreams() {
    const ka = OUTAGE.keepalive;
    let enginePaused = 0;  // the engine's pid while it is held with SIGSTOP
    const fcgiEnv = { GLMSPARK_FCGI_THREADS: String(OUTAGE.streams + 40), GLMSPARK_SSE_KEEPALIVE_S: String(ka) };
    restartFcgi(fcgiEnv);
    const figures = [];
    try {
        await sleep(1000);
        // The baseline once nothing is in flight (a request of an earlier scenario may linger).
        let conns0 = fcgiConnections();
        for (let t = 0; t < 100 && conns0 > 0; t++) { await sleep(100); conns0 = fcgiConnections(); }
        const threads0 = fcgiThreads(), app0 = appConnections();
        // The engine is held (SIGSTOP, once it runs nothing) while the two jobs are queued and
        // the readers connect, so that neither job can run, let alone finish, before every
        // stream is open, however slow the machine (a loaded 2-core CI machine once took over
        // 20 s to open the 100 streams, longer than the 600-token job); SIGCONT below.
        for (let t = 0; t < 300 && Number(psql("SELECT count(*) FROM jobs WHERE state = 'running'")) > 0; t++)
            await sleep(100);
        enginePaused = pidOf('engine');
        process.kill(enginePaused, 'SIGSTOP');
        // Two jobs long enough to outlast the outage.
        const jobs = [await submit({ max_tokens: 600, seed: 21 }), await submit({ max_tokens: 200, seed: 22 })];
        const nLeave = Math.round(OUTAGE.streams / 5);
        const leave = new AbortController();
        setMaxListeners(OUTAGE.streams, leave.signal);
        const gaps = [];  // per staying reader: the longest silence during the outage
        let outageStart = Infinity, outageEnd = Infinity;
        const readers = Array.from({ length: OUTAGE.streams }, (_, i) => {
            const leaver = i < nLeave;
            let lastBytes = now(), maxGap = 0;
            const onBytes = (t) => {
                const from = Math.max(lastBytes, outageStart), to = Math.min(t, outageEnd);
                if (to > from) maxGap = Math.max(maxGap, to - from);
                lastBytes = t;
            };
            return readEvents(jobs[i % 2], { timeoutMs: (OUTAGE.seconds + 240) * 1000, signal: leaver ? leave.signal : undefined, onBytes })
                .then((r) => ({ ...r, leaver, maxGap: () => maxGap, lastBytes: () => lastBytes, job: jobs[i % 2] }));
        });
        for (let t = 0; t < 300 && fcgiConnections() < conns0 + OUTAGE.streams; t++) await sleep(100);
        await sleep(500);
        const streaming = fcgiConnections() - conns0;
        assert.ok(streaming >= OUTAGE.streams, `${streaming} of ${OUTAGE.streams} streams reached fcgi (baseline ${conns0})`);
        process.kill(enginePaused, 'SIGCONT');
        enginePaused = 0;
        await waitJob(jobs[0], (j) => j.state === 'running' && j.usage.completion_tokens >= 3);
        const chunksOf = (id) => Number(psql(`SELECT count(*) FROM job_chunks c JOIN jobs j ON j.id = c.job_id WHERE j.public_id = '${id}'`));
        const before = jobs.map(chunksOf);
        faultWindow = true;
        pgStop();
        outageStart = now();
        // A fifth of the clients leave a third of the way into the outage.
        await sleep(Math.min(OUTAGE.seconds / 3, 20) * 1000);
        const held = fcgiConnections();
        const tLeave = now();
        leave.abort();
        let freed = null;
        while (now() - tLeave < 4 * ka * 1000) {
            if (fcgiConnections() <= held - nLeave) { freed = now() - tLeave; break; }
            await sleep(100);
        }
        assert.ok(freed !== null && freed <= 2 * ka * 1000,
            `${fcgiConnections() - conns0} of ${held - conns0} streams still held ${ms(now() - tLeave)} after ${nLeave} clients left`);
        await sleep(Math.max(0, outageStart + OUTAGE.seconds * 1000 - now()));
        devstack('restart', 'postgres');
        outageEnd = now();
        faultWindow = false;
        if (!alive(pidOf('engine'))) await restartEngine();
        const rs = await Promise.all(readers);
        const stayed = rs.filter((r) => !r.leaver);
        for (const r of stayed) {
            assert.ok(r.done && r.end, `job ${r.job}: a stream did not end`);
            assert.equal(r.end.state, 'succeeded', `job ${r.job}: ${JSON.stringify(r.end)}`);
        }
        for (const id of jobs) {
            const mine = stayed.filter((r) => r.job === id);
            await checkStream(id, mine[0].events);
            for (const r of mine) assert.deepEqual(r.events.map((e) => e.seq), mine[0].events.map((e) => e.seq));
        }
        const maxGap = Math.max(...stayed.map((r) => r.maxGap()));
        const kas = stayed.map((r) => r.keepalives);
        assert.ok(maxGap <= 2 * ka * 1000, `a stream was silent ${ms(maxGap)} during the outage (keep-alive ${ka} s)`);
        const chunks = jobs.map(chunksOf);
        // Afterwards: no handler thread still busy, no extra thread, no extra connection.
        let conns1 = fcgiConnections();
        for (let t = 0; t < 50 && conns1 > conns0; t++) { await sleep(100); conns1 = fcgiConnections(); }
        const threads1 = fcgiThreads(), app1 = appConnections();
        assert.ok(conns1 <= conns0, `${conns1 - conns0} fcgi requests still in flight`);
        assert.equal(threads1, threads0, `fcgi threads ${threads0} -> ${threads1}`);
        assert.ok(app1 <= app0, `app connections ${app0} -> ${app1}`);
        const probe = await api('/v1/models');
        assert.equal(probe.status, 200);
        figures.push(`${OUTAGE.streams} streams, PostgreSQL stopped ${OUTAGE.seconds} s: longest silence on a staying stream ` +
            `${ms(maxGap)} (keep-alive ${ka} s; ${Math.min(...kas)}-${Math.max(...kas)} keep-alives each); ` +
            `${nLeave} clients left mid-outage, their threads free after ${ms(freed)}; ` +
            `${stayed.length} streams resumed, each with every chunk (${chunks.join(' + ')} chunks, equal to job_chunks; ` +
            `${chunks.map((n, i) => n - before[i]).join(' + ')} of them committed after the stop); ` +
            `after: fcgi threads ${threads0} -> ${threads1}, requests in flight ${conns0} -> ${conns1}, ` +
            `app connections ${app0} -> ${app1}`);

        // Give up: a stream that outlives --stream-outage-s ends with an error event and [DONE].
        restartFcgi({ ...fcgiEnv, GLMSPARK_FCGI_ARGS: `${env.GLMSPARK_FCGI_ARGS ?? ''} --stream-outage-s 3` });
        const g = await submit({ max_tokens: 400, seed: 23 });
        await waitJob(g, (j) => j.state === 'running' && j.usage.completion_tokens >= 3);
        const giving = [readEvents(g), readEvents(g)];
        await sleep(500);
        faultWindow = true;
        pgStop();
        const t1 = now();
        const gs = await Promise.all(giving);
        const dt = now() - t1;
        devstack('restart', 'postgres');
        faultWindow = false;
        if (!alive(pidOf('engine'))) await restartEngine();
        for (const r of gs) {
            assert.ok(r.done, 'a stream that gave up did not send [DONE]');
            assert.equal(r.end?.error?.code, 'database_unavailable', `end event ${JSON.stringify(r.end)}`);
        }
        // The client resumes where it stopped once the database is back.
        const last = gs[0].events.length ? gs[0].events[gs[0].events.length - 1].seq : undefined;
        const rest = await readEvents(g, { after: last });
        assert.ok(rest.done && rest.end.state === 'succeeded');
        await checkStream(g, [...gs[0].events, ...rest.events]);
        figures.push(`give-up (--stream-outage-s 3): both streams ended ${ms(dt)} after the stop with an ` +
            'error event (database_unavailable) and [DONE]; resumed with Last-Event-ID to the end');
    } finally {
        faultWindow = false;
        if (enginePaused) process.kill(enginePaused, 'SIGCONT');
        restartFcgi({});
    }
    return { iterations: OUTAGE.streams + 2, figures: figures.join('; ') };
}

// ---------------------------------------------------------------------------
// Input hardening through nginx

async function hardening() {
    const jobsBefore = Number(psql('SELECT count(*) FROM jobs'));
    const cases = [];
    const raw = async (what, body, expected = 400, path = '/v1/chat/completions') => {
        const r = await api(path, { method: 'POST', body });
        assert.ok(r.status < 500, `${what}: ${r.status}`);
        assert.equal(r.status, expected, `${what}: ${r.status} ${r.text.slice(0, 200)}`);
        if (expected === 400) assert.equal(r.json?.error?.type, 'invalid_request_error', what);
        cases.push(what);
    };
    const msg = (content) => `{"model":"${MODEL}","messages":[{"role":"user","content":${content}}]}`;
    const bytes = (...parts) => Buffer.concat(parts.map((p) => typeof p === 'string' ? Buffer.from(p) : Buffer.from(p)));
    await raw('body over client_max_body_size (33 MB)', msg(`"${'a'.repeat(33 << 20)}"`), 413);
    await raw('empty body', '');
    await raw('truncated JSON', '{"model":');
    await raw('not an object', '[1,2]');
    await raw('trailing garbage', msg('"hi"') + 'x');
    await raw('invalid UTF-8 (0xff)', bytes(`{"model":"${MODEL}","messages":[{"role":"user","content":"`, [0xff, 0xfe], '"}]}'));
    await raw('overlong UTF-8 (0xc0 0xaf)', bytes(`{"model":"${MODEL}","messages":[{"role":"user","content":"`, [0xc0, 0xaf], '"}]}'));
    await raw('UTF-16 surrogate encoded in UTF-8', bytes(`{"model":"${MODEL}","messages":[{"role":"user","content":"`, [0xed, 0xa0, 0x80], '"}]}'));
    await raw('raw NUL byte', bytes(`{"model":"${MODEL}","messages":[{"role":"user","content":"a`, [0], 'b"}]}'));
    await raw('escaped \\u0000', msg('"a\\u0000b"'));
    await raw('lone high surrogate', msg('"\\ud800"'));
    await raw('lone low surrogate', msg('"\\udc00x"'));
    await raw('nesting depth 65', `{"model":"${MODEL}","messages":[{"role":"user","content":"a"}],"x":${'['.repeat(65)}${']'.repeat(65)}}`);
    await raw('nesting depth 100000', '['.repeat(100000) + ']'.repeat(100000));
    await raw('NaN', msg('"a"').slice(0, -1) + ',"temperature":NaN}');
    await raw('Infinity', msg('"a"').slice(0, -1) + ',"temperature":Infinity}');
    await raw('-Infinity max_tokens', msg('"a"').slice(0, -1) + ',"max_tokens":-Infinity}');
    await raw('1e999', msg('"a"').slice(0, -1) + ',"temperature":1e999}');
    await raw('10 MB string over the context', msg(`"${'hello '.repeat((10 << 20) / 6)}"`));
    await raw('10 MB key name', `{"${'k'.repeat(10 << 20)}":1}`);
    await raw('wrong type: messages string', `{"model":"${MODEL}","messages":"hi"}`);
    await raw('wrong type: max_tokens string', msg('"a"').slice(0, -1) + ',"max_tokens":"8"}');
    await raw('wrong type: temperature bool', msg('"a"').slice(0, -1) + ',"temperature":true}');
    await raw('wrong type: content number', msg('42'));
    await raw('wrong type: stream string', msg('"a"').slice(0, -1) + ',"stream":"yes"}');
    await raw('max_tokens 0', msg('"a"').slice(0, -1) + ',"max_tokens":0}');
    await raw('max_tokens 2^53', msg('"a"').slice(0, -1) + ',"max_tokens":9007199254740993}');
    await raw('unknown role', `{"model":"${MODEL}","messages":[{"role":"wizard","content":"a"}]}`);
    await raw('prompt over the context', msg(`"${'hello world '.repeat(5000)}"`));
    await raw('completions: prompt over the context', `{"model":"${MODEL}","prompt":"${'hello world '.repeat(5000)}"}`, 400, '/v1/completions');
    await raw('completions: prompt array of ints out of vocab', `{"model":"${MODEL}","prompt":[999999999]}`, 400, '/v1/completions');
    await raw('jobs: invalid UTF-8', bytes('{"model":"', [0xff], '"}'), 400, '/v1/jobs');
    const after = Number(psql('SELECT count(*) FROM jobs'));
    assert.equal(after, jobsBefore, `${after - jobsBefore} job rows from rejected input`);
    return { iterations: cases.length, figures: `${cases.length} input classes, each 4xx with a JSON error; 0 job rows written; 0 5xx` };
}

// ---------------------------------------------------------------------------
// Load (full profile): wrk on enqueue and reads with 200 SSE readers; slowhttptest.

function runTool(cmd, args, opts = {}) {
    return new Promise((resolve) => {
        const p = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'], ...opts });
        let out = '';
        p.stdout.on('data', (d) => { out += d; });
        p.stderr.on('data', (d) => { out += d; });
        p.on('close', (code) => resolve({ code, out }));
    });
}

function wrkStats(out) {
    const reqs = Number((out.match(/(\d+) requests in/) || [])[1] || 0);
    const non2xx = Number((out.match(/Non-2xx or 3xx responses: (\d+)/) || [])[1] || 0);
    const p99 = (out.match(/\s99%\s+(\S+)/) || [])[1] || '?';
    const p50 = (out.match(/\s50%\s+(\S+)/) || [])[1] || '?';
    const rps = (out.match(/Requests\/sec:\s+(\S+)/) || [])[1] || '?';
    const errs = (out.match(/Socket errors:[^\n]*/) || [''])[0];
    return { reqs, non2xx, p50, p99, rps, errs };
}

async function load() {
    const dur = Number(env.REL_LOAD_SECONDS || 60);
    const readJob = await submit({ max_tokens: 3000, seed: 77 });
    await waitJob(readJob, (j) => j.state === 'running');
    const readers = Array.from({ length: 200 }, () => readEvents(readJob, { timeoutMs: 600000 }));
    const lua = `${VAR}/enqueue.lua`;
    writeFileSync(lua, `wrk.method = "POST"\nwrk.body = '${JSON.stringify(chatBody({ max_tokens: 1 }))}'\n` +
        `wrk.headers["Content-Type"] = "application/json"\nwrk.headers["Authorization"] = "Bearer ${K.user}"\n`);
    const statusId = await submit({ max_tokens: 1 });
    const [enq, rd] = await Promise.all([
        runTool('wrk', ['-t1', '-c16', `-d${dur}s`, '--timeout', '10s', '--latency', '-s', lua, `${URL_}/v1/jobs`]),
        runTool('wrk', ['-t1', '-c32', `-d${dur}s`, '--timeout', '10s', '--latency', '-H', `Authorization: Bearer ${K.user}`,
            `${URL_}/v1/jobs/${statusId}`]),
    ]);
    const e = wrkStats(enq.out), r = wrkStats(rd.out);
    // Drop the enqueued backlog (it would keep the engine busy for minutes).
    psql("UPDATE jobs SET state = 'cancelled', finished_at = now() WHERE state = 'queued' AND max_tokens = 1");
    const rs = await Promise.all(readers);
    const ref = await checkStream(readJob, rs[0].events);
    for (const x of rs) {
        assert.ok(x.done, 'an SSE reader did not get the end');
        assert.deepEqual(x.events.map((v) => v.text), rs[0].events.map((v) => v.text));
    }
    const usage = psql('SELECT pg_notification_queue_usage()');
    assert.equal(e.non2xx, 0, `enqueue: ${e.non2xx} non-2xx`);
    assert.equal(r.non2xx, 0, `reads: ${r.non2xx} non-2xx`);
    return {
        iterations: e.reqs + r.reqs,
        figures: `${dur} s; enqueue ${e.reqs} req (${e.rps}/s) p50 ${e.p50} p99 ${e.p99} non-2xx ${e.non2xx} ${e.errs || 'no socket errors'}; ` +
            `reads ${r.reqs} req (${r.rps}/s) p50 ${r.p50} p99 ${r.p99} non-2xx ${r.non2xx} ${r.errs || 'no socket errors'}; ` +
            `200 SSE readers all got the identical ${rs[0].events.length}-chunk stream (${ref.state}); ` +
            `notification queue usage ${usage}`,
    };
}

async function probeLatency(seconds) {
    const lat = [];
    let fails = 0;
    const t0 = now();
    while (now() - t0 < seconds * 1000) {
        const s = now();
        const r = await api('/v1/models').catch(() => ({ status: 0 }));
        if (r.status === 200) lat.push(now() - s); else fails++;
        await sleep(50);
    }
    return { lat, fails };
}

async function slowClients() {
    const host = URL_;
    const base = await probeLatency(10);
    const figures = [`baseline p50 ${ms(pctl(base.lat, 50))} p99 ${ms(pctl(base.lat, 99))}`];
    for (const [name, args] of [
        ['slowloris', ['-c', '1000', '-H', '-i', '10', '-r', '200', '-t', 'GET', '-x', '24', '-p', '3', '-l', '40']],
        ['slow POST', ['-c', '1000', '-B', '-i', '10', '-r', '200', '-s', '8192', '-t', 'POST', '-x', '10', '-p', '3', '-l', '40']],
        ['slow read', ['-c', '500', '-X', '-r', '200', '-w', '512', '-y', '1024', '-n', '5', '-z', '32', '-k', '3', '-p', '3', '-l', '40']],
    ]) {
        const attack = runTool('slowhttptest', [...args, '-u', `${host}/health`]);
        await sleep(8000);
        const during = await probeLatency(25);
        const a = await attack;
        const p99 = pctl(during.lat, 99), b99 = pctl(base.lat, 99);
        // Its status lines carry colour codes: "connected:   ESC[1;32m        9".
        const plain = a.out.replace(/\x1b\[[0-9;]*m/g, '');
        const connected = [...plain.matchAll(/\bconnected:\s+(\d+)/g)].map((m) => Number(m[1]));
        figures.push(`${name}: probe p50 ${ms(pctl(during.lat, 50))} p99 ${ms(p99)}, ${during.fails} failed; ` +
            `attacker peak connected ${connected.length ? Math.max(...connected) : '?'}`);
        assert.equal(during.fails, 0, `${name}: ${during.fails} normal requests failed`);
        assert.ok(p99 <= Math.max(2 * b99, b99 + 50), `${name}: p99 ${p99} vs baseline ${b99}`);
    }
    return { iterations: 3, figures: figures.join('; ') };
}

// ---------------------------------------------------------------------------

const scenarios = [
    ['security: auth, scopes, ownership, rate and concurrency limits', security],
    ['input hardening through nginx', hardening],
    ['cancel queued and running', cancelLoop],
    ['client disconnect + resume (Last-Event-ID)', resumeLoop],
    ['engine kill -9 at random points', engineKillLoop],
    ['pipeline rank killed', pipelineRankKilled],
    ['fcgi kill -9 during enqueue (Idempotency-Key)', fcgiKillEnqueue],
    ['PostgreSQL fast and immediate restart mid-stream', pgRestart],
    ['listener terminated + NOTIFY suppressed (polling fallback)', notifySuppressed],
    ['forged identity on the FastCGI socket', forgedIdentity],
    ['Idempotency-Key race (N concurrent submissions)', idempotencyRace],
    ['revocation latency (key in use)', revocationLatency],
    ['streams across a database outage', outageStreams],
];
if (FULL) {
    scenarios.push(['load: wrk enqueue + reads, 200 SSE readers', load]);
    scenarios.push(['slowloris / slow POST / slow read (slowhttptest)', slowClients]);
}

const results = [];
let failed = 0;
for (const [name, fn] of scenarios) {
    if (only && !only.some((o) => name.includes(o))) continue;
    const t0 = now();
    process.stderr.write(`reliability: ${name} ...\n`);
    try {
        const r = await fn();
        results.push({ name, ok: true, ...r, seconds: (now() - t0) / 1000 });
        process.stderr.write(`reliability:   ok (${r.iterations}) ${r.figures}\n`);
    } catch (e) {
        failed++;
        faultWindow = false;
        results.push({ name, ok: false, iterations: 0, figures: String(e.message || e), seconds: (now() - t0) / 1000 });
        process.stderr.write(`reliability:   FAILED ${e.stack || e}\n`);
    }
}

// Whole-database invariants after everything: nothing stuck, every job's chunks contiguous.
let stuck = 0;
for (let t = 0; t < 600; t++) {
    stuck = Number(psql("SELECT count(*) FROM jobs WHERE state IN ('queued','running')"));
    if (!stuck) break;
    await sleep(100);
}
const gaps = Number(psql('SELECT count(*) FROM (SELECT job_id FROM job_chunks GROUP BY job_id' +
    ' HAVING max(seq) + 1 <> count(*) OR min(seq) <> 0) g'));
const mismatch = Number(psql('SELECT count(*) FROM jobs j WHERE n_chunks <>' +
    ' (SELECT count(*) FROM job_chunks c WHERE c.job_id = j.id)'));
const fivexx = Object.entries(statusCounts).filter(([s]) => Number(s) >= 500).reduce((a, [, n]) => a + n, 0);
const inv = { name: 'invariants over the whole database', ok: stuck === 0 && gaps === 0 && mismatch === 0 && fivexx === 0,
    iterations: Number(psql('SELECT count(*) FROM jobs')),
    figures: `${stuck} jobs not terminal; ${gaps} jobs with a seq gap; ${mismatch} n_chunks mismatches; ` +
        `HTTP statuses outside fault windows ${JSON.stringify(statusCounts)}`, seconds: 0 };
if (!inv.ok) failed++;
results.push(inv);
process.stderr.write(`reliability: ${inv.name}: ${inv.ok ? 'ok' : 'FAILED'} ${inv.figures}\n`);
writeFileSync(env.REL_RESULTS, JSON.stringify(results, null, 1));
process.exit(failed ? 1 : 0);
