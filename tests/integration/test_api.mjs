// test_api.mjs - the serving stack end to end with the official `openai` npm client.
//
// run.sh starts a fresh stack (ops/devstack with its own var/ and ports) and passes its
// URL, keys and paths in the environment. Everything goes through nginx over HTTPS, with
// the stack's self-signed certificate trusted through NODE_EXTRA_CA_CERTS.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import OpenAI from 'openai';
import Ajv from 'ajv';

const URL_ = process.env.GLMSPARK_URL;
const ADMIN = process.env.GLMSPARK_ADMIN_KEY;
const USER = process.env.GLMSPARK_USER_KEY;
const OTHER = process.env.GLMSPARK_OTHER_KEY;
const REVOKED = process.env.GLMSPARK_REVOKED_KEY;
const CONC1 = process.env.GLMSPARK_CONC1_KEY;
const RPM2 = process.env.GLMSPARK_RPM2_KEY;
const MODEL = process.env.GLMSPARK_MODEL;
const DEVSTACK = process.env.GLMSPARK_DEVSTACK;
const VAR = process.env.GLMSPARK_VAR;

const client = (key = USER) => new OpenAI({ baseURL: `${URL_}/v1`, apiKey: key, maxRetries: 0 });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function api(path, { key = USER, method = 'GET', body, headers = {} } = {}) {
    const res = await fetch(`${URL_}${path}`, {
        method,
        headers: { Authorization: `Bearer ${key}`, 'Content-Type': 'application/json', ...headers },
        body: body === undefined ? undefined : typeof body === 'string' ? body : JSON.stringify(body),
    });
    const text = await res.text();
    let json = null;
    try { json = JSON.parse(text); } catch { /* not JSON */ }
    return { status: res.status, headers: res.headers, json, text };
}

// Read an SSE stream of /v1/jobs/{id}/events; stop after `limit` chunk events (or at the end).
async function readEvents(id, { key = USER, lastEventId, limit = Infinity } = {}) {
    const ac = new AbortController();
    const headers = { Authorization: `Bearer ${key}` };
    if (lastEventId !== undefined) headers['Last-Event-ID'] = String(lastEventId);
    const res = await fetch(`${URL_}/v1/jobs/${id}/events`, { headers, signal: ac.signal });
    assert.equal(res.status, 200);
    assert.match(res.headers.get('content-type'), /text\/event-stream/);
    const events = [];
    let end = null, done = false, buf = '';
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    outer: for (;;) {
        const { value, done: eof } = await reader.read();
        if (eof) break;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf('\n\n')) >= 0) {
            const block = buf.slice(0, i);
            buf = buf.slice(i + 2);
            let id = null, data = null;
            for (const line of block.split('\n')) {
                if (line.startsWith('id: ')) id = Number(line.slice(4));
                else if (line.startsWith('data: ')) data = line.slice(6);
            }
            if (data === null) continue;  // keep-alive comment
            if (data === '[DONE]') { done = true; break outer; }
            const obj = JSON.parse(data);
            if (id !== null) {
                assert.equal(obj.seq, id);
                events.push(obj);
                if (events.length >= limit) { ac.abort(); break outer; }
            } else {
                end = obj;
            }
        }
    }
    return { events, end, done };
}

async function waitJob(id, pred, key = USER, timeoutMs = 60000) {
    const t0 = Date.now();
    for (;;) {
        const r = await api(`/v1/jobs/${id}`, { key });
        assert.equal(r.status, 200);
        if (pred(r.json)) return r.json;
        if (Date.now() - t0 > timeoutMs) assert.fail(`job ${id} stuck: ${r.text}`);
        await sleep(100);
    }
}

const chatBody = (extra = {}) => ({
    model: MODEL, messages: [{ role: 'user', content: 'Hello there' }], max_tokens: 8, ...extra,
});

test('models: list and retrieve', async () => {
    const list = await client().models.list();
    assert.deepEqual(list.data.map((m) => m.id), [MODEL]);
    const m = await client().models.retrieve(MODEL);
    assert.equal(m.id, MODEL);
});

test('prefix caching: a repeated long prompt reuses cached blocks, same answer', async () => {
    // A system prompt of a few hundred tokens (the engine's blocks hold 128), asked twice.
    const system = Array.from({ length: 60 }, (_, i) => `Rule ${i}: answer briefly and politely.`).join(' ');
    const body = chatBody({ temperature: 0, max_tokens: 6,
        messages: [{ role: 'system', content: system }, { role: 'user', content: 'Hello there' }] });
    const first = await client().chat.completions.create(body);
    const second = await client().chat.completions.create(body);
    assert.ok(first.usage.prompt_tokens > 300, `prompt of ${first.usage.prompt_tokens} tokens`);
    assert.equal(first.usage.prompt_tokens_details.cached_tokens, 0);
    const cached = second.usage.prompt_tokens_details.cached_tokens;
    assert.ok(cached >= 256 && cached % 128 === 0 && cached < second.usage.prompt_tokens,
        `cached_tokens ${cached} of ${second.usage.prompt_tokens}`);
    assert.equal(second.choices[0].message.content, first.choices[0].message.content);
    // Streamed with include_usage: the same figure in the last chunk; and in GET /v1/jobs.
    const stream = await client().chat.completions.create({ ...body, stream: true,
        stream_options: { include_usage: true } });
    let usage = null;
    for await (const ev of stream) if (ev.usage) usage = ev.usage;
    assert.ok(usage && usage.prompt_tokens_details.cached_tokens >= cached);
    const job = await api(`/v1/jobs/${second.id}`);
    assert.equal(job.json.usage.prompt_tokens_details.cached_tokens, cached);
    // The engine publishes its counters with its heartbeat (every second): wait for one.
    let hits = null;
    for (const deadline = Date.now() + 10000; Date.now() < deadline;) {
        const m = await api('/metrics', { key: ADMIN });
        hits = m.text.match(/^glmspark_engine_prefix_cache_hit_tokens_total\{[^}]*\} (\d+)$/m);
        if (hits && Number(hits[1]) >= cached) break;
        await sleep(250);
    }
    assert.ok(hits && Number(hits[1]) >= cached,
        `the engine counts the hits in /metrics (${hits ? hits[1] : 'no series'}, want >= ${cached})`);
});

// response_format: the demo model is random, so only the constraint makes its output JSON.
// Outputs are parsed and validated with ajv (a validator no one here wrote).
const PERSON = { type: 'object', properties: {
    name: { type: 'string', minLength: 1, maxLength: 24 }, age: { type: 'integer' },
    tags: { type: 'array', items: { enum: ['red', 'green', 'blue'] }, minItems: 1, maxItems: 3 },
    address: { anyOf: [{ type: 'null' }, { $ref: '#/$defs/addr' }] } },
    required: ['name', 'age', 'tags', 'address'], additionalProperties: false,
    $defs: { addr: { type: 'object', properties: { city: { type: 'string', maxLength: 20 },
        zip: { type: 'string', minLength: 5, maxLength: 5 } }, required: ['city', 'zip'] } } };
const validPerson = new Ajv({ strict: false }).compile(PERSON);
const jsonBody = (response_format, extra = {}) => chatBody({ temperature: 1, seed: 7, max_tokens: 120,
    chat_template_kwargs: { enable_thinking: false }, response_format, ...extra,
    messages: [{ role: 'user', content: 'Describe a person as JSON.' }] });

test('response_format json_object: chat, streamed and not, output parses', async () => {
    for (const seed of [1, 2, 3]) {
        const r = await client().chat.completions.create(jsonBody({ type: 'json_object' }, { seed }));
        const text = r.choices[0].message.content;
        const v = JSON.parse(text);
        assert.equal(typeof v, 'object');
        assert.ok(v && !Array.isArray(v), text);
    }
    const stream = await client().chat.completions.create({ ...jsonBody({ type: 'json_object' }), stream: true });
    let text = '';
    for await (const ev of stream) text += ev.choices[0]?.delta?.content ?? '';
    assert.ok(JSON.parse(text) && typeof JSON.parse(text) === 'object', text);
});

test('response_format json_schema: outputs validate against the schema (chat, stream, completions)', async () => {
    const rf = { type: 'json_schema', json_schema: { name: 'person', schema: PERSON, strict: true } };
    for (const seed of [11, 12, 13, 14]) {
        const r = await client().chat.completions.create(jsonBody(rf, { seed }));
        const v = JSON.parse(r.choices[0].message.content);
        assert.ok(validPerson(v), `${r.choices[0].message.content}: ${JSON.stringify(validPerson.errors)}`);
    }
    // Greedy: the same document streamed and not.
    const greedy = jsonBody(rf, { temperature: 0 });
    const once = await client().chat.completions.create(greedy);
    const stream = await client().chat.completions.create({ ...greedy, stream: true });
    let text = '';
    for await (const ev of stream) text += ev.choices[0]?.delta?.content ?? '';
    assert.equal(text, once.choices[0].message.content);
    assert.ok(validPerson(JSON.parse(text)));
    // Legacy completions take response_format too.
    const c = await client().completions.create({ model: MODEL, prompt: 'A person:', max_tokens: 120, seed: 5,
        temperature: 1, response_format: rf });
    assert.ok(validPerson(JSON.parse(c.choices[0].text)), c.choices[0].text);
    // max_tokens too small for any document: the output is cut (finish_reason length).
    const short = await client().chat.completions.create(jsonBody(rf, { max_tokens: 3 }));
    assert.equal(short.choices[0].finish_reason, 'length');
});

test('response_format: a bad or unsupported schema is a 400 naming the keyword', async () => {
    const bad = async (response_format, extra = {}) => {
        try {
            await client().chat.completions.create(jsonBody(response_format, extra));
        } catch (e) {
            assert.ok(e instanceof OpenAI.BadRequestError, String(e));
            return e;
        }
        assert.fail(`accepted ${JSON.stringify(response_format)}`);
    };
    const schema = (s) => ({ type: 'json_schema', json_schema: { name: 'x', schema: s } });
    let e = await bad(schema({ type: 'object', properties: { id: { type: 'string', pattern: '^a' } } }));
    assert.equal(e.param, 'response_format.json_schema.schema');
    assert.match(e.message, /unsupported keyword 'pattern' at \/properties\/id/);
    e = await bad(schema({ type: 'integer', minimum: 0 }));
    assert.match(e.message, /'minimum'/);
    e = await bad(schema({ $ref: '#/$defs/n', $defs: { n: { type: 'array', items: { $ref: '#/$defs/n' } } } }));
    assert.match(e.message, /recursive '\$ref'/);
    e = await bad({ type: 'xml' });
    assert.equal(e.param, 'response_format.type');
    e = await bad({ type: 'json_schema', json_schema: { schema: { type: 'object' } } });
    assert.equal(e.param, 'response_format.json_schema.name');
    e = await bad({ type: 'json_object' }, { tools: [{ type: 'function', function: { name: 'f', parameters: {} } }],
        tool_choice: 'required' });
    assert.equal(e.param, 'response_format');
});

test('chat: non-streamed answer with usage', async () => {
    const r = await client().chat.completions.create(chatBody({ temperature: 0 }));
    assert.match(r.id, /^job-[0-9a-f]{32}$/);
    assert.equal(r.object, 'chat.completion');
    assert.equal(r.model, MODEL);
    assert.equal(r.choices.length, 1);
    assert.equal(r.choices[0].message.role, 'assistant');
    assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
    assert.ok(r.usage.prompt_tokens > 0);
    assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 8);
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
    // The answer is the job's stored output.
    const job = await api(`/v1/jobs/${r.id}`);
    assert.equal(job.json.state, 'succeeded');
    assert.equal(job.json.output.content, r.choices[0].message.content);
    assert.equal(job.json.output.reasoning_content, r.choices[0].message.reasoning_content ?? '');
});

test('chat: stream with include_usage equals the stored output', async () => {
    const stream = await client().chat.completions.create(
        chatBody({ stream: true, stream_options: { include_usage: true }, max_tokens: 12, seed: 7 }));
    let content = '', reasoning = '', id = null, finish = null, usage = null, n = 0;
    for await (const chunk of stream) {
        id ??= chunk.id;
        assert.equal(chunk.id, id);
        if (chunk.usage) usage = chunk.usage;
        for (const ch of chunk.choices) {
            n++;
            content += ch.delta.content ?? '';
            reasoning += ch.delta.reasoning_content ?? '';
            if (ch.finish_reason) finish = ch.finish_reason;
        }
    }
    assert.ok(n >= 2);
    assert.ok(finish === 'length' || finish === 'stop');
    assert.ok(usage && usage.completion_tokens >= 1 && usage.completion_tokens <= 12);
    const job = await api(`/v1/jobs/${id}`);
    assert.equal(job.json.output.content, content);
    assert.equal(job.json.output.reasoning_content, reasoning);
    assert.equal(job.json.usage.completion_tokens, usage.completion_tokens);
});

test('completions: non-streamed and streamed', async () => {
    const r = await client().completions.create({ model: MODEL, prompt: 'Once upon a time', max_tokens: 6 });
    assert.equal(r.object, 'text_completion');
    assert.equal(typeof r.choices[0].text, 'string');
    assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 6);
    const stream = await client().completions.create(
        { model: MODEL, prompt: 'Once upon a time', max_tokens: 6, stream: true });
    let text = '', id = null;
    for await (const chunk of stream) { id ??= chunk.id; text += chunk.choices[0]?.text ?? ''; }
    const job = await api(`/v1/jobs/${id}`);
    assert.equal(job.json.output.content, text);
});

test('errors: statuses and OpenAI error classes', async () => {
    await assert.rejects(client('gsk_AAAAAAAAAAAA_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA').models.list(),
        (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
    await assert.rejects(client('not-a-key').models.list(), (e) => e.status === 401);
    await assert.rejects(client().chat.completions.create({ ...chatBody(), model: 'gpt-4o' }),
        (e) => e instanceof OpenAI.NotFoundError && e.code === 'model_not_found');
    await assert.rejects(client().chat.completions.create(chatBody({ temperature: 5 })),
        (e) => e instanceof OpenAI.BadRequestError && e.param === 'temperature');
    await assert.rejects(client().chat.completions.create({ model: MODEL, messages: [] }),
        (e) => e instanceof OpenAI.BadRequestError && e.param === 'messages');
    // Too long for the context: 400 context_length_exceeded and no job row.
    const before = (await api('/v1/jobs?limit=1', { key: ADMIN })).json.data[0]?.id;
    await assert.rejects(client().chat.completions.create(
        chatBody({ messages: [{ role: 'user', content: 'hello world '.repeat(5000) }] })),
        (e) => e instanceof OpenAI.BadRequestError && e.code === 'context_length_exceeded');
    const after = (await api('/v1/jobs?limit=1', { key: ADMIN })).json.data[0]?.id;
    assert.equal(after, before);
    // Raw bodies the client would never send.
    for (const body of ['{"model":', '[1,2]', '{"model":"x","messages":"\\u0000"}',
        '{"model":"' + MODEL + '","messages":[{"role":"user","content":"a"}],"max_tokens":NaN}',
        '['.repeat(100) + ']'.repeat(100)]) {
        const r = await api('/v1/chat/completions', { method: 'POST', body });
        assert.equal(r.status, 400, body.slice(0, 40));
        assert.equal(r.json.error.type, 'invalid_request_error');
    }
    const unknown = await api('/v1/nothing-here');
    assert.equal(unknown.status, 404);
    const wrongMethod = await api('/v1/chat/completions');
    assert.equal(wrongMethod.status, 405);
});

test('auth: revoked key, key in the query string, scope, other key\'s job', async () => {
    await assert.rejects(client(REVOKED).models.list(), (e) => e.status === 401);
    const q = await fetch(`${URL_}/v1/models?api_key=${USER}`, { headers: { Authorization: `Bearer ${USER}` } });
    assert.equal(q.status, 401);
    assert.equal((await q.json()).error.code, 'api_key_in_query');
    assert.equal((await api('/metrics')).status, 403);
    const m = await api('/metrics', { key: ADMIN });
    assert.equal(m.status, 200);
    assert.match(m.text, /^glmspark_queue_depth \d+$/m);
    assert.match(m.text, /^glmspark_engine_up 1$/m);
    const job = await api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 2 }) });
    assert.equal(job.status, 202);
    assert.equal((await api(`/v1/jobs/${job.json.id}`, { key: OTHER })).status, 404);
    assert.equal((await api(`/v1/jobs/${job.json.id}/events`, { key: OTHER })).status, 404);
    assert.equal((await api(`/v1/jobs/${job.json.id}/cancel`, { key: OTHER, method: 'POST' })).status, 404);
    assert.equal((await api(`/v1/jobs/${job.json.id}`, { key: ADMIN })).status, 200);  // admins see all
    const mine = await api('/v1/jobs?limit=100', { key: OTHER });
    assert.ok(!mine.json.data.some((j) => j.id === job.json.id));
    await waitJob(job.json.id, (j) => j.state === 'succeeded');
    const health = await fetch(`${URL_}/health`);
    assert.equal(health.status, 200);
});

test('jobs: resume the event stream with Last-Event-ID', async () => {
    const job = await api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 40 }) });
    assert.equal(job.status, 202);
    assert.equal(job.json.state, 'queued');
    const id = job.json.id;
    const first = await readEvents(id, { limit: 5 });
    assert.equal(first.events.length, 5);
    assert.deepEqual(first.events.map((e) => e.seq), [0, 1, 2, 3, 4]);
    const rest = await readEvents(id, { lastEventId: 4 });
    assert.ok(rest.done);
    assert.equal(rest.end.state, 'succeeded');
    const all = [...first.events, ...rest.events];
    all.forEach((e, i) => assert.equal(e.seq, i));  // contiguous, no duplicate
    const final = await api(`/v1/jobs/${id}`);
    const text = (kind) => all.filter((e) => e.kind === kind).map((e) => e.text).join('');
    assert.equal(text('content'), final.json.output.content);
    assert.equal(text('reasoning'), final.json.output.reasoning_content);
    assert.equal(final.json.usage.completion_tokens, rest.end.usage.completion_tokens);
    const list = await api('/v1/jobs?limit=2');
    assert.equal(list.status, 200);
    assert.equal(list.json.data.length, 2);
    const next = await api(`/v1/jobs?limit=2&after=${list.json.data[1].id}`);
    assert.ok(next.json.data.every((j) => !list.json.data.some((k) => k.id === j.id)));
});

test('jobs: cancel a running and a queued job', async () => {
    const running = await api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 400 }) });
    const queued = await api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 400 }) });
    await waitJob(running.json.id, (j) => j.state === 'running' && j.usage.completion_tokens > 0);
    const q = await api(`/v1/jobs/${queued.json.id}/cancel`, { method: 'POST' });
    assert.equal(q.status, 200);
    assert.equal(q.json.state, 'cancelled');
    assert.equal(q.json.attempts, 0);  // never claimed
    const r = await api(`/v1/jobs/${running.json.id}/cancel`, { method: 'POST' });
    assert.equal(r.status, 200);
    const done = await waitJob(running.json.id, (j) => j.state !== 'running');
    assert.equal(done.state, 'cancelled');
    assert.ok(done.usage.completion_tokens < 400);
    const ev = await readEvents(running.json.id);
    assert.ok(ev.done);
    assert.equal(ev.end.state, 'cancelled');
    assert.equal((await api(`/v1/jobs/${queued.json.id}`)).json.attempts, 0);
});

test('limits: max-concurrent and rpm give 429 with Retry-After', async () => {
    const a = await api('/v1/jobs', { key: CONC1, method: 'POST', body: chatBody({ max_tokens: 30 }) });
    assert.equal(a.status, 202);
    const b = await api('/v1/jobs', { key: CONC1, method: 'POST', body: chatBody({ max_tokens: 30 }) });
    assert.equal(b.status, 429);
    assert.equal(b.json.error.code, 'concurrency_limit_exceeded');
    assert.ok(Number(b.headers.get('retry-after')) >= 1);
    await waitJob(a.json.id, (j) => j.state === 'succeeded', CONC1);
    const statuses = [];
    for (let i = 0; i < 3; i++)
        statuses.push((await api('/v1/jobs', { key: RPM2, method: 'POST', body: chatBody({ max_tokens: 1 }) })).status);
    assert.deepEqual(statuses, [202, 202, 429]);
    await assert.rejects(client(RPM2).chat.completions.create(chatBody()),
        (e) => e instanceof OpenAI.RateLimitError);
});

test('idempotency: a retried POST returns the same job', async () => {
    const h = { 'Idempotency-Key': `it-${process.pid}` };
    const a = await api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 2 }), headers: h });
    const b = await api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 2 }), headers: h });
    assert.equal(a.status, 202);
    assert.equal(b.json.id, a.json.id);
});

test('engine kill -9 mid-generation: the job completes with a contiguous stream', async () => {
    const job = await api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 60, seed: 3 }) });
    const id = job.json.id;
    await waitJob(id, (j) => j.state === 'running' && j.usage.completion_tokens >= 5);
    const pid = Number(readFileSync(`${VAR}/run/engine-1.pid`, 'utf8'));
    process.kill(pid, 'SIGKILL');
    await sleep(200);
    const mid = await api(`/v1/jobs/${id}`);
    assert.equal(mid.json.state, 'running');  // nobody has it now; the next engine resumes it
    execFileSync(DEVSTACK, ['restart', 'engine'], { stdio: 'inherit' });
    const ev = await readEvents(id);
    assert.ok(ev.done);
    assert.equal(ev.end.state, 'succeeded');
    ev.events.forEach((e, i) => assert.equal(e.seq, i));
    const final = await api(`/v1/jobs/${id}`);
    assert.equal(final.json.attempts, 2);
    const text = (kind) => ev.events.filter((e) => e.kind === kind).map((e) => e.text).join('');
    assert.equal(text('content'), final.json.output.content);
    assert.equal(text('reasoning'), final.json.output.reasoning_content);
    assert.ok(final.json.usage.completion_tokens <= 60);
    if (final.json.finish_reason === 'length') assert.equal(final.json.usage.completion_tokens, 60);
});

test('a client leaving a chat stream cancels its job', async () => {
    const stream = await client().chat.completions.create(chatBody({ max_tokens: 400, stream: true }));
    let id = null, n = 0;
    for await (const chunk of stream) {
        id ??= chunk.id;
        if (++n === 4) break;  // leaving the loop aborts the HTTP request
    }
    const job = await waitJob(id, (j) => j.state !== 'running' && j.state !== 'queued');
    assert.equal(job.state, 'cancelled');
    assert.ok(job.usage.completion_tokens < 400);
});

// Engines under other names share the queue (tests/integration/test_engine_serve.sh, scenario
// "two"); a second one under the name of the live devstack engine is refused.
test('a second engine under a live engine\'s name refuses to start', async () => {
    let status = 0, stderr = '';
    try {
        execFileSync(`${process.env.GLMSPARK_BIN}/glmspark-engine`,
            ['--model', `${VAR}/model/${MODEL}`, '--db', process.env.GLMSPARK_DB_APP,
                '--name', 'devstack'],
            { stdio: 'pipe', timeout: 60000 });
    } catch (e) {
        status = e.status;
        stderr = String(e.stderr);
    }
    assert.equal(status, 3);
    assert.match(stderr, /is named "devstack"/);
    const h = await fetch(`${URL_}/health`);
    assert.equal(h.status, 200);
});

test('stop strings end the output right before the match (greedy, so deterministic)', async () => {
    const base = { model: MODEL, prompt: 'The quick brown fox', max_tokens: 24, temperature: 0 };
    const full = (await client().completions.create(base)).choices[0].text;
    const cps = Array.from(full);
    assert.ok(cps.length >= 8, `output too short: ${JSON.stringify(full)}`);
    const stop = cps.slice(Math.floor(cps.length / 2), Math.floor(cps.length / 2) + 3).join('');
    const expected = full.slice(0, full.indexOf(stop));
    const r = await client().completions.create({ ...base, stop: [stop] });
    assert.equal(r.choices[0].text, expected);
    assert.equal(r.choices[0].finish_reason, 'stop');
    // Streamed, the stop string never shows either.
    const stream = await client().completions.create({ ...base, stop: stop, stream: true });
    let text = '';
    for await (const chunk of stream) text += chunk.choices[0]?.text ?? '';
    assert.equal(text, expected);
});

test('PostgreSQL restart mid-stream: engine and fcgi reconnect, the stream stays whole', async () => {
    const job = await api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 60, seed: 5 }) });
    const id = job.json.id;
    await waitJob(id, (j) => j.state === 'running' && j.usage.completion_tokens >= 5);
    const reading = readEvents(id);
    await sleep(200);
    execFileSync(DEVSTACK, ['restart', 'postgres'], { stdio: 'inherit' });
    const ev = await reading;
    assert.ok(ev.done);
    assert.equal(ev.end.state, 'succeeded');
    ev.events.forEach((e, i) => assert.equal(e.seq, i));
    const final = await api(`/v1/jobs/${id}`);
    const text = (kind) => ev.events.filter((e) => e.kind === kind).map((e) => e.text).join('');
    assert.equal(text('content'), final.json.output.content);
    assert.equal(text('reasoning'), final.json.output.reasoning_content);
    const after = await client().chat.completions.create(chatBody({ max_tokens: 2 }));
    assert.equal(after.object, 'chat.completion');
});

// ---------------------------------------------------------------------------
// logprobs, tool_choice, job owners and inputs, revocation, a full queue.

const isSortedDesc = (xs) => xs.every((x, i) => i === 0 || xs[i - 1] >= x);

test('logprobs: chat at temperature 0 samples the argmax; stream equals non-stream', async () => {
    const body = chatBody({ temperature: 0, max_tokens: 10, logprobs: true, top_logprobs: 5 });
    const r = await client().chat.completions.create(body);
    const entries = r.choices[0].logprobs.content;
    assert.equal(entries.length, r.usage.completion_tokens);  // one entry per generated token
    for (const e of entries) {
        assert.equal(typeof e.token, 'string');
        assert.ok(Array.isArray(e.bytes) && e.bytes.every((b) => Number.isInteger(b) && b >= 0 && b < 256));
        assert.ok(e.logprob <= 0);
        assert.equal(e.top_logprobs.length, 5);
        const lps = e.top_logprobs.map((t) => t.logprob);
        assert.ok(lps.every((x) => x <= 0));
        assert.ok(isSortedDesc(lps), JSON.stringify(lps));
        assert.ok(lps.reduce((a, x) => a + Math.exp(x), 0) <= 1 + 1e-6);  // a distribution
        // Greedy: the sampled token is the most likely one.
        assert.equal(e.logprob, lps[0]);
        if (lps[1] < lps[0]) assert.equal(e.token, e.top_logprobs[0].token);
    }
    const stream = await client().chat.completions.create({ ...body, stream: true, stream_options: { include_usage: true } });
    const streamed = [];
    let usage = null;
    for await (const chunk of stream) {
        if (chunk.usage) usage = chunk.usage;
        for (const ch of chunk.choices) if (ch.logprobs) streamed.push(...ch.logprobs.content);
    }
    assert.equal(streamed.length, usage.completion_tokens);
    assert.deepEqual(streamed, entries);  // greedy: the same tokens with the same numbers
    // Not asked for: null, as OpenAI's.
    const plain = await client().chat.completions.create(chatBody({ max_tokens: 2 }));
    assert.equal(plain.choices[0].logprobs, null);
    await assert.rejects(client().chat.completions.create(chatBody({ top_logprobs: 3 })),
        (e) => e instanceof OpenAI.BadRequestError && e.param === 'top_logprobs');
    await assert.rejects(client().chat.completions.create(chatBody({ logprobs: true, top_logprobs: 21 })),
        (e) => e instanceof OpenAI.BadRequestError && e.param === 'top_logprobs');
});

test('logprobs: completions (legacy shape), streamed and not', async () => {
    const base = { model: MODEL, prompt: 'Once upon a time', max_tokens: 8, temperature: 0, logprobs: 3 };
    const r = await client().completions.create(base);
    const lp = r.choices[0].logprobs;
    const n = r.usage.completion_tokens;
    assert.equal(lp.tokens.length, n);
    assert.equal(lp.token_logprobs.length, n);
    assert.equal(lp.top_logprobs.length, n);
    assert.equal(lp.text_offset.length, n);
    assert.ok(isSortedDesc(lp.text_offset.map((x) => -x)));  // non-decreasing offsets
    for (let i = 0; i < n; i++) {
        assert.ok(lp.token_logprobs[i] <= 0);
        const alts = Object.values(lp.top_logprobs[i]);
        assert.ok(alts.length >= 1 && alts.length <= 3);
        assert.equal(lp.token_logprobs[i], Math.max(...alts));  // greedy
    }
    const stream = await client().completions.create({ ...base, stream: true });
    const tokens = [], lps = [];
    for await (const chunk of stream)
        for (const ch of chunk.choices)
            if (ch.logprobs) { tokens.push(...ch.logprobs.tokens); lps.push(...ch.logprobs.token_logprobs); }
    assert.deepEqual(tokens, lp.tokens);
    assert.deepEqual(lps, lp.token_logprobs);
});

test('tool_choice: none renders without tools; required and named validated; bad values 400', async () => {
    const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather in a city',
        parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
    const run = (extra) => client().chat.completions.create(chatBody({ max_tokens: 1, ...extra }));
    const bare = await run({});
    const auto = await run({ tools });
    const none = await run({ tools, tool_choice: 'none' });
    assert.ok(auto.usage.prompt_tokens > bare.usage.prompt_tokens);   // tools are in the prompt
    assert.equal(none.usage.prompt_tokens, bare.usage.prompt_tokens);  // "none": not offered
    const explicitAuto = await run({ tools, tool_choice: 'auto' });
    assert.equal(explicitAuto.usage.prompt_tokens, auto.usage.prompt_tokens);
    const required = await run({ tools, tool_choice: 'required' });
    assert.equal(required.usage.prompt_tokens, auto.usage.prompt_tokens);
    const named = await run({ tools, tool_choice: { type: 'function', function: { name: 'get_weather' } } });
    assert.equal(named.usage.prompt_tokens, auto.usage.prompt_tokens);
    for (const tool_choice of ['sometimes', 7, { type: 'function' },
        { type: 'function', function: { name: 'no_such_function' } }])
        await assert.rejects(run({ tools, tool_choice }),
            (e) => e instanceof OpenAI.BadRequestError && e.param === 'tool_choice', JSON.stringify(tool_choice));
    await assert.rejects(run({ tool_choice: 'required' }),
        (e) => e instanceof OpenAI.BadRequestError && e.param === 'tool_choice');
});

test('tool_choice required and named: the call\'s name and arguments follow the tools (ajv)', async () => {
    const weather = { type: 'object', properties: { city: { type: 'string', maxLength: 30 },
        unit: { type: 'string', enum: ['celsius', 'fahrenheit'] }, days: { type: 'integer' },
        opts: { type: 'object', properties: { hourly: { type: 'boolean' } }, required: ['hourly'] } },
        required: ['city', 'days'] };
    const tools = [{ type: 'function', function: { name: 'get_weather', parameters: weather } },
        { type: 'function', function: { name: 'get_time', parameters: { type: 'object',
            properties: { tz: { type: 'string', maxLength: 40 } }, required: ['tz'] } } }];
    const ajv = new Ajv({ strict: false });
    const runs = [[{ type: 'function', function: { name: 'get_weather' } }, 1], [{ type: 'function', function: { name: 'get_weather' } }, 2],
        ['required', 3], ['required', 4], [{ type: 'function', function: { name: 'get_time' } }, 5]];
    for (const [tool_choice, seed] of runs) {
        const r = await client().chat.completions.create(chatBody({ temperature: 1, seed, max_tokens: 80, tools, tool_choice,
            chat_template_kwargs: { enable_thinking: false } }));
        assert.equal(r.choices[0].finish_reason, 'tool_calls');
        const call = r.choices[0].message.tool_calls[0];
        if (typeof tool_choice === 'object') assert.equal(call.function.name, tool_choice.function.name);
        const tool = tools.find((t) => t.function.name === call.function.name);
        assert.ok(tool, call.function.name);
        const args = JSON.parse(call.function.arguments);
        assert.ok(ajv.validate(tool.function.parameters, args), `${call.function.arguments}: ${ajv.errorsText()}`);
    }
    // A parameter schema outside the supported subset: a 400 naming the keyword.
    const bad = [{ type: 'function', function: { name: 'f', parameters: { type: 'object',
        properties: { d: { type: 'string', format: 'date' } } } } }];
    await assert.rejects(client().chat.completions.create(chatBody({ tools: bad, tool_choice: 'required' })),
        (e) => e instanceof OpenAI.BadRequestError && e.param === 'tools' && /unsupported keyword 'format'/.test(e.message));
    // tool_choice auto does not constrain, so its schemas are not checked.
    const auto = await client().chat.completions.create(chatBody({ tools: bad, max_tokens: 1 }));
    assert.equal(auto.choices.length, 1);
});

test('jobs: owner, scope and the caller\'s input', async () => {
    const messages = [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Name a colour' }];
    const job = await api('/v1/jobs', { method: 'POST', body: chatBody({ messages, max_tokens: 2 }) });
    assert.equal(job.status, 202);
    const got = await waitJob(job.json.id, (j) => j.state === 'succeeded');
    assert.equal(got.owner.name, 'it-user');
    assert.ok(got.owner.prefix.startsWith('gsk_') && USER.startsWith(got.owner.prefix), got.owner.prefix);
    assert.deepEqual(got.request.messages, messages);
    assert.ok(!JSON.stringify(got).includes(USER));  // never the key itself
    const mine = await api('/v1/jobs?limit=5');
    assert.equal(mine.json.scope, 'user');
    assert.ok(mine.json.data.every((j) => j.owner.name === 'it-user'));
    const all = await api('/v1/jobs?limit=100', { key: ADMIN });
    assert.equal(all.json.scope, 'admin');
    assert.equal(all.json.data.find((j) => j.id === job.json.id).owner.name, 'it-user');
    assert.equal((await api(`/v1/jobs/${job.json.id}`, { key: ADMIN })).json.request.messages[1].content, 'Name a colour');
    const c = await client().completions.create({ model: MODEL, prompt: 'Two plus two', max_tokens: 1 });
    assert.equal((await api(`/v1/jobs/${c.id}`)).json.request.prompt, 'Two plus two');
});

test('auth: a revoked key stops working at once (no cache delay)', async () => {
    const cli = (...args) => execFileSync(`${process.env.GLMSPARK_BIN}/glmspark`,
        [...args, '--db', process.env.GLMSPARK_DB_SUPER], { stdio: ['ignore', 'pipe', 'ignore'] }).toString().trim();
    const key = cli('keys', 'create', '--name', 'it-revoke-now');
    for (let i = 0; i < 3; i++) assert.equal((await api('/v1/models', { key })).status, 200);  // cached now
    cli('keys', 'revoke', 'it-revoke-now');
    const after = await api('/v1/models', { key });
    assert.equal(after.status, 401);
    assert.equal((await api('/v1/jobs', { key, method: 'POST', body: chatBody() })).status, 401);
    await assert.rejects(client(key).models.list(), (e) => e instanceof OpenAI.AuthenticationError);
});

test('queue full: 503 with an OpenAI error body and Retry-After', async () => {
    const long = chatBody({ max_tokens: 400 });
    const running = await api('/v1/jobs', { method: 'POST', body: long });
    assert.equal(running.status, 202);
    await waitJob(running.json.id, (j) => j.state === 'running');
    const queued = [];
    let full = null;
    for (let i = 0; i < 20 && !full; i++) {  // run.sh sets GLMSPARK_MAX_QUEUE=6
        const r = await api('/v1/jobs', { method: 'POST', body: long });
        if (r.status === 202) queued.push(r.json.id);
        else full = r;
    }
    try {
        assert.ok(full, 'the queue never filled');
        assert.equal(full.status, 503);
        assert.equal(full.json.error.code, 'queue_full');
        assert.equal(full.json.error.type, 'server_error');
        assert.equal(typeof full.json.error.message, 'string');
        assert.ok(Number(full.headers.get('retry-after')) >= 1);
        assert.ok(queued.length <= Number(process.env.GLMSPARK_MAX_QUEUE ?? 6));
        await assert.rejects(client().chat.completions.create(chatBody()),
            (e) => e instanceof OpenAI.InternalServerError && e.status === 503);
    } finally {
        for (const id of [...queued, running.json.id]) await api(`/v1/jobs/${id}/cancel`, { method: 'POST' });
    }
    await waitJob(running.json.id, (j) => j.state === 'cancelled');
    // Room again: a new job is accepted.
    const again = await api('/v1/jobs', { method: 'POST', body: chatBody({ max_tokens: 1 }) });
    assert.equal(again.status, 202);
    await waitJob(again.json.id, (j) => j.state === 'succeeded');
});

test('a long prefill keeps the lease and the engine heartbeat fresh', async () => {
    // An engine with a 3 s lease (so it beats every second) that prefills one token per
    // slice, 25 ms apart: a prompt of a few hundred tokens takes far longer than the lease.
    const psql = (sql) => execFileSync('psql', [process.env.GLMSPARK_DB_SUPER, '-Atc', sql]).toString().trim();
    const restart = (args) => execFileSync(DEVSTACK, ['restart', 'engine'],
        { stdio: 'inherit', env: { ...process.env, GLMSPARK_ENGINE_ARGS: args } });
    restart('--step-delay-ms 25 --prefill-slice 1 --lease-s 3');
    try {
        const content = 'one two three four five six seven eight nine ten '.repeat(40);
        const job = await api('/v1/jobs', { method: 'POST',
            body: chatBody({ messages: [{ role: 'user', content }], max_tokens: 1 }) });
        assert.equal(job.status, 202);
        assert.ok(job.json.prompt_tokens >= 300, `prompt of ${job.json.prompt_tokens} tokens`);
        const id = job.json.id;
        await waitJob(id, (j) => j.state === 'running');
        // Wait until the job has been prefilling for longer than the lease.
        const row = () => psql(`SELECT n_completion_tokens, extract(epoch FROM now() - claimed_at) > 4,
            lease_until > now(), (SELECT heartbeat_at > j.claimed_at + interval '2 seconds'
            FROM engines WHERE id = j.lease_epoch) FROM jobs j WHERE public_id = '${id}'`).split('|');
        let r = row();
        while (r[1] !== 't' && r[0] === '0') { await sleep(200); r = row(); }
        assert.equal(r[0], '0', 'the prefill ended before the lease would have run out; lengthen the prompt');
        assert.equal(r[2], 't');  // the lease was renewed during the prefill
        assert.equal(r[3], 't');  // and so was the engine's heartbeat
        assert.equal((await fetch(`${URL_}/health`)).status, 200);
        await api(`/v1/jobs/${id}/cancel`, { method: 'POST' });
        const done = await waitJob(id, (j) => j.state !== 'running' && j.state !== 'queued');
        assert.equal(done.state, 'cancelled');
        assert.equal(done.attempts, 1);  // never lost and re-claimed
    } finally {
        restart(process.env.GLMSPARK_ENGINE_ARGS);
    }
});
