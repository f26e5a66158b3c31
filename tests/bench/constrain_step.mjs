// constrain_step.mjs - the cost of response_format: decode time per step with 8 concurrent
// chat requests, unconstrained and constrained (json_object, json_schema), on a devstack
// (run by tests/bench/run_constrain.sh; prints numbers for docs/perf.md, asserts nothing
// but that every constrained output parses).
//
// Each request: a short prompt, thinking off, temperature 1, a fixed seed, MAX_TOKENS
// tokens (the random demo model almost never samples its end-of-sequence id, so all run
// to max_tokens). Per request the engine's own timings (GET /v1/jobs: first token to
// finish, over the tokens after the first) give its time per step while the 8 decode
// together; the figure is the median over the 8, then over ROUNDS rounds.
const URL_ = process.env.GLMSPARK_URL, KEY = process.env.GLMSPARK_KEY, MODEL = process.env.GLMSPARK_MODEL;
const ROUNDS = Number(process.env.ROUNDS || 5), BATCH = 8;
const MAX_TOKENS = (process.env.MAX_TOKENS || '160,1000').split(',').map(Number);

// Constrained modes that keep all 8 sequences decoding to max_tokens (a batch that thins
// out would make its steps cheaper): one long string (masks inside a string: the plain-token
// fast path and the cache), and a long array of enum words (masks between values: trie
// walks); json_object may end early (the random model closes its object at any point), so
// its token counts are printed with it.
const longString = { type: 'object', properties: { text: { type: 'string', minLength: 60000 } },
    required: ['text'], additionalProperties: false };
const longArray = { type: 'array', items: { enum: ['alpha', 'beta', 'gamma', 1, true, null] }, minItems: 4000 };
const modes = {
    text: undefined,
    json_string: { type: 'json_schema', json_schema: { name: 'text', schema: longString, strict: true } },
    json_array: { type: 'json_schema', json_schema: { name: 'words', schema: longArray, strict: true } },
    json_object: { type: 'json_object' },
};

async function call(method, path, body) {
    const r = await fetch(`${URL_}${path}`, { method, headers: { Authorization: `Bearer ${KEY}`,
        ...(body ? { 'Content-Type': 'application/json' } : {}) }, body: body ? JSON.stringify(body) : undefined });
    const j = await r.json();
    if (r.status !== 200) throw new Error(`HTTP ${r.status}: ${JSON.stringify(j)}`);
    return j;
}

async function one(rf, seed, maxTokens) {
    const body = { model: MODEL, temperature: 1, seed, max_tokens: maxTokens,
        chat_template_kwargs: { enable_thinking: false },
        messages: [{ role: 'user', content: `Describe person ${seed} as JSON.` }] };
    if (rf) body.response_format = rf;
    const r = await call('POST', '/v1/chat/completions', body);
    const job = await call('GET', `/v1/jobs/${r.id}`);
    const n = r.usage.completion_tokens;
    return { text: r.choices[0].message.content, n,
        ms: (job.timings.finished_at - job.timings.first_token_at) * 1e3 / Math.max(1, n - 1) };
}

const median = (a) => { const s = [...a].sort((x, y) => x - y); return s[Math.floor(s.length / 2)]; };
for (const maxTokens of MAX_TOKENS) {
    const results = {};
    for (let round = 0; round < ROUNDS; round++)
        for (const [name, rf] of Object.entries(modes)) {
            const outs = await Promise.all(Array.from({ length: BATCH }, (_, i) => one(rf, 1000 * round + i, maxTokens)));
            let valid = 0, checked = 0;
            for (const o of outs) {
                // The long modes' documents do not fit in max_tokens (cut, by design).
                if (!rf || (name !== 'json_object' && o.n === maxTokens)) continue;
                checked++;
                try { JSON.parse(o.text); valid++; } catch { console.log(`${name}: does not parse: ${o.text.slice(0, 200)}`); }
            }
            const per = median(outs.map((o) => o.ms));
            (results[name] ??= []).push(per);
            console.log(`max_tokens ${maxTokens} round ${round} ${name.padEnd(11)}: ${per.toFixed(2)} ms/step ` +
                `(median of ${BATCH}; tokens ${Math.min(...outs.map((o) => o.n))}-${Math.max(...outs.map((o) => o.n))})` +
                (checked ? `, ${valid}/${checked} parse` : ''));
        }
    const base = median(results.text);
    for (const [name, v] of Object.entries(results))
        console.log(`max_tokens ${maxTokens}: ${name.padEnd(11)} ${median(v).toFixed(2)} ms/step over ${ROUNDS} rounds` +
            (name === 'text' ? '' : ` (${((median(v) / base - 1) * 100).toFixed(1)}% vs text)`));
}
