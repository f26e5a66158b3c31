/*
 * stats.c - parse the engine's status JSON (see stats.h).
 *
 * Fields are described by a table (key, kind, offset) so that the engine object and each
 * rank object go through the same loop: a missing key keeps its zero, a present one must
 * have the kind's JSON type (any number for a number, a string for text).
 */
#include "engine/shared/stats.h"

#include <json-c/json.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

typedef enum FieldKind { FIELD_INT, FIELD_I64, FIELD_DOUBLE, FIELD_TEXT } FieldKind;

typedef struct Field {
    const char *key;
    FieldKind kind;
    size_t offset;
    size_t size;  // FIELD_TEXT: the buffer's size
} Field;

#define F(T, kind, name) {#name, kind, offsetof(T, name), sizeof(((T *) 0)->name)}

static const Field engine_fields[] = {
    F(EngineStats, FIELD_INT, version),
    F(EngineStats, FIELD_DOUBLE, updated_unix),
    F(EngineStats, FIELD_TEXT, backend),
    F(EngineStats, FIELD_TEXT, model),
    F(EngineStats, FIELD_INT, world),
    F(EngineStats, FIELD_TEXT, state),
    F(EngineStats, FIELD_I64, kv_blocks_total),
    F(EngineStats, FIELD_I64, kv_blocks_used),
    F(EngineStats, FIELD_I64, kv_block_size),
    F(EngineStats, FIELD_I64, max_num_seqs),
    F(EngineStats, FIELD_I64, running),
    F(EngineStats, FIELD_I64, waiting),
    F(EngineStats, FIELD_I64, inflight_microbatches),
    F(EngineStats, FIELD_I64, steps_total),
    F(EngineStats, FIELD_DOUBLE, step_ms_avg),
    F(EngineStats, FIELD_DOUBLE, step_ms_max),
    F(EngineStats, FIELD_DOUBLE, commit_ms_avg),
    F(EngineStats, FIELD_I64, decode_steps_total),
    F(EngineStats, FIELD_DOUBLE, decode_step_ms_total),
    F(EngineStats, FIELD_DOUBLE, decode_commit_ms_total),
    F(EngineStats, FIELD_DOUBLE, batch_seqs_avg),
    F(EngineStats, FIELD_DOUBLE, batch_tokens_avg),
    F(EngineStats, FIELD_I64, prompt_tokens_total),
    F(EngineStats, FIELD_I64, generated_tokens_total),
    F(EngineStats, FIELD_DOUBLE, tokens_per_s),
    F(EngineStats, FIELD_DOUBLE, window_s),
    F(EngineStats, FIELD_I64, prefix_query_tokens_total),
    F(EngineStats, FIELD_I64, prefix_hit_tokens_total),
    F(EngineStats, FIELD_I64, prefix_cached_blocks),
    F(EngineStats, FIELD_I64, prefix_idle_blocks),
};

static const Field rank_fields[] = {
    F(StatsRank, FIELD_INT, rank),
    F(StatsRank, FIELD_TEXT, host),
    F(StatsRank, FIELD_INT, pid),
    F(StatsRank, FIELD_TEXT, state),
    F(StatsRank, FIELD_INT, first_layer),
    F(StatsRank, FIELD_INT, last_layer),
    F(StatsRank, FIELD_DOUBLE, weight_bytes),
    F(StatsRank, FIELD_DOUBLE, load_fraction),
};

#undef F

// Fill base's fields from obj; NULL on success, else the key whose value has the wrong type.
static const char *read_fields(json_object *obj, const Field *fields, size_t n, void *base)
{
    for (size_t i = 0; i < n; i++) {
        const Field *f = &fields[i];
        json_object *v;
        if (!json_object_object_get_ex(obj, f->key, &v) || !v) continue;  // absent or null
        const json_type t = json_object_get_type(v);
        char *p = (char *) base + f->offset;
        if (f->kind == FIELD_TEXT) {
            if (t != json_type_string) return f->key;
            snprintf(p, f->size, "%s", json_object_get_string(v));
            continue;
        }
        if (t != json_type_int && t != json_type_double) return f->key;
        if (f->kind == FIELD_INT) *(int *) p = (int) json_object_get_int64(v);
        else if (f->kind == FIELD_I64) *(int64_t *) p = json_object_get_int64(v);
        else *(double *) p = json_object_get_double(v);
    }
    return NULL;
}

Err stats_parse(const char *json, EngineStats *out, const char **err_key)
{
    const char *bad = NULL;
    memset(out, 0, sizeof *out);
    json_object *root = json ? json_tokener_parse(json) : NULL;
    if (!root || !json_object_is_type(root, json_type_object)) {
        bad = "(not a JSON object)";
        goto done;
    }
    if ((bad = read_fields(root, engine_fields, sizeof engine_fields / sizeof *engine_fields, out)))
        goto done;
    json_object *ranks;
    if (json_object_object_get_ex(root, "ranks", &ranks) && ranks) {
        if (!json_object_is_type(ranks, json_type_array)) {
            bad = "ranks";
            goto done;
        }
        const size_t n = json_object_array_length(ranks);
        for (size_t i = 0; i < n && i < STATS_MAX_RANKS; i++) {
            json_object *r = json_object_array_get_idx(ranks, i);
            if (!json_object_is_type(r, json_type_object)) {
                bad = "ranks";
                goto done;
            }
            if ((bad = read_fields(r, rank_fields, sizeof rank_fields / sizeof *rank_fields,
                                   &out->ranks[i])))
                goto done;
            out->n_ranks++;
        }
    }
done:
    json_object_put(root);
    if (bad) {
        memset(out, 0, sizeof *out);
        if (err_key) *err_key = bad;
        return ERR_FORMAT;
    }
    return ERR_OK;
}

int stats_n_ranks_up(const EngineStats *s)
{
    int n = 0;
    for (int i = 0; i < s->n_ranks; i++) n += !strcmp(s->ranks[i].state, "up");
    return n;
}
