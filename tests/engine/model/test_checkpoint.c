/*
 * test_checkpoint.c - safetensors parsing and validation, sharded and filtered opening,
 * weight format resolution and dequantization against hand-computed values.
 *
 * Files are written by a tiny writer below (header + data, as the format defines them), so
 * every corruption is a precise edit of a known-good file. Error messages are captured by
 * pointing fd 2 at a file for the duration of a call, so that tests can check that a message
 * names the tensor and the file.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/model/checkpoint.h"
#include "tests/capture.h"
#include "tests/check.h"

// ---------------------------------------------------------------------------
// Helpers

typedef struct TT {
    const char *name;
    const char *dtype;
    int n_dims;
    int64_t shape[4];
    const void *data;
    size_t n_bytes;
} TT;

static char tmp_root[256];

static void path_in(char *out, size_t cap, const char *dir, const char *file)
{
    snprintf(out, cap, "%s/%s", dir, file);
}

static void make_dir(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", tmp_root, name);
    mkdir(out, 0755);
}

// Header JSON for the tensors, offsets sequential. Returns its length.
static size_t header_json(char *buf, size_t cap, const TT *t, int n, bool metadata)
{
    size_t pos =
        (size_t) snprintf(buf, cap, "{%s", metadata ? "\"__metadata__\":{\"format\":\"pt\"}" : "");
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        pos += (size_t) snprintf(buf + pos, cap - pos, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[",
                                 (i || metadata) ? "," : "", t[i].name, t[i].dtype);
        for (int d = 0; d < t[i].n_dims; d++) {
            pos += (size_t) snprintf(buf + pos, cap - pos, "%s%lld", d ? "," : "",
                                     (long long) t[i].shape[d]);
        }
        pos += (size_t) snprintf(buf + pos, cap - pos, "],\"data_offsets\":[%zu,%zu]}", off,
                                 off + t[i].n_bytes);
        off += t[i].n_bytes;
    }
    pos += (size_t) snprintf(buf + pos, cap - pos, "}");
    return pos;
}

// Write a safetensors file; the last `cut` bytes are left off (a truncated download).
static void write_st(const char *path, const TT *t, int n, size_t cut)
{
    char hdr[8192];
    size_t hlen = header_json(hdr, sizeof hdr, t, n, true);
    while (hlen % 8) {
        hdr[hlen++] = ' ';
    }
    size_t total = 8 + hlen;
    for (int i = 0; i < n; i++) {
        total += t[i].n_bytes;
    }
    uint8_t *buf = malloc(total);
    for (int i = 0; i < 8; i++) {
        buf[i] = (uint8_t) ((uint64_t) hlen >> (8 * i));
    }
    memcpy(buf + 8, hdr, hlen);
    size_t pos = 8 + hlen;
    for (int i = 0; i < n; i++) {
        memcpy(buf + pos, t[i].data, t[i].n_bytes);
        pos += t[i].n_bytes;
    }
    FILE *f = fopen(path, "wb");
    fwrite(buf, 1, total - cut, f);
    fclose(f);
    free(buf);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    fputs(text, f);
    fclose(f);
}

// Capture everything written to fd 2 while the callback runs.
static char captured[8192];
static Capture stderr_capture;

static void stderr_begin(void)
{
    capture_begin(&stderr_capture, STDERR_FILENO);
}

static const char *stderr_end(void)
{
    capture_end(&stderr_capture, captured, sizeof captured);
    return captured;
}

// Parse a header given as JSON text for a file whose data region has data_size bytes.
static Err parse_text(const char *json, size_t data_size)
{
    const size_t hlen = strlen(json);
    const size_t len = 8 + hlen + data_size;
    uint8_t *buf = calloc(1, len);
    for (int i = 0; i < 8; i++) {
        buf[i] = (uint8_t) ((uint64_t) hlen >> (8 * i));
    }
    memcpy(buf + 8, json, hlen);
    CkptTensor *t = NULL;
    char *names = NULL;
    int n = 0;
    const Err err = ckpt_parse_header(buf, len, len, "test", &t, &n, &names);
    free(t);
    free(names);
    free(buf);
    return err;
}

// ---------------------------------------------------------------------------
// Header parsing

static void test_parse_header(void)
{
    const uint16_t bf[6] = {0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0};  // 1..6
    const float sc = 0.5f;
    const TT t[2] = {
        {"a.weight", "BF16", 2, {2, 3}, bf, sizeof bf},
        {"a.scale", "F32", 0, {0}, &sc, 4},
    };
    char path[512];
    path_in(path, sizeof path, tmp_root, "hdr.safetensors");
    write_st(path, t, 2, 0);
    FILE *f = fopen(path, "rb");
    uint8_t buf[4096];
    const size_t len = fread(buf, 1, sizeof buf, f);
    fclose(f);
    CkptTensor *ts = NULL;
    char *names = NULL;
    int n = 0;
    CHECK(ckpt_parse_header(buf, len, len, path, &ts, &n, &names) == ERR_OK);
    CHECK(n == 2);
    for (int i = 0; i < n; i++) {
        if (!strcmp(ts[i].name, "a.weight")) {
            CHECK(ts[i].dtype == CKPT_DTYPE_BF16 && ts[i].n_dims == 2 && ts[i].shape[1] == 3);
            CHECK(ts[i].n_bytes == 12 && ts[i].data && !memcmp(ts[i].data, bf, 12));
        } else {
            CHECK(!strcmp(ts[i].name, "a.scale"));
            CHECK(ts[i].n_dims == 0 && ts[i].n_bytes == 4 && !memcmp(ts[i].data, &sc, 4));
        }
    }
    free(ts);
    free(names);
    // Only the header in hand (len < file size): parsed, no data pointers.
    CHECK(ckpt_parse_header(buf, len - 16, len, path, &ts, &n, &names) == ERR_OK);
    CHECK(n == 2 && ts[0].data == NULL);
    free(ts);
    free(names);

    // Corruptions: each must be ERR_FORMAT, never a crash.
    log_set_level((LogLevel) (LOG_LEVEL_ERROR + 1));
    CHECK(ckpt_parse_header(buf, 7, 7, "short", &ts, &n, &names) == ERR_FORMAT);
    uint8_t big[16] = {0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, '{', '}'};
    CHECK(ckpt_parse_header(big, sizeof big, sizeof big, "huge len", &ts, &n, &names)
          == ERR_FORMAT);
    CHECK(parse_text("{}", 0) == ERR_OK);
    CHECK(parse_text("[]", 0) == ERR_FORMAT);
    CHECK(parse_text("{\"a\":", 0) == ERR_FORMAT);
    CHECK(parse_text("{} x", 0) == ERR_FORMAT);
    CHECK(parse_text("{}  ", 0) == ERR_OK);  // space padding is legal
    CHECK(parse_text("{\"a\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1)
          == ERR_FORMAT);
    CHECK(parse_text("{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}", 1)
          == ERR_FORMAT);
    CHECK(parse_text("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,1]}}", 1)
          == ERR_FORMAT);
    CHECK(parse_text("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 1)
          == ERR_FORMAT);
    CHECK(parse_text("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,0]}}", 1)
          == ERR_FORMAT);
    CHECK(parse_text("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 1)
          == ERR_FORMAT);
    CHECK(parse_text("{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1) == ERR_FORMAT);
    CHECK(parse_text("{\"a\":{\"dtype\":\"U8\",\"shape\":1,\"data_offsets\":[0,1]}}", 1)
          == ERR_FORMAT);
    CHECK(parse_text("{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1],\"data_offsets\":[0,1]}}", 1)
          == ERR_FORMAT);
    CHECK(parse_text("{\"a\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296,4294967296],"
                     "\"data_offsets\":[0,8]}}",
                     8)
          == ERR_FORMAT);
    CHECK(parse_text("{\"a\":{\"dtype\":\"U8\",\"shape\":[0, 99999999999],\"data_offsets\":[0,0]}}",
                     0)
          == ERR_OK);
    CHECK(parse_text("{\"__metadata__\":3}", 0) == ERR_FORMAT);
    CHECK(parse_text("{\"a\":[]}", 0) == ERR_FORMAT);
    log_set_level(LOG_LEVEL_WARN);

    // All ten dtypes and their sizes.
    const char *names10[] = {"F32", "F16", "BF16", "F8_E4M3", "U8",
                             "I8",  "I32", "I64",  "F64",     "BOOL"};
    const size_t sizes10[] = {4, 2, 2, 1, 1, 1, 4, 8, 8, 1};
    for (int d = 0; d < 10; d++) {
        CHECK(!strcmp(ckpt_dtype_name((CkptDtype) d), names10[d]));
        CHECK(ckpt_dtype_size((CkptDtype) d) == sizes10[d]);
        char json[200];
        snprintf(json, sizeof json,
                 "{\"t\":{\"dtype\":\"%s\",\"shape\":[3],\"data_offsets\":[0,%zu]}}", names10[d],
                 3 * sizes10[d]);
        CHECK(parse_text(json, 3 * sizes10[d]) == ERR_OK);
    }
}

// ---------------------------------------------------------------------------
// Opening, lookups, errors naming tensor and file

static void test_open_single(void)
{
    char dir[300], path[512];
    make_dir(dir, sizeof dir, "single");
    path_in(path, sizeof path, dir, "model.safetensors");
    uint16_t bf[8];
    for (int i = 0; i < 8; i++) {
        bf[i] = (uint16_t) (0x3f80 + i);
    }
    const int32_t ids[3] = {7, 8, 9};
    const TT t[2] = {
        {"w.weight", "BF16", 2, {2, 4}, bf, sizeof bf},
        {"ids", "I32", 1, {3}, ids, sizeof ids},
    };
    write_st(path, t, 2, 0);
    Ckpt ck;
    CHECK(ckpt_open(&ck, dir) == ERR_OK);
    CHECK(ck.n_shards == 1 && ck.n_tensors == 2);
    const CkptTensor *w = ckpt_find(&ck, "w.weight");
    CHECK(w && w->n_bytes == 16 && !memcmp(w->data, bf, 16));
    CHECK(ckpt_find(&ck, "nope") == NULL);
    const int64_t good[2] = {2, 4}, bad[2] = {4, 2};
    const CkptTensor *got = NULL;
    CHECK(ckpt_get(&ck, "w.weight", 2, good, CKPT_DTYPE_BIT(CKPT_DTYPE_BF16), &got) == ERR_OK);
    CHECK(got == w);
    stderr_begin();
    Err err = ckpt_get(&ck, "w.weight", 2, bad, CKPT_DTYPE_ANY, &got);
    const char *msg = stderr_end();
    CHECK(err == ERR_FORMAT);
    CHECK(strstr(msg, "w.weight") && strstr(msg, path));
    stderr_begin();
    err = ckpt_get(&ck, "w.weight", 2, good, CKPT_DTYPE_BIT(CKPT_DTYPE_F32), &got);
    msg = stderr_end();
    CHECK(err == ERR_FORMAT && strstr(msg, "BF16"));
    stderr_begin();
    err = ckpt_get(&ck, "missing.weight", 2, good, CKPT_DTYPE_ANY, &got);
    msg = stderr_end();
    CHECK(err == ERR_NOTFOUND);
    CHECK(strstr(msg, "missing.weight") && strstr(msg, dir));

    // The data stays readable after release, and touch sums exactly what is there.
    ckpt_release(&ck, w);
    CHECK(!memcmp(w->data, bf, 16));
    CkptTouchStats st;
    ckpt_touch(&ck, &st);
    uint64_t want = 0;
    for (int i = 0; i < ck.n_tensors; i++) {
        const uint8_t *p = ck.tensors[i].data;
        size_t j = 0;
        for (; j + 8 <= ck.tensors[i].n_bytes; j += 8) {
            uint64_t x;
            memcpy(&x, p + j, 8);
            want += x;
        }
        for (; j < ck.tensors[i].n_bytes; j++) {
            want += p[j];
        }
    }
    CHECK(st.n_bytes == 28 && st.checksum == want);
    ckpt_close(&ck);
    CHECK(ck.tensors == NULL && ck.n_shards == 0);
    ckpt_close(&ck);  // zeroed: a no-op

    // Truncated by 3 bytes: the message names the tensor whose bytes are cut and the file.
    write_st(path, t, 2, 3);
    stderr_begin();
    err = ckpt_open(&ck, dir);
    msg = stderr_end();
    CHECK(err == ERR_FORMAT);
    CHECK(strstr(msg, path) && (strstr(msg, "\"ids\"") || strstr(msg, "\"w.weight\"")));
    CHECK(ck.tensors == NULL && ck.dir == NULL);

    // No checkpoint at all.
    char empty[300];
    make_dir(empty, sizeof empty, "empty");
    stderr_begin();
    err = ckpt_open(&ck, empty);
    msg = stderr_end();
    CHECK(err == ERR_IO && strstr(msg, empty));
}

static bool keep_layer1(const char *name, void *user)
{
    (void) user;
    return strncmp(name, "model.layers.1.", 15) == 0;
}

static void test_open_sharded(void)
{
    char dir[300], p1[512], p2[512], idx[512];
    make_dir(dir, sizeof dir, "sharded");
    path_in(p1, sizeof p1, dir, "model-00001-of-00002.safetensors");
    path_in(p2, sizeof p2, dir, "model-00002-of-00002.safetensors");
    path_in(idx, sizeof idx, dir, "model.safetensors.index.json");
    const float a[2] = {1, 2}, b[2] = {3, 4}, c[1] = {5};
    const TT s1[1] = {{"model.layers.0.x.weight", "F32", 1, {2}, a, 8}};
    const TT s2[2] = {{"model.layers.1.x.weight", "F32", 1, {2}, b, 8},
                      {"model.layers.1.y.weight", "F32", 1, {1}, c, 4}};
    write_st(p1, s1, 1, 0);
    write_st(p2, s2, 2, 0);
    write_text(idx, "{\"metadata\":{\"total_size\":20},\"weight_map\":{"
                    "\"model.layers.0.x.weight\":\"model-00001-of-00002.safetensors\","
                    "\"model.layers.1.x.weight\":\"model-00002-of-00002.safetensors\","
                    "\"model.layers.1.y.weight\":\"model-00002-of-00002.safetensors\"}}");
    Ckpt ck;
    CHECK(ckpt_open(&ck, dir) == ERR_OK);
    CHECK(ck.n_shards == 2 && ck.n_tensors == 3);
    const CkptTensor *t = ckpt_find(&ck, "model.layers.1.y.weight");
    CHECK(t && !strcmp(ckpt_shard_path(&ck, t), p2));
    ckpt_close(&ck);

    // A pipeline rank holding layer 1 maps only the second shard. Remove the first shard to
    // prove it is never opened.
    char moved[520];
    snprintf(moved, sizeof moved, "%s.away", p1);
    rename(p1, moved);
    CHECK(ckpt_open_filtered(&ck, dir, keep_layer1, NULL) == ERR_OK);
    CHECK(ck.n_shards == 1 && ck.n_tensors == 2);
    CHECK(ckpt_find(&ck, "model.layers.0.x.weight") == NULL);
    ckpt_close(&ck);
    rename(moved, p1);

    // The index lists a tensor the shard lacks: the message names the tensor and the shard.
    write_text(idx, "{\"weight_map\":{"
                    "\"model.layers.0.x.weight\":\"model-00001-of-00002.safetensors\","
                    "\"model.layers.0.z.weight\":\"model-00001-of-00002.safetensors\","
                    "\"model.layers.1.x.weight\":\"model-00002-of-00002.safetensors\"}}");
    stderr_begin();
    Err err = ckpt_open(&ck, dir);
    const char *msg = stderr_end();
    CHECK(err == ERR_NOTFOUND);
    CHECK(strstr(msg, "model.layers.0.z.weight") && strstr(msg, p1));

    // A shard name that escapes the directory is refused.
    write_text(idx, "{\"weight_map\":{\"model.layers.0.x.weight\":\"../model.safetensors\"}}");
    stderr_begin();
    err = ckpt_open(&ck, dir);
    stderr_end();
    CHECK(err == ERR_FORMAT);

    // The same tensor in two shards.
    const TT dup[1] = {{"model.layers.1.x.weight", "F32", 1, {2}, a, 8}};
    write_st(p1, dup, 1, 0);
    write_text(idx, "{\"weight_map\":{"
                    "\"model.layers.1.x.weight\":\"model-00001-of-00002.safetensors\","
                    "\"model.layers.1.y.weight\":\"model-00002-of-00002.safetensors\"}}");
    stderr_begin();
    err = ckpt_open(&ck, dir);
    msg = stderr_end();
    CHECK(err == ERR_FORMAT && strstr(msg, "model.layers.1.x.weight"));
    CHECK(ck.n_tensors == 0);
}

// ---------------------------------------------------------------------------
// Weight formats

// Row 0 of the NVFP4 test weight, [2, 32]: the low nibble holds the even element.
//   bytes 0..7 (group 0, scale 0x38 = 1.0): 0x21 -> [0.5, 1.0]; 0x9f -> [-6, -0.5];
//                                           others 0x00
//   bytes 8..15 (group 1, scale 0x40 = 2.0): 0x07 -> [6, 0]; 0x53 -> [1.5, 3]
// Row 1: every byte 0x44 (2.0, 2.0), scales 0x30 (0.5) and 0x00 (0: zero group).
static void nvfp4_fixture(uint8_t codes[2][16], uint8_t scales[2][2])
{
    memset(codes, 0, 32);
    codes[0][0] = 0x21, codes[0][1] = 0x9f, codes[0][8] = 0x07, codes[0][9] = 0x53;
    memset(codes[1], 0x44, 16);
    scales[0][0] = 0x38, scales[0][1] = 0x40;
    scales[1][0] = 0x30, scales[1][1] = 0x00;
}

static void check_nvfp4_rows(const CkptLinear *w, float g)
{
    float row[32];
    ckpt_linear_row(w, 0, row);
    CHECK_NEAR(row[0], 0.5 * g, 0);
    CHECK_NEAR(row[1], 1.0 * g, 0);
    CHECK_NEAR(row[2], -6.0 * g, 0);
    CHECK_NEAR(row[3], -0.5 * g, 0);
    CHECK_NEAR(row[4], 0.0, 0);
    CHECK_NEAR(row[16], 6.0 * 2.0 * g, 0);
    CHECK_NEAR(row[17], 0.0, 0);
    CHECK_NEAR(row[18], 1.5 * 2.0 * g, 0);
    CHECK_NEAR(row[19], 3.0 * 2.0 * g, 0);
    ckpt_linear_row(w, 1, row);
    CHECK_NEAR(row[0], 2.0 * 0.5 * g, 0);
    CHECK_NEAR(row[15], 2.0 * 0.5 * g, 0);
    CHECK_NEAR(row[16], 0.0, 0);
}

static void test_nvfp4(void)
{
    uint8_t codes[2][16], scales[2][2];
    nvfp4_fixture(codes, scales);
    const float s2 = 0.25f, gs = 4.0f, in_scale = 1.0f;
    char dir[300], path[512];

    // ModelOpt, weight_scale_2 0-dim.
    make_dir(dir, sizeof dir, "modelopt0");
    path_in(path, sizeof path, dir, "model.safetensors");
    TT t[4] = {
        {"l.weight", "U8", 2, {2, 16}, codes, 32},
        {"l.weight_scale", "F8_E4M3", 2, {2, 2}, scales, 4},
        {"l.weight_scale_2", "F32", 0, {0}, &s2, 4},
        {"l.input_scale", "F32", 0, {0}, &in_scale, 4},
    };
    write_st(path, t, 4, 0);
    Ckpt ck;
    CkptLinear w;
    CHECK(ckpt_open(&ck, dir) == ERR_OK);
    CHECK(ckpt_linear(&ck, "l", 2, 32, &w) == ERR_OK);
    CHECK(w.format == CKPT_LINEAR_NVFP4 && w.rows == 2 && w.cols == 32);
    CHECK_NEAR(w.global_scale, 0.25, 0);
    check_nvfp4_rows(&w, 0.25);
    // Wrong logical shape: the message names the tensor and the file.
    stderr_begin();
    Err err = ckpt_linear(&ck, "l", 2, 64, &w);
    const char *msg = stderr_end();
    CHECK(err == ERR_FORMAT && strstr(msg, "l.weight") && strstr(msg, path));
    ckpt_close(&ck);

    // ModelOpt, weight_scale_2 shaped [1]: same values.
    make_dir(dir, sizeof dir, "modelopt1");
    path_in(path, sizeof path, dir, "model.safetensors");
    t[2].n_dims = 1, t[2].shape[0] = 1;
    write_st(path, t, 3, 0);
    CHECK(ckpt_open(&ck, dir) == ERR_OK);
    CHECK(ckpt_linear(&ck, "l", 2, 32, &w) == ERR_OK);
    check_nvfp4_rows(&w, 0.25);
    ckpt_close(&ck);

    // Missing weight_scale_2 names the tensor.
    make_dir(dir, sizeof dir, "modelopt_noscale2");
    path_in(path, sizeof path, dir, "model.safetensors");
    write_st(path, t, 2, 0);
    CHECK(ckpt_open(&ck, dir) == ERR_OK);
    stderr_begin();
    err = ckpt_linear(&ck, "l", 2, 32, &w);
    msg = stderr_end();
    CHECK(err == ERR_NOTFOUND && strstr(msg, "l.weight_scale_2"));
    ckpt_close(&ck);

    // compressed-tensors: weight_global_scale divides (4.0 -> 0.25, the same weight).
    make_dir(dir, sizeof dir, "ct");
    path_in(path, sizeof path, dir, "model.safetensors");
    const TT ct[3] = {
        {"l.weight_packed", "U8", 2, {2, 16}, codes, 32},
        {"l.weight_scale", "F8_E4M3", 2, {2, 2}, scales, 4},
        {"l.weight_global_scale", "F32", 1, {1}, &gs, 4},
    };
    write_st(path, ct, 3, 0);
    CHECK(ckpt_open(&ck, dir) == ERR_OK);
    CHECK(ckpt_linear(&ck, "l", 2, 32, &w) == ERR_OK);
    CHECK(w.format == CKPT_LINEAR_NVFP4);
    CHECK_NEAR(w.global_scale, 0.25, 0);
    check_nvfp4_rows(&w, 0.25);
    ckpt_close(&ck);

    // NaN scale encodings (0x7f, 0xff) are refused, naming the tensor.
    for (int k = 0; k < 2; k++) {
        uint8_t bad[2][2];
        memcpy(bad, scales, 4);
        bad[1][1] = k ? 0xff : 0x7f;
        make_dir(dir, sizeof dir, k ? "nan_ff" : "nan_7f");
        path_in(path, sizeof path, dir, "model.safetensors");
        TT tb[3] = {t[0], t[1], t[2]};
        tb[1].data = bad;
        write_st(path, tb, 3, 0);
        CHECK(ckpt_open(&ck, dir) == ERR_OK);
        stderr_begin();
        err = ckpt_linear(&ck, "l", 2, 32, &w);
        msg = stderr_end();
        CHECK(err == ERR_FORMAT && strstr(msg, "l.weight_scale") && strstr(msg, path));
        ckpt_close(&ck);
    }

    // A non-positive global scale is refused too.
    make_dir(dir, sizeof dir, "zero_s2");
    path_in(path, sizeof path, dir, "model.safetensors");
    const float zero = 0.0f;
    TT tz[3] = {t[0], t[1], t[2]};
    tz[2].data = &zero;
    write_st(path, tz, 3, 0);
    CHECK(ckpt_open(&ck, dir) == ERR_OK);
    stderr_begin();
    err = ckpt_linear(&ck, "l", 2, 32, &w);
    stderr_end();
    CHECK(err == ERR_FORMAT);
    ckpt_close(&ck);
}

static void test_plain_and_fp8(void)
{
    char dir[300], path[512];
    make_dir(dir, sizeof dir, "plain");
    path_in(path, sizeof path, dir, "model.safetensors");
    const uint16_t bf[4] = {0x3f80, 0xc000, 0x3e80, 0x0000};  // 1, -2, 0.25, 0
    const uint16_t hf[4] = {0x3c00, 0xc000, 0x3400, 0x0001};  // 1, -2, 0.25, 2^-24
    const float f32[4] = {1.5f, -2.5f, 3.5f, 4.5f};
    // FP8: 130 x 4 weight, all codes 0x38 (1.0) except row 129 = 0xc0 (-2.0);
    // 128x128 block scales [2, 1] = {0.5, 3.0}.
    uint8_t f8[130 * 4];
    memset(f8, 0x38, sizeof f8);
    memset(f8 + 129 * 4, 0xc0, 4);
    const float blocks[2] = {0.5f, 3.0f}, per_tensor = 0.125f;
    const TT t[7] = {
        {"b.weight", "BF16", 2, {2, 2}, bf, 8},
        {"h.weight", "F16", 2, {2, 2}, hf, 8},
        {"f.weight", "F32", 2, {2, 2}, f32, 16},
        {"q.weight", "F8_E4M3", 2, {130, 4}, f8, sizeof f8},
        {"q.weight_scale_inv", "F32", 2, {2, 1}, blocks, 8},
        {"p.weight", "F8_E4M3", 2, {130, 4}, f8, sizeof f8},
        {"p.weight_scale", "F32", 0, {0}, &per_tensor, 4},
    };
    write_st(path, t, 7, 0);
    Ckpt ck;
    CkptLinear w;
    float row[4];
    CHECK(ckpt_open(&ck, dir) == ERR_OK);
    CHECK(ckpt_linear(&ck, "b", 2, 2, &w) == ERR_OK && w.format == CKPT_LINEAR_BF16);
    ckpt_linear_row(&w, 1, row);
    CHECK_NEAR(row[0], 0.25, 0);
    CHECK_NEAR(row[1], 0.0, 0);
    ckpt_linear_row(&w, 0, row);
    CHECK_NEAR(row[1], -2.0, 0);
    CHECK(ckpt_linear(&ck, "h", 2, 2, &w) == ERR_OK && w.format == CKPT_LINEAR_F16);
    ckpt_linear_row(&w, 1, row);
    CHECK_NEAR(row[0], 0.25, 0);
    CHECK_NEAR(row[1], 5.9604644775390625e-08, 0);
    CHECK(ckpt_linear(&ck, "f", 2, 2, &w) == ERR_OK && w.format == CKPT_LINEAR_F32);
    ckpt_linear_row(&w, 1, row);
    CHECK_NEAR(row[1], 4.5, 0);
    CHECK(ckpt_linear(&ck, "q", 130, 4, &w) == ERR_OK && w.format == CKPT_LINEAR_FP8);
    CHECK(w.scale_f32 != NULL);
    ckpt_linear_row(&w, 0, row);
    CHECK_NEAR(row[3], 0.5, 0);
    ckpt_linear_row(&w, 128, row);
    CHECK_NEAR(row[0], 3.0, 0);
    ckpt_linear_row(&w, 129, row);
    CHECK_NEAR(row[2], -6.0, 0);
    CHECK(ckpt_linear(&ck, "p", 130, 4, &w) == ERR_OK && w.format == CKPT_LINEAR_FP8);
    CHECK(w.scale_f32 == NULL);
    CHECK_NEAR(w.global_scale, 0.125, 0);
    ckpt_linear_row(&w, 129, row);
    CHECK_NEAR(row[0], -0.25, 0);
    stderr_begin();
    CHECK(ckpt_linear(&ck, "nothing", 2, 2, &w) == ERR_NOTFOUND);
    const char *msg = stderr_end();
    CHECK(strstr(msg, "nothing.weight") && strstr(msg, dir));
    ckpt_close(&ck);
    CHECK(!strcmp(ckpt_linear_format_name(CKPT_LINEAR_NVFP4), "NVFP4"));
}

int main(void)
{
    const char *base = getenv("TMPDIR");
    snprintf(tmp_root, sizeof tmp_root, "%s/glmspark_ckpt_XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(tmp_root)) {
        perror("mkdtemp");
        return 1;
    }
    log_set_level(LOG_LEVEL_WARN);
    test_parse_header();
    test_open_single();
    test_open_sharded();
    test_nvfp4();
    test_plain_and_fp8();
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp_root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp_root);
    return check_exit();
}
