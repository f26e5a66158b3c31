/*
 * test_serve_stats.c - the engine's status JSON (engine/serve/serve_stats.h; its keys are
 * engine/shared/stats.h's): every key present, window averages over the last 10 s only,
 * totals over everything, the ring wrapping.
 */
#include <json-c/json.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/serve/serve_stats.h"
#include "tests/check.h"

static double num(json_object *o, const char *k)
{
    json_object *v;
    return json_object_object_get_ex(o, k, &v) ? json_object_get_double(v) : NAN;
}

int main(void)
{
    static ServeStats s;  // the ring is large
    s.backend = "cpu";
    s.model = "m";
    s.state = "ready";
    s.world = 2;
    s.ranks[0] = (ServeRank){.host = "h0", .pid = 7, .state = "up", .first_layer = 0, .last_layer = 2,
                             .weight_bytes = 100, .load_fraction = 1.0};
    s.ranks[1] = (ServeRank){.state = "up", .first_layer = 2, .last_layer = 4, .weight_bytes = 90};
    s.kv_blocks_total = 64;
    s.max_num_seqs = 8;
    // An old step (outside the window), then two recent ones and a prefill-only one.
    serve_stats_step(&s, &(ServeStep){.t = 100.0, .ms = 500, .n_seqs = 1, .n_tokens = 9, .n_generated = 1});
    serve_stats_step(&s, &(ServeStep){.t = 195.0, .ms = 10, .commit_ms = 2, .n_seqs = 4, .n_tokens = 4, .n_generated = 4});
    serve_stats_step(&s, &(ServeStep){.t = 196.0, .ms = 30, .commit_ms = 1, .n_seqs = 2, .n_tokens = 2, .n_generated = 2});
    serve_stats_step(&s, &(ServeStep){.t = 197.0, .ms = 20, .n_seqs = 0, .n_tokens = 30, .n_generated = 0});
    serve_stats_prompt(&s, 30);
    char *text = serve_stats_json(&s, 200.0, 1764520000.25);
    json_object *o = text ? json_tokener_parse(text) : NULL;
    CHECK(o != NULL);
    static const char *const keys[] = {
        "version", "updated_unix", "backend", "model", "world", "state", "ranks", "kv_blocks_total",
        "kv_blocks_used", "kv_block_size", "max_num_seqs", "running", "waiting",
        "inflight_microbatches", "steps_total", "step_ms_avg", "step_ms_max", "commit_ms_avg",
        "decode_steps_total", "decode_step_ms_total", "decode_commit_ms_total",
        "batch_seqs_avg", "batch_tokens_avg", "prompt_tokens_total", "generated_tokens_total", "tokens_per_s",
        "window_s"};
    for (size_t i = 0; o && i < sizeof keys / sizeof keys[0]; i++) {
        json_object *v;
        CHECK(json_object_object_get_ex(o, keys[i], &v));
    }
    if (o) {
        CHECK(num(o, "version") == 1 && num(o, "updated_unix") == 1764520000.25);
        CHECK(num(o, "steps_total") == 4 && num(o, "generated_tokens_total") == 7);
        CHECK(num(o, "prompt_tokens_total") == 30);
        CHECK(num(o, "step_ms_avg") == 20 && num(o, "step_ms_max") == 30);  // the old step is out
        CHECK(num(o, "commit_ms_avg") == 1);  // (2 + 1 + 0) / 3
        // Decode-only: the two recent steps with a token per sequence, not the old one (9
        // tokens for 1 sequence: a prompt) nor the prefill-only one; counters ignore the window.
        CHECK(num(o, "decode_steps_total") == 2 && num(o, "decode_step_ms_total") == 40);
        CHECK(num(o, "decode_commit_ms_total") == 3);
        CHECK(num(o, "batch_seqs_avg") == 3);    // (4 + 2) / 2 steps with output
        CHECK(num(o, "batch_tokens_avg") == 12);  // (4 + 2 + 30) / 3
        CHECK(fabs(num(o, "tokens_per_s") - 0.6) < 1e-9);  // 6 tokens / 10 s
        json_object *ranks, *v;
        CHECK(json_object_object_get_ex(o, "ranks", &ranks) && json_object_array_length(ranks) == 2);
        json_object *r1 = json_object_array_get_idx(ranks, 1);
        CHECK(num(r1, "rank") == 1 && num(r1, "first_layer") == 2 && num(r1, "weight_bytes") == 90);
        CHECK(json_object_object_get_ex(r1, "host", &v) && !strcmp(json_object_get_string(v), ""));
    }
    json_object_put(o);
    free(text);
    // The ring keeps the newest SERVE_STATS_RING steps.
    for (int i = 0; i < SERVE_STATS_RING + 5; i++)
        serve_stats_step(&s, &(ServeStep){.t = 300.0, .ms = 1, .n_seqs = 1, .n_tokens = 1, .n_generated = 1});
    CHECK(s.n == SERVE_STATS_RING);
    text = serve_stats_json(&s, 301.0, 0);
    o = text ? json_tokener_parse(text) : NULL;
    CHECK(o && num(o, "step_ms_max") == 1 && num(o, "steps_total") == 4 + SERVE_STATS_RING + 5);
    json_object_put(o);
    free(text);
    return check_exit();
}
