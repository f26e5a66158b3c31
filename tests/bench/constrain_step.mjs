// constrain_step.mjs - the cost of response_format: decode time per step with 8 concurrent
// streamed chat requests, unconstrained and constrained (json_object, json_schema), on a
// devstack (run by tests/bench/run_constrain.sh; prints numbers for docs/perf.md, asserts
// nothing but that every constrained output parses).
//
// Each request: a short prompt, thinking off, temperature 1, a fixed seed, MAX_TOKENS
// tokens (the random demo model almost never samples its end-of-sequence id, so all run
// to max_tokens). Per request: (last chunk - first chunk) / (tokens - 1) is its time per
// step while all 8 decode together; the figure is the median over the 8.
const URL_ = process.env.GLMSPARK_URL, KEY = process.env.GLMSPARK_KEY, MODEL = process.env.GLMSPARK_MODEL;
const MAX_TOKENS = Number(process.env.MAX_TOKENS || 160), BATCH = 8, ROUNDS = Number(process.env.ROUNDS || 3);

const schema = { type: 'object', properties: {
    name: { type: 'string', maxLength: 40 }, age: { type: 'integer' },
    tags: { type: 'array', items: { type: 'string', maxLength: 12 }, maxItems: 8 },
    address: { type: 'object', properties: { city: { type: 'string' }, zip: { type: 'string', maxLength: 10 } },
        required: ['city'] } }, required: ['name', 'age', 'tags', 'address'] };
const modes = {
    text: undefined,
    json_object: { type: 'json_object' },
    json_schema: { type: 'json_schema', json_schema: { name: 'person', schema, strict: true } },
};

async function one(rf, seed) {
    const body = { model: MODEL, stream: true, temperature: 1, seed, max_tokens: MAX_TOKENS,
        chat_template_kwargs: { enable_thinking: false },
        messages: [{ role: 'user', content: `Describe person ${seed} as JSON.` }] };
    if (rf) body.response_format = rf;
    const r = await fetch(`${URL_}/v1/chat/completions`, { method: 'POST',
        headers: { Authorization: `Bearer ${KEY}`, 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
    if (r.status !== 200) throw new Error(`HTTP ${r.status}: ${await r.text()}`);
    const dec = new TextDecoder();
    let buf = '', text = '', first = 0, last = 0, chunks = 0;
    for await (const part of r.body) {
        buf += dec.decode(part, { stream: true });
        let k;
        while ((k = buf.indexOf('\n\n')) >= 0) {
            const ev = buf.slice(0, k);
            buf = buf.slice(k + 2);
            if (!ev.startsWith('data: ') || ev === 'data: [DONE]') continue;
            const d = JSON.parse(ev.slice(6));
            const c = d.choices?.[0]?.delta?.content;
            if (c) {
                const t = performance.now();
                if (!first) first = t;
                last = t;
                chunks++;
                text += c;
            }
        }
    }
    return { text, first, last, chunks };
}

const median = (a) => { const s = [...a].sort((x, y) => x - y); return s[Math.floor(s.length / 2)]; };
const results = {};
for (let round = 0; round < ROUNDS; round++)
    for (const [name, rf] of Object.entries(modes)) {
        const t0 = performance.now();
        const outs = await Promise.all(Array.from({ length: BATCH }, (_, i) => one(rf, 1000 * round + i)));
        const wall = performance.now() - t0;
        let valid = 0;
        for (const o of outs) {
            if (!rf) continue;
            try { JSON.parse(o.text); valid++; } catch { console.log(`${name}: does not parse: ${o.text.slice(0, 200)}`); }
        }
        // Streamed chunks can merge tokens: time per step from the job's token count.
        const per = outs.map((o) => (o.last - o.first) / Math.max(1, MAX_TOKENS - 1));
        (results[name] ??= []).push(median(per));
        console.log(`round ${round} ${name.padEnd(11)}: ${median(per).toFixed(2)} ms/step (median of ${BATCH}), ` +
            `wall ${wall.toFixed(0)} ms${rf ? `, ${valid}/${BATCH} parse` : ''}`);
    }
const base = median(results.text);
for (const [name, v] of Object.entries(results))
    console.log(`${name.padEnd(11)}: ${median(v).toFixed(2)} ms/step over ${ROUNDS} rounds` +
        (name === 'text' ? '' : ` (${((median(v) / base - 1) * 100).toFixed(1)}% vs text)`));
