// models.js - the served models as the UI offers them: the /v1/models list read, the pick made.
//
// GET /v1/models lists the models some live engine serves, in the OpenAI list format
// {object: "list", data: [{id, object: "model", owned_by, max_model_len?}]}; max_model_len is
// the model's context length in tokens (prompt and answer together). The user picks one in the
// header; app.js keeps the pick in localStorage (a preference, not a secret: it outlives the tab
// and sign-out) and restores it while it is still listed. A fallback to the first model is
// never written back, so a model that was down for a while is picked again once it returns.
// No DOM use here: tests/web/test_sse.mjs runs it under node.

export const MODEL_SLOT = 'glmspark.model';

// [{id, contextLen}] from a /v1/models response, in the server's order, each id once.
// contextLen: max_model_len when it is a positive integer, else null.
export function modelList(resp) {
  const data = resp && Array.isArray(resp.data) ? resp.data : [];
  const out = [];
  const seen = new Set();
  for (const m of data) {
    if (!m || (typeof m.id !== 'string' && typeof m.id !== 'number')) continue;
    const id = String(m.id);
    if (id === '' || seen.has(id)) continue;
    seen.add(id);
    const n = m.max_model_len;
    out.push({ id, contextLen: Number.isInteger(n) && n > 0 ? n : null });
  }
  return out;
}

// The model to use from list (modelList's): wanted while it is listed, else the first.
// Returns {id, missing}: id is '' for an empty list; missing is wanted when it was asked for
// and is not listed ('' otherwise), for the UI to say that it fell back.
export function pickModel(list, wanted) {
  const w = wanted ? String(wanted) : '';
  if (w && list.some((m) => m.id === w)) return { id: w, missing: '' };
  return { id: list.length ? list[0].id : '', missing: w };
}

// The sentence on the context length of model m ({id, contextLen}), or '' when unknown.
export function contextHint(m) {
  if (!m || !m.contextLen) return '';
  return `${m.id} reads at most ${m.contextLen} tokens: the prompt and the answer together.`;
}
