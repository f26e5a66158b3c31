/*
 * test_stats.c - reading the engine's status JSON (engine/shared/stats.h).
 *
 * A full version-1 object parses into every field; a missing key reads as zero;
 * integers are accepted where doubles are and the reverse; a wrong type, a rank that is
 * not an object, non-JSON text, a JSON array or NULL is ERR_FORMAT naming the key, with the
 * output zeroed; more ranks than STATS_MAX_RANKS keep the first ones; long hosts are cut.
 */
#include <stdio.h>
#include <string.h>

#include "engine/shared/stats.h"
#include "tests/check.h"

static const char example[] =
    "{\"version\":1, \"updated_unix\": 1764520000.25, \"backend\":\"cpu\", \"model\":\"glm\","
    " \"world\": 3, \"state\":\"ready\","
    " \"ranks\":[{\"rank\":0,\"host\":\"node1\",\"pid\":1234,\"state\":\"up\",\"first_layer\":0,"
    "\"last_layer\":25,\"weight_bytes\":90000000000,\"load_fraction\":1.0},"
    "{\"rank\":1,\"host\":\"node2\",\"pid\":77,\"state\":\"loading\",\"first_layer\":26,"
    "\"last_layer\":52,\"weight_bytes\":1.5e9,\"load_fraction\":0.25},"
    "{\"rank\":2,\"host\":\"node3\",\"pid\":78,\"state\":\"down\",\"first_layer\":53,"
    "\"last_layer\":78,\"weight_bytes\":0,\"load_fraction\":0}],"
    " \"kv_blocks_total\":1024, \"kv_blocks_used\":17, \"kv_block_size\":128,"
    " \"max_num_seqs\":16, \"running\":3, \"waiting\":1, \"inflight_microbatches\":2,"
    " \"steps_total\":12345, \"step_ms_avg\":41.5, \"step_ms_max\":80.1, \"commit_ms_avg\":2.25,"
    " \"decode_steps_total\":12000, \"decode_step_ms_total\":480000.5, \"decode_commit_ms_total\":24000.25,"
    " \"batch_seqs_avg\":3.2, \"batch_tokens_avg\":5.1,"
    " \"prompt_tokens_total\":1000, \"generated_tokens_total\":5000000000,"
    " \"tokens_per_s\":75.3, \"window_s\":10, \"future_key\":{\"x\":[1]}}";

static void test_example(void)
{
    EngineStats s;
    const char *bad = "unchanged";
    CHECK(stats_parse(example, &s, &bad) == ERR_OK);
    CHECK(!strcmp(bad, "unchanged"));
    CHECK(s.version == 1);
    CHECK_NEAR(s.updated_unix, 1764520000.25, 1e-6);
    CHECK(!strcmp(s.backend, "cpu") && !strcmp(s.model, "glm") && !strcmp(s.state, "ready"));
    CHECK(s.world == 3 && s.n_ranks == 3);
    CHECK(s.ranks[0].rank == 0 && !strcmp(s.ranks[0].host, "node1") && s.ranks[0].pid == 1234);
    CHECK(!strcmp(s.ranks[0].state, "up") && s.ranks[0].first_layer == 0 && s.ranks[0].last_layer == 25);
    CHECK_NEAR(s.ranks[0].weight_bytes, 9e10, 0);
    CHECK_NEAR(s.ranks[0].load_fraction, 1.0, 0);
    CHECK(s.ranks[1].rank == 1 && !strcmp(s.ranks[1].state, "loading") && s.ranks[1].first_layer == 26);
    CHECK_NEAR(s.ranks[1].weight_bytes, 1.5e9, 0);
    CHECK_NEAR(s.ranks[1].load_fraction, 0.25, 0);
    CHECK(!strcmp(s.ranks[2].host, "node3") && !strcmp(s.ranks[2].state, "down"));
    CHECK(stats_n_ranks_up(&s) == 1);
    CHECK(s.kv_blocks_total == 1024 && s.kv_blocks_used == 17 && s.kv_block_size == 128);
    CHECK(s.max_num_seqs == 16 && s.running == 3 && s.waiting == 1 && s.inflight_microbatches == 2);
    CHECK(s.steps_total == 12345);
    CHECK_NEAR(s.step_ms_avg, 41.5, 1e-12);
    CHECK_NEAR(s.step_ms_max, 80.1, 1e-12);
    CHECK_NEAR(s.commit_ms_avg, 2.25, 1e-12);
    CHECK(s.decode_steps_total == 12000);
    CHECK_NEAR(s.decode_step_ms_total, 480000.5, 1e-9);
    CHECK_NEAR(s.decode_commit_ms_total, 24000.25, 1e-9);
    CHECK_NEAR(s.batch_seqs_avg, 3.2, 1e-12);
    CHECK_NEAR(s.batch_tokens_avg, 5.1, 1e-12);
    CHECK(s.prompt_tokens_total == 1000 && s.generated_tokens_total == 5000000000LL);  // > 2^32
    CHECK_NEAR(s.tokens_per_s, 75.3, 1e-12);
    CHECK_NEAR(s.window_s, 10, 0);  // an integer where a double is expected
}

static void test_missing_and_lenient(void)
{
    EngineStats s;
    CHECK(stats_parse("{}", &s, NULL) == ERR_OK);
    CHECK(s.version == 0 && s.n_ranks == 0 && s.state[0] == '\0' && s.kv_blocks_total == 0);
    CHECK(stats_parse("{\"state\":\"loading\",\"ranks\":[],\"kv_blocks_used\":2.0,\"model\":null}", &s, NULL) == ERR_OK);
    CHECK(!strcmp(s.state, "loading") && s.n_ranks == 0 && s.kv_blocks_used == 2 && s.model[0] == '\0');
    CHECK(stats_n_ranks_up(&s) == 0);

    // More ranks than fit: the first STATS_MAX_RANKS are kept. A host longer than the field is cut.
    char big[16384];
    int n = snprintf(big, sizeof big, "{\"ranks\":[");
    for (int i = 0; i < STATS_MAX_RANKS + 5; i++)
        n += snprintf(big + n, sizeof big - (size_t) n, "%s{\"rank\":%d,\"state\":\"up\",\"host\":\"%0100d\"}",
                      i ? "," : "", i, i);
    snprintf(big + n, sizeof big - (size_t) n, "]}");
    CHECK(stats_parse(big, &s, NULL) == ERR_OK);
    CHECK(s.n_ranks == STATS_MAX_RANKS && s.ranks[STATS_MAX_RANKS - 1].rank == STATS_MAX_RANKS - 1);
    CHECK(strlen(s.ranks[0].host) == sizeof s.ranks[0].host - 1);
    CHECK(stats_n_ranks_up(&s) == STATS_MAX_RANKS);
}

static void test_errors(void)
{
    static const struct {
        const char *json, *key;
    } cases[] = {
        {"{\"kv_blocks_used\":\"17\"}", "kv_blocks_used"},
        {"{\"state\":1}", "state"},
        {"{\"tokens_per_s\":true}", "tokens_per_s"},
        {"{\"ranks\":{}}", "ranks"},
        {"{\"ranks\":[1]}", "ranks"},
        {"{\"ranks\":[{\"host\":[]}]}", "host"},
        {"{\"ranks\":[{\"rank\":0,\"state\":\"up\"},{\"load_fraction\":\"x\"}]}", "load_fraction"},
        {"[1,2]", "(not a JSON object)"},
        {"{\"version\":1", "(not a JSON object)"},
        {"", "(not a JSON object)"},
        {NULL, "(not a JSON object)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        EngineStats s;
        const char *bad = NULL;
        memset(&s, 0x5a, sizeof s);
        const Err err = stats_parse(cases[i].json, &s, &bad);
        CHECK(err == ERR_FORMAT);
        CHECK(bad && !strcmp(bad, cases[i].key));
        if (!bad || strcmp(bad, cases[i].key)) fprintf(stderr, "  case %zu: key %s\n", i, bad ? bad : "(null)");
        CHECK(s.n_ranks == 0 && s.world == 0 && s.ranks[0].pid == 0);  // zeroed on failure
    }
}

int main(void)
{
    test_example();
    test_missing_and_lenient();
    test_errors();
    return check_exit();
}
