/*
 * serve_stats.c - glmspark-engine's status JSON (serve_stats.h).
 */
#include "engine/serve/serve_stats.h"

#include <json-c/json.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void serve_stats_step(ServeStats *s, const ServeStep *step)
{
    s->steps_total++;
    s->generated_tokens_total += (uint64_t) step->n_generated;
    if (step->n_seqs > 0 && step->n_tokens == step->n_seqs) {
        s->decode_steps_total++;
        s->decode_step_ms_total += step->ms;
        s->decode_commit_ms_total += step->commit_ms;
    }
    if (s->n == SERVE_STATS_RING) {
        s->head = (s->head + 1) % SERVE_STATS_RING;
        s->n--;
    }
    s->ring[(s->head + s->n++) % SERVE_STATS_RING] = *step;
}

void serve_stats_prompt(ServeStats *s, int n)
{
    s->prompt_tokens_total += (uint64_t) n;
}

static void add_int(json_object *o, const char *k, int64_t v)
{
    json_object_object_add(o, k, json_object_new_int64(v));
}

static void add_num(json_object *o, const char *k, double v)
{
    json_object_object_add(o, k, json_object_new_double(v));
}

static void add_str(json_object *o, const char *k, const char *v)
{
    json_object_object_add(o, k, json_object_new_string(v ? v : ""));
}

char *serve_stats_json(const ServeStats *s, double now_mono, double now_unix)
{
    // The window: steps that ended in the last SERVE_STATS_WINDOW_S seconds. Batch
    // averages are over the steps that produced tokens (prefill-only steps have no
    // sequence to count).
    double ms_sum = 0, ms_max = 0, commit_sum = 0, seqs = 0, toks = 0;
    int n_steps = 0, n_out_steps = 0;
    uint64_t n_gen = 0;
    for (int i = 0; i < s->n; i++) {
        const ServeStep *p = &s->ring[(s->head + i) % SERVE_STATS_RING];
        if (now_mono - p->t > SERVE_STATS_WINDOW_S) continue;
        n_steps++;
        ms_sum += p->ms;
        commit_sum += p->commit_ms;
        if (p->ms > ms_max) ms_max = p->ms;
        toks += p->n_tokens;
        n_gen += (uint64_t) p->n_generated;
        if (p->n_seqs > 0) {
            n_out_steps++;
            seqs += p->n_seqs;
        }
    }
    json_object *o = json_object_new_object(), *ranks = json_object_new_array();
    add_int(o, "version", 1);
    add_num(o, "updated_unix", now_unix);
    add_str(o, "backend", s->backend);
    add_str(o, "model", s->model);
    add_int(o, "world", s->world);
    add_str(o, "state", s->state);
    for (int r = 0; r < s->world && r < PP_MAX_WORLD; r++) {
        const ServeRank *k = &s->ranks[r];
        json_object *j = json_object_new_object();
        add_int(j, "rank", r);
        add_str(j, "host", k->host);
        add_int(j, "pid", k->pid);
        add_str(j, "state", k->state ? k->state : "loading");
        add_int(j, "first_layer", k->first_layer);
        add_int(j, "last_layer", k->last_layer);
        add_int(j, "weight_bytes", (int64_t) k->weight_bytes);
        add_num(j, "load_fraction", k->load_fraction);
        json_object_array_add(ranks, j);
    }
    json_object_object_add(o, "ranks", ranks);
    add_int(o, "kv_blocks_total", s->kv_blocks_total);
    add_int(o, "kv_blocks_used", s->kv_blocks_used);
    add_int(o, "kv_block_size", s->kv_block_size);
    add_int(o, "max_num_seqs", s->max_num_seqs);
    add_int(o, "running", s->running);
    add_int(o, "waiting", s->waiting);
    add_int(o, "inflight_microbatches", s->inflight);
    add_int(o, "steps_total", (int64_t) s->steps_total);
    add_num(o, "step_ms_avg", n_steps ? ms_sum / n_steps : 0.0);
    add_num(o, "step_ms_max", ms_max);
    add_num(o, "commit_ms_avg", n_steps ? commit_sum / n_steps : 0.0);
    add_int(o, "decode_steps_total", (int64_t) s->decode_steps_total);
    add_num(o, "decode_step_ms_total", s->decode_step_ms_total);
    add_num(o, "decode_commit_ms_total", s->decode_commit_ms_total);
    add_num(o, "batch_seqs_avg", n_out_steps ? seqs / n_out_steps : 0.0);
    add_num(o, "batch_tokens_avg", n_steps ? toks / n_steps : 0.0);
    add_int(o, "prompt_tokens_total", (int64_t) s->prompt_tokens_total);
    add_int(o, "generated_tokens_total", (int64_t) s->generated_tokens_total);
    add_num(o, "tokens_per_s", (double) n_gen / SERVE_STATS_WINDOW_S);
    add_int(o, "prefix_query_tokens_total", (int64_t) s->prefix_query_tokens);
    add_int(o, "prefix_hit_tokens_total", (int64_t) s->prefix_hit_tokens);
    add_int(o, "prefix_cached_blocks", s->prefix_blocks);
    add_int(o, "prefix_idle_blocks", s->prefix_blocks_idle);
    add_int(o, "window_s", SERVE_STATS_WINDOW_S);
    const char *t = json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN);
    char *out = t ? strdup(t) : NULL;
    json_object_put(o);
    return out;
}
