// prefix_ttft.mjs - time to first token with a long shared prompt prefix, with and without
// the engine's prefix cache (run by tests/bench/run_prefix.sh against a devstack; prints
// numbers for docs/perf.md, asserts nothing).
//
// A system prompt of about PREFIX_TOKENS tokens is sent with four different questions, one
// request at a time (greedy, 4 tokens): the first finds nothing cached, the next three share
// its prefix. TTFT is the job's own (GET /v1/jobs: first token - claim, no queueing).
const URL_ = process.env.GLMSPARK_URL, KEY = process.env.GLMSPARK_KEY, MODEL = process.env.GLMSPARK_MODEL;
const WANT = Number(process.env.PREFIX_TOKENS || 4000);
const MODE = process.env.MODE || 'on';

async function post(body) {
    const r = await fetch(`${URL_}/v1/chat/completions`, {
        method: 'POST', headers: { Authorization: `Bearer ${KEY}`, 'Content-Type': 'application/json' },
        body: JSON.stringify(body) });
    const j = await r.json();
    if (r.status !== 200) throw new Error(`HTTP ${r.status}: ${JSON.stringify(j)}`);
    return j;
}
async function job(id) {
    const r = await fetch(`${URL_}/v1/jobs/${id}`, { headers: { Authorization: `Bearer ${KEY}` } });
    return r.json();
}
const ask = (system, q) => post({ model: MODEL, temperature: 0, max_tokens: 4,
    messages: [{ role: 'system', content: system }, { role: 'user', content: q }] });

// A system prompt of about WANT tokens: sentences counted through a probe request.
const sentence = (i) => `Clause ${i}: the assistant keeps every answer short, exact and polite. `;
let n = 100, system = '';
for (let k = 0; k < 4; k++) {
    system = Array.from({ length: n }, (_, i) => sentence(i)).join('');
    const probe = await post({ model: MODEL, max_tokens: 1, messages: [{ role: 'system', content: system },
        { role: 'user', content: `Probe ${k} ${MODE}` }] });
    const got = probe.usage.prompt_tokens;
    if (Math.abs(got - WANT) < 60) break;
    n = Math.max(1, Math.round(n * WANT / got));
}
// The probes share the prefix too: start from a prefix nobody has sent (a leading nonce).
system = `Session ${MODE}-${Date.now()}. ` + system;
const rows = [];
for (let q = 0; q < 4; q++) {
    const r = await ask(system, `Question ${q}: what is ${q} + ${q}?`);
    const j = await job(r.id);
    rows.push({ q, prompt: r.usage.prompt_tokens, cached: r.usage.prompt_tokens_details.cached_tokens,
                ttft: j.timings.ttft_s });
}
for (const r of rows)
    console.log(`prefix cache ${MODE}: request ${r.q}: ${r.prompt} prompt tokens, ${r.cached} cached, TTFT ${(r.ttft * 1000).toFixed(0)} ms`);
