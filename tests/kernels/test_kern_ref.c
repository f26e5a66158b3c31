/*
 * test_kern_ref.c - the number-format helpers and the small references that CPU tests can pin
 * to hand-computed values: the NVFP4 decoders of kernels/nvfp4_format.h, bf16 and e4m3
 * rounding, the router's selection and weights, the top-k tie rule, and RoPE's pair rotation.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/nvfp4_format.h"
#include "kernels/ref/dsa_ref.h"
#include "kernels/ref/kern_ref.h"
#include "kernels/ref/mla_ref.h"
#include "kernels/ref/moe_ref.h"
#include "kernels/ref/nvfp4_ref.h"
#include "kernels/ref/norm_ref.h"
#include "tests/check.h"

static void test_bf16(void)
{
    CHECK(kern_f32_to_bf16(1.0f) == 0x3f80);
    CHECK(kern_f32_to_bf16(-2.0f) == 0xc000);
    CHECK(kern_bf16_to_f32(0x3fc0) == 1.5f);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
    CHECK(kern_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);
    CHECK(kern_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);
    CHECK(kern_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);  // tie, odd below: round up
    CHECK(isnan(kern_bf16_to_f32(kern_f32_to_bf16(NAN))));
}

// The nearest E4M3 code by walking the representable magnitudes (at most 127 of them), ties
// to the even code, saturating at 448: an oracle that can be checked by eye against the
// decoder, for nvfp4_float_to_e4m3's bit arithmetic.
static uint8_t e4m3_walk(float f)
{
    const uint8_t sign = signbit(f) ? 0x80 : 0;
    const double a = fabs((double) f);
    if (a >= 448.0) return sign | 0x7e;
    uint8_t best = 0;
    double best_err = a;
    for (int c = 1; c <= 0x7e; c++) {
        const double err = fabs((double) nvfp4_e4m3_to_float((uint8_t) c) - a);
        if (err < best_err || (err == best_err && (c & 1) == 0)) {
            best = (uint8_t) c;
            best_err = err;
        }
    }
    return sign | best;
}

static void test_e4m3(void)
{
    // The encoder against the walk: a stride through the magnitudes 2^-14 .. 2^10, and every
    // midpoint between neighbouring codes with the floats just beside it.
    int mismatches = 0, checked = 0;
    for (uint32_t bits = 0x38800000u; bits < 0x44800000u; bits += 1021u) {
        float f;
        memcpy(&f, &bits, sizeof f);
        for (int s = 0; s < 2; s++, f = -f, checked++)
            mismatches += nvfp4_float_to_e4m3(f) != e4m3_walk(f);
    }
    for (int c = 0; c < 0x7e; c++) {
        const float mid = 0.5f * (nvfp4_e4m3_to_float((uint8_t) c)
                                  + nvfp4_e4m3_to_float((uint8_t) (c + 1)));  // exact in fp32
        const float around[3] = {nextafterf(mid, 0.0f), mid, nextafterf(mid, 1e9f)};
        for (int i = 0; i < 3; i++, checked++)
            mismatches += nvfp4_float_to_e4m3(around[i]) != e4m3_walk(around[i]);
    }
    CHECK(checked > 100000);
    CHECK(mismatches == 0);
    CHECK(nvfp4_float_to_e4m3(INFINITY) == 0x7e && nvfp4_float_to_e4m3(-INFINITY) == 0xfe);
    CHECK((nvfp4_float_to_e4m3(NAN) & 0x7f) == 0x7f);
    CHECK(nvfp4_float_to_e4m3(460.0f) == 0x7e);  // between 448 and the 480 that e4m3 lacks

    // Every finite code decodes and encodes back to itself.
    int round_trip = 1;
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) continue;  // NaN encodings
        const float f = kern_e4m3_to_f32((uint8_t) c);
        const uint8_t back = kern_f32_to_e4m3(f);
        if (back != c && !(f == 0.0f && (back & 0x7f) == 0)) round_trip = 0;
    }
    CHECK(round_trip);
    CHECK(kern_f32_to_e4m3(448.0f) == 0x7e);
    CHECK(kern_f32_to_e4m3(1e6f) == 0x7e);  // saturates
    CHECK(kern_f32_to_e4m3(-1e6f) == 0xfe);
    CHECK(kern_f32_to_e4m3(1.0f) == 0x38);
    CHECK(kern_f32_to_e4m3(1.0625f) == 0x38);  // halfway 1 .. 1.125: ties to even code 0x38
    CHECK(kern_f32_to_e4m3(1.1875f) == 0x3a);  // halfway 1.125 .. 1.25: even code 0x3a
    CHECK(kern_f32_to_e4m3(0x1p-10f) == 0x00);  // half the smallest subnormal: ties to even 0
    CHECK(kern_f32_to_e4m3(0x1p-9f) == 0x01);
}

static void test_route(void)
{
    // 4 experts, top-2, one group. logits 0 -> s = 0.5; bias lifts expert 3 above expert 1.
    const float logits[4] = {0.0f, 2.0f, -1.0f, 1.0f};
    const float bias[4] = {0.0f, 0.0f, 0.0f, 0.5f};
    int32_t idx[2];
    float w[2];
    moe_route_ref(idx, w, NULL, logits, bias, 1, 4, 2, 1, 1, 2.5f);
    const double s1 = 1.0 / (1.0 + exp(-2.0)), s3 = 1.0 / (1.0 + exp(-1.0));
    // choice: e0 0.5, e1 0.881, e2 0.269, e3 1.231 -> picks 3, then 1; weights use s, not choice.
    CHECK(idx[0] == 3 && idx[1] == 1);
    CHECK_NEAR(w[0], s3 / (s1 + s3) * 2.5, 1e-6);
    CHECK_NEAR(w[1], s1 / (s1 + s3) * 2.5, 1e-6);

    // Group limit: 4 experts in 2 groups, keep 1 group. Group 0 = {0,1}, group 1 = {2,3}.
    // Group scores (sum of top-2 choices): g0 = s(3)+s(-3) = 1.0, g1 = s(2)+s(1.5) = 1.70.
    const float lg2[4] = {3.0f, -3.0f, 2.0f, 1.5f};
    const float zero[4] = {0, 0, 0, 0};
    moe_route_ref(idx, w, NULL, lg2, zero, 1, 4, 2, 2, 1, 1.0f);
    CHECK(idx[0] == 2 && idx[1] == 3);  // expert 0 has the best score but its group is out
}

static void test_topk_ties(void)
{
    const float sc[6] = {1.0f, 3.0f, 1.0f, 3.0f, 1.0f, 2.0f};
    const int32_t len[1] = {6};
    int32_t idx[4], n[1];
    dsa_topk_ref(idx, n, sc, 6, len, 1, 4);
    // 3 (pos 1), 3 (pos 3), 2 (pos 5), then the last 1 (pos 4: among equal scores the later
    // position wins); ascending positions.
    CHECK(n[0] == 4);
    CHECK(idx[0] == 1 && idx[1] == 3 && idx[2] == 4 && idx[3] == 5);
    const int32_t short_len[1] = {3};
    dsa_topk_ref(idx, n, sc, 6, short_len, 1, 4);
    CHECK(n[0] == 3 && idx[0] == 0 && idx[1] == 1 && idx[2] == 2);
}

static void test_rope(void)
{
    // Position 1, theta 1: both pairs rotate by 1 radian; pairs (1, 0) and (0, 2) come out
    // de-interleaved: firsts, then seconds.
    float x[4] = {1.0f, 0.0f, 0.0f, 2.0f};
    const int32_t pos[1] = {1};
    rope_glm_ref(x, pos, 1, 1, 4, 4, 0, 4, 1.0f);
    CHECK_NEAR(x[0], cos(1.0), 1e-7);
    CHECK_NEAR(x[1], -2.0 * sin(1.0), 1e-6);
    CHECK_NEAR(x[2], sin(1.0), 1e-7);
    CHECK_NEAR(x[3], 2.0 * cos(1.0), 1e-6);
    // Position 0 only de-interleaves; dims outside [offset, offset + rot_dim) stay.
    float y[6] = {7.0f, 0.25f, -1.0f, 3.0f, 0.5f, 9.0f};
    const int32_t p0[1] = {0};
    rope_glm_ref(y, p0, 1, 1, 6, 6, 1, 4, 8e6f);
    CHECK(y[0] == 7.0f && y[1] == 0.25f && y[2] == 3.0f && y[3] == -1.0f && y[4] == 0.5f
          && y[5] == 9.0f);
}

static void test_norms(void)
{
    const float x[4] = {2.0f, -2.0f, 2.0f, -2.0f}, w[4] = {1.0f, 2.0f, 1.0f, 1.0f};
    const float b[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    float out[4];
    norm_rms_ref(out, x, w, 0.0f, 1, 4, 4);
    CHECK_NEAR(out[0], 1.0, 1e-7);
    CHECK_NEAR(out[1], -2.0, 1e-7);
    norm_layer_ref(out, x, w, b, 0.0f, 1, 4, 4);
    CHECK_NEAR(out[0], 1.5, 1e-7);
    CHECK_NEAR(out[1], -1.5, 1e-7);
    float act[2];
    const float gate[2] = {1.0f, -2.0f}, up[2] = {3.0f, 0.5f};
    act_silu_mul_ref(act, gate, up, 2);
    CHECK_NEAR(act[0], 3.0 / (1.0 + exp(-1.0)), 1e-6);
    CHECK_NEAR(act[1], -1.0 / (1.0 + exp(2.0)), 1e-7);
}

static void test_nvfp4_format(void)
{
    // E2M1: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
    const float e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int c = 0; c < 8; c++) {
        CHECK(nvfp4_e2m1_to_float((uint8_t) c) == e2m1[c]);
        CHECK(nvfp4_e2m1_to_float((uint8_t) (c | 8)) == -e2m1[c]);
    }
    // E4M3 (bias 7, subnormals below 2^-6, 448 the largest finite value).
    CHECK(nvfp4_e4m3_to_float(0x38) == 1.0f);
    CHECK(nvfp4_e4m3_to_float(0x40) == 2.0f);
    CHECK(nvfp4_e4m3_to_float(0x7e) == 448.0f);
    CHECK(nvfp4_e4m3_to_float(0xfe) == -448.0f);
    CHECK(nvfp4_e4m3_to_float(0x08) == 0x1p-6f);  // the smallest normal
    CHECK(nvfp4_e4m3_to_float(0x01) == 0x1p-9f);  // the smallest subnormal
    CHECK(nvfp4_e4m3_to_float(0x00) == 0.0f);
}

static void test_nvfp4_weight(void)
{
    // One row of 32 weights: byte 0 = 0x21 -> codes 1 (0.5) then 2 (1.0); byte 8 = 0x9f ->
    // codes 15 (-6) then 9 (-0.5); group 0 scale 0x38 (1.0), group 1 scale 0x40 (2.0).
    uint8_t q[16] = {0x21, 0, 0, 0, 0, 0, 0, 0, 0x9f, 0, 0, 0, 0, 0, 0, 0};
    const uint8_t sc[2] = {0x38, 0x40};
    CHECK(nvfp4_weight_ref(q, sc, 0.5f, 32, 0, 0) == 0.25);
    CHECK(nvfp4_weight_ref(q, sc, 0.5f, 32, 0, 1) == 0.5);
    CHECK(nvfp4_weight_ref(q, sc, 0.5f, 32, 0, 16) == -6.0);
    CHECK(nvfp4_weight_ref(q, sc, 0.5f, 32, 0, 17) == -0.5);
    CHECK(nvfp4_weight_ref(q, sc, 0.5f, 32, 0, 2) == 0.0);
}

static void test_mla_one_position(void)
{
    // A bf16 cache with one position: attention over one position returns its c_kv exactly.
    enum { LK = 576, TB = 1152 };
    static uint8_t cache[128 * TB];
    const float vals[3] = {0.5f, -1.25f, 3.0f};
    for (int c = 0; c < LK; c++) {
        const uint16_t b = kern_f32_to_bf16(vals[c % 3]);
        memcpy(cache + 2 * c, &b, 2);
    }
    float q_lat[512], q_pe[64], out[512];
    for (int c = 0; c < 512; c++) q_lat[c] = 0.01f * (c % 7);
    for (int c = 0; c < 64; c++) q_pe[c] = -0.02f;
    const int32_t table[1] = {0}, seq[1] = {0}, len[1] = {1};
    mla_decode_ref(out, NULL, NULL, q_lat, q_pe, cache, 1, table, 1, seq, len, NULL, 0, 1, 1,
                   1.0f / 16.0f);
    int same = 1;
    for (int c = 0; c < 512; c++) same &= out[c] == vals[c % 3];
    CHECK(same);
}

int main(void)
{
    test_nvfp4_format();
    test_nvfp4_weight();
    test_mla_one_position();
    test_bf16();
    test_e4m3();
    test_route();
    test_topk_ties();
    test_rope();
    test_norms();
    return check_exit();
}
