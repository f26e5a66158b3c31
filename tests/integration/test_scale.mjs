// test_scale.mjs - scale-out end to end: three engines of two models and two fcgi processes
// behind one nginx, on one PostgreSQL queue, driven by the official `openai` npm client.
//
// run_scale.sh starts the stack (ops/devstack: GLMSPARK_ENGINES "glmspark-demo glmspark-demo
// glmspark-demo-b", GLMSPARK_FCGI_PROCS 2, engines slowed by --step-delay-ms so that each is
// bound by its steps, leases of 5 s) and passes its URL, key and paths in the environment.
// Tests run in order:
//   1. /v1/models lists both models; an unknown model is a 404 model_not_found;
//   2. 200 jobs across both models (streamed chats, plain completions) all succeed exactly
//      once, each run by an engine of its model, through both fcgi processes; greedy output
//      depends on the model only (both engines of glmspark-demo agree);
//   3. kill -9 of the second glmspark-demo engine while it streams: its jobs finish on the
//      first, every stream contiguous and equal to an uninterrupted run;
//   4. steady-state tokens/s of glmspark-demo with one engine, then two (engine 2 restarted),
//      sixteen clients submitting back to back: two give at least 1.8x.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import OpenAI from 'openai';

const URL_ = process.env.GLMSPARK_URL;
const KEY = process.env.GLMSPARK_USER_KEY;
const DEVSTACK = process.env.GLMSPARK_DEVSTACK;
const VAR = process.env.GLMSPARK_VAR;
const DB = process.env.GLMSPARK_DB_SUPER;
const [MODEL_A, MODEL_B] = ['glmspark-demo', 'glmspark-demo-b'];

const client = new OpenAI({ baseURL: `${URL_}/v1`, apiKey: KEY, maxRetries: 0 });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const psql = (sql) => execFileSync('psql', [DB, '-qAtX', '-c', sql]).toString().trim();
const PROMPTS = ['Hello there', 'Tell me a story', 'What is 2 + 2?', 'Name a colour'];

// Run jobs (functions returning promises) with at most `width` in flight; results in order.
async function pool(jobs, width) {
    const out = new Array(jobs.length);
    let next = 0;
    const worker = async () => {
        while (next < jobs.length) {
            const i = next++;
            out[i] = await jobs[i]();
        }
    };
    await Promise.all(Array.from({ length: width }, worker));
    return out;
}

// A chat job, streamed: {id, text, finish}.
async function streamChat(model, content, maxTokens) {
    const stream = await client.chat.completions.create({
        model, messages: [{ role: 'user', content }], max_tokens: maxTokens, temperature: 0, stream: true,
    });
    let id = null, text = '', finish = null;
    for await (const ev of stream) {
        id = ev.id;
        for (const ch of ev.choices) {
            text += ch.delta?.content ?? '';
            if (ch.finish_reason) finish = ch.finish_reason;
        }
    }
    return { id, text, finish };
}

// A completion job, not streamed: {id, text, finish}.
async function complete(model, prompt, maxTokens) {
    const r = await client.completions.create({ model, prompt, max_tokens: maxTokens, temperature: 0 });
    return { id: r.id, text: r.choices[0].text, finish: r.choices[0].finish_reason };
}

const quoteList = (ids) => ids.map((id) => `'${id}'`).join(',');

test('models: both listed, an unknown one is model_not_found', async () => {
    const list = await client.models.list();
    assert.deepEqual(list.data.map((m) => m.id), [MODEL_A, MODEL_B]);
    await assert.rejects(client.completions.create({ model: 'no-such-model', prompt: 'x', max_tokens: 1 }),
        (e) => e.status === 404 && e.code === 'model_not_found');
});

test('200 jobs across both models succeed exactly once, each on an engine of its model', async () => {
    const before = Number(psql('SELECT count(*) FROM jobs'));
    const jobs = [];
    for (let i = 0; i < 200; i++) {
        const model = i % 2 ? MODEL_B : MODEL_A, prompt = PROMPTS[i % PROMPTS.length];
        jobs.push(async () => ({ model, prompt, ...(i % 4 < 2 ? await streamChat(model, prompt, 8)
                                                            : await complete(model, prompt, 8)),
                                 kind: i % 4 < 2 ? 'chat' : 'completion' }));
    }
    const t0 = Date.now();
    const res = await pool(jobs, 32);
    const seconds = (Date.now() - t0) / 1000;
    assert.equal(new Set(res.map((r) => r.id)).size, 200, 'every answer is its own job');
    for (const r of res) assert.equal(r.finish, 'length', `job ${r.id} ended ${r.finish}`);
    // Exactly once: 200 new rows, each succeeded on its first attempt, by an engine of its model.
    assert.equal(Number(psql('SELECT count(*) FROM jobs')) - before, 200);
    const rows = psql(`SELECT j.public_id || ' ' || j.model || ' ' || j.state || ' ' || j.attempt || ' ' ||
        e.model || ' ' || e.name FROM jobs j JOIN engines e ON e.id = j.lease_epoch
        WHERE j.public_id IN (${quoteList(res.map((r) => r.id))})`).split('\n');
    assert.equal(rows.length, 200);
    const byEngine = {};
    const want = new Map(res.map((r) => [r.id, r.model]));
    for (const row of rows) {
        const [id, model, state, attempt, engineModel, engine] = row.split(' ');
        assert.equal(state, 'succeeded', row);
        assert.equal(attempt, '1', row);
        assert.equal(model, want.get(id), row);
        assert.equal(engineModel, model, `job ${id} of ${model} ran on an engine of ${engineModel}`);
        byEngine[engine] = (byEngine[engine] ?? 0) + 1;
    }
    assert.equal(byEngine['devstack-3'], 100, 'the one glmspark-demo-b engine ran its 100 jobs');
    assert.ok(byEngine.devstack > 0 && byEngine['devstack-2'] > 0,
        `both glmspark-demo engines claimed jobs: ${JSON.stringify(byEngine)}`);
    // Greedy output depends on the model, kind and prompt only: the two glmspark-demo engines
    // agree; glmspark-demo-b (other weights) answers differently somewhere.
    const outputs = new Map();
    for (const r of res) {
        const k = `${r.model}|${r.kind}|${r.prompt}`;
        if (!outputs.has(k)) outputs.set(k, r.text);
        assert.equal(r.text, outputs.get(k), `${k}: outputs differ between runs`);
    }
    assert.ok(PROMPTS.some((p) => outputs.get(`${MODEL_A}|chat|${p}`) !== outputs.get(`${MODEL_B}|chat|${p}`)),
        'the two models answer alike: are the requests routed by model?');
    // Both fcgi processes served requests (nginx's access log names the upstream socket).
    const log = readFileSync(`${VAR}/log/nginx-access.log`, 'utf8');
    for (const k of [1, 2])
        assert.ok(log.includes(`upstream=unix:${VAR}/run/fcgi-${k}.sock`), `fcgi ${k} served nothing`);
    console.log(`200 jobs (100 per model) in ${seconds.toFixed(1)} s; by engine ${JSON.stringify(byEngine)}`);
});

test('kill -9 of an engine mid-stream: its jobs finish on the other engine of the model', async () => {
    // Reference outputs, uninterrupted.
    const prompts = ['Resume me 0', 'Resume me 1', 'Resume me 2', 'Resume me 3', 'Resume me 4', 'Resume me 5'];
    const ref = await pool(prompts.map((p) => () => streamChat(MODEL_A, p, 40)), 6);
    const epoch2 = psql("SELECT max(id) FROM engines WHERE name = 'devstack-2' AND stopped_at IS NULL");
    const epoch1 = psql("SELECT max(id) FROM engines WHERE name = 'devstack' AND stopped_at IS NULL");
    const streams = prompts.map((p) => streamChat(MODEL_A, p, 40));
    // Wait until engine 2 streams some of them (a few tokens in), then kill it.
    const t0 = Date.now();
    for (;;) {
        const n = Number(psql(`SELECT count(*) FROM jobs WHERE state = 'running' AND lease_epoch = ${epoch2}
            AND n_completion_tokens >= 3`));
        if (n > 0) break;
        assert.ok(Date.now() - t0 < 30000, 'engine 2 never ran a job');
        await sleep(50);
    }
    const pid = Number(readFileSync(`${VAR}/run/engine-2.pid`, 'utf8'));
    const killedAt = Date.now();
    process.kill(pid, 'SIGKILL');
    const victims = psql(`SELECT public_id FROM jobs WHERE state = 'running' AND lease_epoch = ${epoch2}`)
        .split('\n').filter(Boolean);
    const got = await Promise.all(streams);
    const seconds = (Date.now() - killedAt) / 1000;
    for (let i = 0; i < prompts.length; i++) {
        assert.equal(got[i].finish, 'length');
        assert.equal(got[i].text, ref[i].text, `stream of "${prompts[i]}" differs from the uninterrupted run`);
    }
    // The jobs that engine 2 held were resumed by engine 1 (attempt 2), their chunks contiguous.
    assert.ok(victims.length > 0);
    const rows = psql(`SELECT j.public_id || ' ' || j.attempt || ' ' || j.lease_epoch || ' ' ||
        (SELECT count(*) || ' ' || coalesce(max(seq), -1) FROM job_chunks c WHERE c.job_id = j.id) || ' ' ||
        (SELECT count(DISTINCT attempt) FROM job_chunks c WHERE c.job_id = j.id)
        FROM jobs j WHERE j.public_id IN (${quoteList(victims)})`).split('\n');
    let resumedMidway = 0;
    for (const row of rows) {
        const [id, attempt, epoch, n, maxSeq, attempts] = row.split(' ');
        assert.equal(attempt, '2', row);
        assert.equal(epoch, epoch1, `job ${id} finished on boot ${epoch}, not engine 1's ${epoch1}`);
        assert.equal(Number(maxSeq), Number(n) - 1, `job ${id}: chunks are not contiguous`);
        resumedMidway += attempts === '2';
    }
    assert.ok(resumedMidway > 0, 'no job had chunks from both attempts');
    console.log(`kill -9: ${victims.length} jobs of engine 2 resumed on engine 1; streams done ${seconds.toFixed(1)} s after the kill (lease 5 s)`);
});

// Steady-state tokens/s of glmspark-demo: `width` clients each submit one completion after
// another (enough to fill every engine's slots); after a warm-up, the tokens committed within
// a window of `seconds` (job_chunks.created_at, the database's clock) over its length.
async function rate(width, seconds) {
    let stop = false, n = 0;
    const client_ = async (w) => {
        while (!stop) await complete(MODEL_A, `Rate ${w} ${n++}`, 16);
    };
    const clients = Array.from({ length: width }, (_, w) => client_(w));
    await sleep(3000);
    const t1 = psql('SELECT now()');
    await sleep(seconds * 1000);
    const t2 = psql('SELECT now()');
    stop = true;
    await Promise.all(clients);
    const tokens = Number(psql(`SELECT coalesce(sum(cardinality(c.token_ids)), 0) FROM job_chunks c
        JOIN jobs j ON j.id = c.job_id WHERE j.model = '${MODEL_A}'
        AND c.created_at BETWEEN '${t1}' AND '${t2}'`));
    const span = Number(psql(`SELECT extract(epoch FROM '${t2}'::timestamptz - '${t1}'::timestamptz)`));
    return { tokens, seconds: span, perS: tokens / span };
}

test('aggregate tokens/s grows with the engines of a model (>= 1.8x from one to two)', async () => {
    // Engine 2 is dead (the kill above): one engine of glmspark-demo serves.
    const pid = Number(readFileSync(`${VAR}/run/engine-2.pid`, 'utf8'));
    assert.throws(() => process.kill(pid, 0), 'engine 2 still runs');
    const last2 = psql("SELECT max(id) FROM engines WHERE name = 'devstack-2'");
    const one = await rate(16, 10);
    execFileSync(DEVSTACK, ['start', 'engine-2'], { stdio: 'inherit' });
    const t0 = Date.now();
    while (psql(`SELECT count(*) FROM engines WHERE name = 'devstack-2' AND id > ${last2}
        AND stopped_at IS NULL AND stats->>'state' = 'ready'`) !== '1') {
        assert.ok(Date.now() - t0 < 60000, 'engine 2 did not come back');
        await sleep(200);
    }
    const two = await rate(16, 10);
    const ratio = two.perS / one.perS;
    console.log(`scaling: one engine ${one.perS.toFixed(1)} tokens/s (${one.tokens} in ${one.seconds.toFixed(2)} s), ` +
        `two ${two.perS.toFixed(1)} tokens/s (${two.tokens} in ${two.seconds.toFixed(2)} s): ${ratio.toFixed(2)}x`);
    assert.ok(ratio >= 1.8, `two engines give ${ratio.toFixed(2)}x one engine's tokens/s`);
});
