/*
 * checkpoint.c - safetensors shards: header validation, read-only mappings, per-tensor
 * weight format resolution and row dequantization.
 *
 * A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
 * ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then
 * the data region; offsets are relative to the data region. We check everything a later
 * reader would trust: N fits the file, the JSON is an object of well-formed entries, each
 * dtype is one we know, each dimension is non-negative and the element count times the
 * dtype size equals end - begin without overflow, and end lies inside the file. Offsets
 * are not required to be disjoint (the format does not say so and nothing here writes).
 *
 * Sharded checkpoints list tensor -> shard file in model.safetensors.index.json. Every
 * tensor in the index must be found in the shard it names; shards may hold more. The
 * filtered open reads the index first and maps only shards holding wanted tensors.
 *
 * Mappings are MAP_PRIVATE/PROT_READ of the whole file; nothing is read until touched.
 * Shard file descriptors stay open so that ckpt_release() can drop the page cache
 * (posix_fadvise DONTNEED) behind a consumer: on unified-memory machines (GB10) cached file
 * pages compete with GPU allocations.
 */
#define _DEFAULT_SOURCE  // madvise(MADV_DONTNEED)

#include "engine/model/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine/shared/clock.h"
#include "kernels/nvfp4_format.h"

// safetensors' own limit on the header (MAX_HEADER_SIZE in the reference implementation).
#define CKPT_MAX_HEADER_BYTES ((uint64_t) 100000000)

struct CkptShard {
    char *path;    // owned
    int fd;        // -1 when closed
    uint8_t *map;  // [size] read-only mapping, or NULL for an empty file
    size_t size;
    char *names;  // owned storage for this shard's tensor names
};

// ---------------------------------------------------------------------------
// Dtypes

static const struct {
    const char *name;
    size_t size;
} dtype_info[] = {
    [CKPT_DTYPE_F32] = {"F32", 4},   [CKPT_DTYPE_F16] = {"F16", 2},
    [CKPT_DTYPE_BF16] = {"BF16", 2}, [CKPT_DTYPE_F8_E4M3] = {"F8_E4M3", 1},
    [CKPT_DTYPE_U8] = {"U8", 1},     [CKPT_DTYPE_I8] = {"I8", 1},
    [CKPT_DTYPE_I32] = {"I32", 4},   [CKPT_DTYPE_I64] = {"I64", 8},
    [CKPT_DTYPE_F64] = {"F64", 8},   [CKPT_DTYPE_BOOL] = {"BOOL", 1},
};
enum { CKPT_N_DTYPES = (int) (sizeof dtype_info / sizeof dtype_info[0]) };

size_t ckpt_dtype_size(CkptDtype dtype)
{
    ASSERT((int) dtype >= 0 && (int) dtype < CKPT_N_DTYPES);
    return dtype_info[dtype].size;
}

const char *ckpt_dtype_name(CkptDtype dtype)
{
    if ((int) dtype < 0 || (int) dtype >= CKPT_N_DTYPES) return "?";
    return dtype_info[dtype].name;
}

const char *ckpt_linear_format_name(CkptLinearFormat format)
{
    switch (format) {
    case CKPT_LINEAR_F32:
        return "F32";
    case CKPT_LINEAR_F16:
        return "F16";
    case CKPT_LINEAR_BF16:
        return "BF16";
    case CKPT_LINEAR_FP8:
        return "FP8";
    case CKPT_LINEAR_NVFP4:
        return "NVFP4";
    }
    return "?";
}

static bool dtype_parse(const char *s, CkptDtype *out)
{
    for (int i = 0; i < CKPT_N_DTYPES; i++) {
        if (!strcmp(s, dtype_info[i].name)) {
            *out = (CkptDtype) i;
            return true;
        }
    }
    return false;
}

// ---------------------------------------------------------------------------
// Header parsing

// A non-negative JSON integer, or -1.
static int64_t json_uint(json_object *v)
{
    if (!json_object_is_type(v, json_type_int)) return -1;
    const int64_t x = json_object_get_int64(v);
    return x >= 0 && x < INT64_MAX ? x : -1;
}

// Validate one tensor entry; fills t (name excepted). data_size = bytes after the header.
static Err parse_entry(const char *origin, const char *name, json_object *entry, uint64_t data_size,
                       CkptTensor *t, uint64_t *begin_out)
{
    json_object *dtype = NULL, *shape = NULL, *offsets = NULL;
    if (!json_object_is_type(entry, json_type_object)) {
        LOG_ERROR("%s: tensor \"%s\": entry must be an object", origin, name);
        return ERR_FORMAT;
    }
    json_object_object_get_ex(entry, "dtype", &dtype);
    json_object_object_get_ex(entry, "shape", &shape);
    json_object_object_get_ex(entry, "data_offsets", &offsets);
    if (!json_object_is_type(dtype, json_type_string)
        || !json_object_is_type(shape, json_type_array)
        || !json_object_is_type(offsets, json_type_array)) {
        LOG_ERROR("%s: tensor \"%s\": needs string \"dtype\", list \"shape\" and list "
                  "\"data_offsets\"",
                  origin, name);
        return ERR_FORMAT;
    }
    if (!dtype_parse(json_object_get_string(dtype), &t->dtype)) {
        LOG_ERROR("%s: tensor \"%s\": unsupported dtype \"%.16s\"", origin, name,
                  json_object_get_string(dtype));
        return ERR_FORMAT;
    }
    const size_t n_dims = json_object_array_length(shape);
    if (n_dims > CKPT_MAX_DIMS) {
        LOG_ERROR("%s: tensor \"%s\": %zu dimensions, at most %d are supported", origin, name,
                  n_dims, CKPT_MAX_DIMS);
        return ERR_FORMAT;
    }
    // Element count, checked against overflow: every partial product stays <= data_size,
    // which is a real file size, unless some dimension is zero.
    uint64_t n_elems = 1;
    bool has_zero = false;
    t->n_dims = (int) n_dims;
    for (size_t i = 0; i < n_dims; i++) {
        const int64_t d = json_uint(json_object_array_get_idx(shape, i));
        if (d < 0) {
            LOG_ERROR("%s: tensor \"%s\": shape[%zu] is not a non-negative integer", origin, name,
                      i);
            return ERR_FORMAT;
        }
        t->shape[i] = d;
        if (d == 0) has_zero = true;
        if (!has_zero && d > 0 && n_elems > UINT64_MAX / (uint64_t) d) {
            LOG_ERROR("%s: tensor \"%s\": shape overflows", origin, name);
            return ERR_FORMAT;
        }
        n_elems = has_zero ? 0 : n_elems * (uint64_t) d;
    }
    for (size_t i = n_dims; i < CKPT_MAX_DIMS; i++) {
        t->shape[i] = 0;
    }
    const uint64_t elem = dtype_info[t->dtype].size;
    if (n_elems > UINT64_MAX / elem) {
        LOG_ERROR("%s: tensor \"%s\": shape overflows", origin, name);
        return ERR_FORMAT;
    }
    const uint64_t n_bytes = n_elems * elem;
    if (json_object_array_length(offsets) != 2) {
        LOG_ERROR("%s: tensor \"%s\": \"data_offsets\" must be [begin, end]", origin, name);
        return ERR_FORMAT;
    }
    const int64_t begin = json_uint(json_object_array_get_idx(offsets, 0));
    const int64_t end = json_uint(json_object_array_get_idx(offsets, 1));
    if (begin < 0 || end < begin) {
        LOG_ERROR("%s: tensor \"%s\": bad data_offsets", origin, name);
        return ERR_FORMAT;
    }
    if ((uint64_t) end > data_size) {
        LOG_ERROR("%s: tensor \"%s\": data_offsets end %lld lies beyond the data region "
                  "(%llu bytes): the file is truncated",
                  origin, name, (long long) end, (unsigned long long) data_size);
        return ERR_FORMAT;
    }
    if ((uint64_t) (end - begin) != n_bytes) {
        LOG_ERROR("%s: tensor \"%s\": data_offsets span %lld bytes but %s%s needs %llu", origin,
                  name, (long long) (end - begin), ckpt_dtype_name(t->dtype),
                  n_dims ? " of its shape" : " scalar", (unsigned long long) n_bytes);
        return ERR_FORMAT;
    }
    t->n_bytes = (size_t) n_bytes;
    *begin_out = (uint64_t) begin;
    return ERR_OK;
}

Err ckpt_parse_header(const uint8_t *buf, size_t len, uint64_t file_size, const char *origin,
                      CkptTensor **tensors_out, int *n_tensors_out, char **names_out)
{
    Err err = ERR_OK;
    json_tokener *tok = NULL;
    json_object *root = NULL;
    CkptTensor *tensors = NULL;
    char *names = NULL;
    int n = 0;
    if (!origin) origin = "safetensors";
    if (len < 8 || file_size < 8) {
        LOG_ERROR("%s: %llu bytes is too short for a safetensors file", origin,
                  (unsigned long long) (len < file_size ? len : file_size));
        return ERR_FORMAT;
    }
    uint64_t n_header = 0;
    for (int i = 7; i >= 0; i--) {
        n_header = n_header << 8 | buf[i];
    }
    if (n_header < 2 || n_header > CKPT_MAX_HEADER_BYTES || n_header > file_size - 8) {
        LOG_ERROR("%s: header length %llu does not fit the file (%llu bytes)", origin,
                  (unsigned long long) n_header, (unsigned long long) file_size);
        return ERR_FORMAT;
    }
    if (n_header > len - 8) {
        LOG_ERROR("%s: header length %llu exceeds the %zu bytes available", origin,
                  (unsigned long long) n_header, len - 8);
        return ERR_FORMAT;
    }
    const char *text = (const char *) buf + 8;
    if (text[0] != '{') {
        LOG_ERROR("%s: header does not start with '{'", origin);
        return ERR_FORMAT;
    }
    if (!(tok = json_tokener_new())) {
        err = ERR_NOMEM;
        goto done;
    }
    root = json_tokener_parse_ex(tok, text, (int) n_header);
    if (!root || json_tokener_get_error(tok) != json_tokener_success) {
        LOG_ERROR("%s: header is not valid JSON: %s", origin,
                  json_tokener_get_error(tok) == json_tokener_continue
                      ? "unexpected end of header"
                      : json_tokener_error_desc(json_tokener_get_error(tok)));
        err = ERR_FORMAT;
        goto done;
    }
    for (size_t i = json_tokener_get_parse_end(tok); i < n_header; i++) {
        if (text[i] != ' ' && text[i] != '\n' && text[i] != '\r' && text[i] != '\t') {
            LOG_ERROR("%s: header has trailing bytes after the JSON object", origin);
            err = ERR_FORMAT;
            goto done;
        }
    }
    if (!json_object_is_type(root, json_type_object)) {
        LOG_ERROR("%s: header must be a JSON object", origin);
        err = ERR_FORMAT;
        goto done;
    }
    const int n_entries = json_object_object_length(root);
    size_t names_bytes = 1;
    {
        json_object_object_foreach(root, key, val)
        {
            (void) val;
            names_bytes += strlen(key) + 1;
        }
    }
    tensors = calloc(n_entries > 0 ? (size_t) n_entries : 1, sizeof *tensors);
    names = malloc(names_bytes);
    if (!tensors || !names) {
        err = ERR_NOMEM;
        goto done;
    }
    const uint64_t data_size = file_size - 8 - n_header;
    const bool have_data = len == file_size;
    size_t name_pos = 0;
    json_object_object_foreach(root, key, val)
    {
        if (!strcmp(key, "__metadata__")) {
            if (!json_object_is_type(val, json_type_object)) {
                LOG_ERROR("%s: \"__metadata__\" must be an object", origin);
                err = ERR_FORMAT;
                goto done;
            }
            continue;
        }
        if (!key[0]) {
            LOG_ERROR("%s: a tensor has an empty name", origin);
            err = ERR_FORMAT;
            goto done;
        }
        CkptTensor *t = &tensors[n];
        uint64_t begin = 0;
        if ((err = parse_entry(origin, key, val, data_size, t, &begin))) goto done;
        const size_t key_len = strlen(key);
        memcpy(names + name_pos, key, key_len + 1);
        t->name = names + name_pos;
        name_pos += key_len + 1;
        t->data = have_data ? buf + 8 + n_header + begin : NULL;
        t->shard = 0;
        n++;
    }
    *tensors_out = tensors;
    *n_tensors_out = n;
    *names_out = names;
    tensors = NULL;  // ownership moved to the caller
    names = NULL;
done:
    json_object_put(root);
    if (tok) json_tokener_free(tok);
    free(tensors);
    free(names);
    return err;
}

// ---------------------------------------------------------------------------
// Opening

static int tensor_cmp(const void *a, const void *b)
{
    return strcmp(((const CkptTensor *) a)->name, ((const CkptTensor *) b)->name);
}

static char *dup_string(const char *s)
{
    const size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

// Open and map one shard, parse its header and append the kept tensors to ck.
static Err open_shard(Ckpt *ck, const char *path, CkptFilter keep, void *user)
{
    Err err = ERR_OK;
    CkptTensor *tensors = NULL;
    char *names = NULL;
    int n = 0;
    CkptShard *sh = &ck->shards[ck->n_shards];
    memset(sh, 0, sizeof *sh);
    sh->fd = -1;
    if (!(sh->path = dup_string(path))) return ERR_NOMEM;
    ck->n_shards++;  // counted now so that ckpt_close frees a half-opened shard
    sh->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (sh->fd < 0) {
        LOG_ERROR("could not open checkpoint shard \"%s\": %s", path, strerror(errno));
        return ERR_IO;
    }
    struct stat st;
    if (fstat(sh->fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        LOG_ERROR("could not open checkpoint shard \"%s\": not a regular file", path);
        return ERR_IO;
    }
    sh->size = (size_t) st.st_size;
    if (sh->size < 8) {
        LOG_ERROR("%s: %zu bytes is too short for a safetensors file", path, sh->size);
        return ERR_FORMAT;
    }
    void *map = mmap(NULL, sh->size, PROT_READ, MAP_PRIVATE, sh->fd, 0);
    if (map == MAP_FAILED) {
        LOG_ERROR("could not map checkpoint shard \"%s\" (%zu bytes): %s", path, sh->size,
                  strerror(errno));
        return ERR_IO;
    }
    sh->map = map;
    ck->n_bytes_mapped += sh->size;
    if ((err = ckpt_parse_header(sh->map, sh->size, sh->size, path, &tensors, &n, &names))) {
        goto done;
    }
    sh->names = names;
    names = NULL;  // ownership moved to the shard
    int n_keep = 0;
    for (int i = 0; i < n; i++) {
        n_keep += !keep || keep(tensors[i].name, user);
    }
    CkptTensor *grown =
        realloc(ck->tensors, ((size_t) ck->n_tensors + (size_t) n_keep + 1) * sizeof *grown);
    if (!grown) {
        err = ERR_NOMEM;
        goto done;
    }
    ck->tensors = grown;
    bool warned = false;
    for (int i = 0; i < n; i++) {
        if (keep && !keep(tensors[i].name, user)) continue;
        CkptTensor *t = &ck->tensors[ck->n_tensors++];
        *t = tensors[i];
        t->shard = ck->n_shards - 1;
        const size_t elem = ckpt_dtype_size(t->dtype);
        if (!warned && t->n_bytes && (uintptr_t) t->data % elem) {
            // The format does not require alignment; consumers read through memcpy-safe
            // paths, but the fast paths want aligned data (safetensors' writer sorts by
            // dtype to keep it).
            LOG_WARN("%s: tensor \"%s\" (%s) is not aligned to its element size", path, t->name,
                     ckpt_dtype_name(t->dtype));
            warned = true;
        }
    }
done:
    free(tensors);
    free(names);
    return err;
}

typedef struct IndexEntry {
    const char *tensor;
    const char *file;
} IndexEntry;

static bool safe_shard_name(const char *f)
{
    return f[0] && f[0] != '.' && !strchr(f, '/') && strlen(f) < 1024;
}

// Parse model.safetensors.index.json into the list of distinct shard files (in first-seen
// order) holding a kept tensor, and the entries for the kept tensors.
static Err read_index(const char *path, CkptFilter keep, void *user, json_object **root_out,
                      IndexEntry **entries_out, int *n_entries_out, const char ***files_out,
                      int *n_files_out)
{
    Err err = ERR_OK;
    IndexEntry *entries = NULL;
    const char **files = NULL;
    int n_entries = 0, n_files = 0;
    json_object *root = json_object_from_file(path);
    json_object *map = NULL;
    if (!root || !json_object_is_type(root, json_type_object)) {
        LOG_ERROR("could not read checkpoint index \"%s\": %s", path,
                  root ? "not a JSON object" : json_util_get_last_err());
        err = root ? ERR_FORMAT : ERR_IO;
        goto done;
    }
    if (!json_object_object_get_ex(root, "weight_map", &map)
        || !json_object_is_type(map, json_type_object)) {
        LOG_ERROR("%s: field \"weight_map\" must be an object", path);
        err = ERR_FORMAT;
        goto done;
    }
    const int n_map = json_object_object_length(map);
    entries = calloc((size_t) n_map + 1, sizeof *entries);
    files = calloc((size_t) n_map + 1, sizeof *files);
    if (!entries || !files) {
        err = ERR_NOMEM;
        goto done;
    }
    json_object_object_foreach(map, name, val)
    {
        if (!json_object_is_type(val, json_type_string)
            || !safe_shard_name(json_object_get_string(val))) {
            LOG_ERROR("%s: weight_map[\"%s\"] must be a file name in the model directory", path,
                      name);
            err = ERR_FORMAT;
            goto done;
        }
        if (keep && !keep(name, user)) continue;
        const char *file = json_object_get_string(val);
        entries[n_entries++] = (IndexEntry){name, file};
        int j = 0;
        while (j < n_files && strcmp(files[j], file)) {
            j++;
        }
        if (j == n_files) files[n_files++] = file;
    }
    *root_out = root;
    *entries_out = entries;
    *n_entries_out = n_entries;
    *files_out = files;
    *n_files_out = n_files;
    root = NULL;  // ownership moved to the caller (entries point into it)
    entries = NULL;
    files = NULL;
done:
    json_object_put(root);
    free(entries);
    free(files);
    return err;
}

const CkptTensor *ckpt_find(const Ckpt *ck, const char *name)
{
    if (!ck->tensors || !name) return NULL;
    const CkptTensor key = {.name = name};
    return bsearch(&key, ck->tensors, (size_t) ck->n_tensors, sizeof key, tensor_cmp);
}

const char *ckpt_shard_path(const Ckpt *ck, const CkptTensor *t)
{
    ASSERT(t->shard >= 0 && t->shard < ck->n_shards);
    return ck->shards[t->shard].path;
}

Err ckpt_open_filtered(Ckpt *ck, const char *model_dir, CkptFilter keep, void *user)
{
    Err err = ERR_OK;
    json_object *index = NULL;
    IndexEntry *entries = NULL;
    const char **files = NULL;
    int n_entries = 0, n_files = 0;
    char path[4096], index_path[4096];
    const double t0 = clock_now_s();
    memset(ck, 0, sizeof *ck);
    if (!(ck->dir = dup_string(model_dir))) {
        err = ERR_NOMEM;
        goto done;
    }
    snprintf(index_path, sizeof index_path, "%s/model.safetensors.index.json", model_dir);
    snprintf(path, sizeof path, "%s/model.safetensors", model_dir);
    const bool have_index = access(index_path, F_OK) == 0;
    if (!have_index && access(path, F_OK) != 0) {
        LOG_ERROR("could not open checkpoint \"%s\": neither model.safetensors nor "
                  "model.safetensors.index.json exists",
                  model_dir);
        err = ERR_IO;
        goto done;
    }
    if (have_index) {
        if ((err = read_index(index_path, keep, user, &index, &entries, &n_entries, &files,
                              &n_files))) {
            goto done;
        }
    } else {
        static const char *single = "model.safetensors";
        files = malloc(sizeof *files);
        if (!files) {
            err = ERR_NOMEM;
            goto done;
        }
        files[0] = single;
        n_files = 1;
    }
    if (!(ck->shards = calloc((size_t) n_files + 1, sizeof *ck->shards))) {
        err = ERR_NOMEM;
        goto done;
    }
    for (int i = 0; i < n_files; i++) {
        snprintf(path, sizeof path, "%s/%s", model_dir, files[i]);
        if ((err = open_shard(ck, path, keep, user))) goto done;
    }
    if (ck->n_tensors > 1) {
        qsort(ck->tensors, (size_t) ck->n_tensors, sizeof *ck->tensors, tensor_cmp);
    }
    for (int i = 1; i < ck->n_tensors; i++) {
        if (!strcmp(ck->tensors[i - 1].name, ck->tensors[i].name)) {
            LOG_ERROR("checkpoint \"%s\": tensor \"%s\" appears in both \"%s\" and \"%s\"",
                      model_dir, ck->tensors[i].name, ckpt_shard_path(ck, &ck->tensors[i - 1]),
                      ckpt_shard_path(ck, &ck->tensors[i]));
            err = ERR_FORMAT;
            goto done;
        }
    }
    for (int i = 0; i < n_entries; i++) {
        const CkptTensor *t = ckpt_find(ck, entries[i].tensor);
        snprintf(path, sizeof path, "%s/%s", model_dir, entries[i].file);
        if (!t) {
            LOG_ERROR("tensor \"%s\" listed in \"%s\" is missing from \"%s\"", entries[i].tensor,
                      index_path, path);
            err = ERR_NOTFOUND;
            goto done;
        }
        if (strcmp(ckpt_shard_path(ck, t), path) != 0) {
            LOG_ERROR("tensor \"%s\" is in \"%s\" but \"%s\" places it in \"%s\"",
                      entries[i].tensor, ckpt_shard_path(ck, t), index_path, path);
            err = ERR_FORMAT;
            goto done;
        }
    }
    LOG_INFO("opened checkpoint \"%s\": %d shards, %d tensors, %.3f GB mapped in %.3f s", model_dir,
             ck->n_shards, ck->n_tensors, (double) ck->n_bytes_mapped / 1e9, clock_now_s() - t0);
done:
    json_object_put(index);
    free(entries);
    free(files);
    if (err) ckpt_close(ck);
    return err;
}

Err ckpt_open(Ckpt *ck, const char *model_dir)
{
    return ckpt_open_filtered(ck, model_dir, NULL, NULL);
}

void ckpt_close(Ckpt *ck)
{
    if (!ck) return;
    for (int i = 0; i < ck->n_shards; i++) {
        CkptShard *sh = &ck->shards[i];
        if (sh->map) munmap(sh->map, sh->size);
        if (sh->fd >= 0) close(sh->fd);
        free(sh->path);
        free(sh->names);
    }
    free(ck->shards);
    free(ck->tensors);
    free(ck->dir);
    memset(ck, 0, sizeof *ck);
}

void ckpt_release(const Ckpt *ck, const CkptTensor *t)
{
    if (!t || !t->n_bytes) return;
    const CkptShard *sh = &ck->shards[t->shard];
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    const size_t begin = (size_t) ((const uint8_t *) t->data - sh->map);
    const size_t end = begin + t->n_bytes;
    // Whole pages inside the tensor only: a neighbour sharing an edge page keeps it.
    const size_t first = (begin + page - 1) / page * page, last = end / page * page;
    if (last > first) madvise(sh->map + first, last - first, MADV_DONTNEED);
    posix_fadvise(sh->fd, (off_t) begin, (off_t) t->n_bytes, POSIX_FADV_DONTNEED);
}

void ckpt_touch(const Ckpt *ck, CkptTouchStats *stats)
{
    uint64_t sum = 0, done_bytes = 0, total = 0;
    for (int i = 0; i < ck->n_tensors; i++) {
        total += ck->tensors[i].n_bytes;
    }
    const double t0 = clock_now_s();
    double last_log = t0;
    // Fault each shard's span of wanted tensors in with one call where the kernel can
    // (Linux >= 5.14): page-by-page faults of a cached file cost more than reading it.
    // MADV_WILLNEED starts readahead for a cold cache. Both are hints; the loop below reads
    // everything either way. A filtered Ckpt only populates the span its tensors cover.
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    for (int s = 0; s < ck->n_shards; s++) {
        const CkptShard *sh = &ck->shards[s];
        size_t lo = SIZE_MAX, hi = 0;
        for (int i = 0; i < ck->n_tensors; i++) {
            const CkptTensor *t = &ck->tensors[i];
            if (t->shard != s || !t->n_bytes) continue;
            const size_t off = (size_t) ((const uint8_t *) t->data - sh->map);
            lo = off < lo ? off : lo;
            hi = off + t->n_bytes > hi ? off + t->n_bytes : hi;
        }
        if (!sh->map || hi <= lo) continue;
        lo = lo / page * page;
        madvise(sh->map + lo, hi - lo, MADV_WILLNEED);
#ifdef MADV_POPULATE_READ
        madvise(sh->map + lo, hi - lo, MADV_POPULATE_READ);
#endif
    }
    for (int i = 0; i < ck->n_tensors; i++) {
        const CkptTensor *t = &ck->tensors[i];
        const uint8_t *p = t->data;
        size_t j = 0;
        for (; j + 8 <= t->n_bytes; j += 8) {
            uint64_t w;
            memcpy(&w, p + j, 8);
            sum += w;
        }
        for (; j < t->n_bytes; j++) {
            sum += p[j];
        }
        done_bytes += t->n_bytes;
        const double now = clock_now_s();
        if (now - last_log >= 2.0) {
            const double rate = (double) done_bytes / (now - t0);
            LOG_INFO("loading \"%s\": %.2f / %.2f GB, %.2f GB/s, ETA %.0f s", ck->dir,
                     (double) done_bytes / 1e9, (double) total / 1e9, rate / 1e9,
                     (double) (total - done_bytes) / rate);
            last_log = now;
        }
    }
    const double seconds = clock_now_s() - t0;
    const double gbps = seconds > 0 ? (double) done_bytes / seconds / 1e9 : 0.0;
    LOG_INFO("loaded \"%s\": %.3f GB in %.3f s, %.2f GB/s", ck->dir, (double) done_bytes / 1e9,
             seconds, gbps);
    if (stats) {
        stats->n_bytes = done_bytes;
        stats->seconds = seconds;
        stats->gb_per_s = gbps;
        stats->checksum = sum;
    }
}

// ---------------------------------------------------------------------------
// Lookups and weight formats

static void describe_shape(const int64_t *shape, int n_dims, char *buf, size_t cap)
{
    size_t pos = (size_t) snprintf(buf, cap, "[");
    for (int i = 0; i < n_dims && pos < cap; i++) {
        pos +=
            (size_t) snprintf(buf + pos, cap - pos, "%s%lld", i ? ", " : "", (long long) shape[i]);
    }
    if (pos < cap) snprintf(buf + pos, cap - pos, "]");
}

// The file a missing tensor should have been in: the single shard, or the index.
static const char *where(const Ckpt *ck, char *buf, size_t cap)
{
    if (ck->n_shards == 1) return ck->shards[0].path;
    snprintf(buf, cap, "%s/model.safetensors.index.json", ck->dir ? ck->dir : ".");
    return buf;
}

Err ckpt_get(const Ckpt *ck, const char *name, int n_dims, const int64_t *shape,
             unsigned allowed_dtypes, const CkptTensor **out)
{
    const CkptTensor *t = ckpt_find(ck, name);
    if (!t) {
        char file[4200];
        LOG_ERROR("tensor \"%s\" not found in \"%s\"", name, where(ck, file, sizeof file));
        return ERR_NOTFOUND;
    }
    bool same = t->n_dims == n_dims;
    for (int i = 0; same && i < n_dims; i++) {
        same = t->shape[i] == shape[i];
    }
    if (!same) {
        char got[96], want[96];
        describe_shape(t->shape, t->n_dims, got, sizeof got);
        describe_shape(shape, n_dims, want, sizeof want);
        LOG_ERROR("tensor \"%s\" in \"%s\" has shape %s, expected %s", name, ckpt_shard_path(ck, t),
                  got, want);
        return ERR_FORMAT;
    }
    if (!(allowed_dtypes & CKPT_DTYPE_BIT(t->dtype))) {
        LOG_ERROR("tensor \"%s\" in \"%s\" has dtype %s, which is not accepted here", name,
                  ckpt_shard_path(ck, t), ckpt_dtype_name(t->dtype));
        return ERR_FORMAT;
    }
    *out = t;
    return ERR_OK;
}

// A per-tensor f32 scale stored 0-dim or as [1].
static Err get_scalar_f32(const Ckpt *ck, const char *name, float *out)
{
    const CkptTensor *t = ckpt_find(ck, name);
    if (!t) {
        char file[4200];
        LOG_ERROR("tensor \"%s\" not found in \"%s\"", name, where(ck, file, sizeof file));
        return ERR_NOTFOUND;
    }
    if (t->dtype != CKPT_DTYPE_F32 || t->n_bytes != 4 || t->n_dims > 1) {
        LOG_ERROR("tensor \"%s\" in \"%s\" must be a single F32 (0-dim or [1]), not %s with %d "
                  "dims",
                  name, ckpt_shard_path(ck, t), ckpt_dtype_name(t->dtype), t->n_dims);
        return ERR_FORMAT;
    }
    float v;
    memcpy(&v, t->data, 4);
    if (!(v > 0.0f) || v > 3.0e38f) {
        LOG_ERROR("tensor \"%s\" in \"%s\" holds %g; a scale must be finite and positive", name,
                  ckpt_shard_path(ck, t), (double) v);
        return ERR_FORMAT;
    }
    *out = v;
    return ERR_OK;
}

// NVFP4 codes + e4m3 group scales, shared by both layouts.
static Err get_nvfp4(const Ckpt *ck, const char *codes_name, const char *scale_name, int rows,
                     int cols, CkptLinear *w)
{
    Err err = ERR_OK;
    const CkptTensor *codes = NULL, *scale = NULL;
    if (cols % NVFP4_GROUP) {
        LOG_ERROR("tensor \"%s\": NVFP4 needs in-features divisible by %d, not %d", codes_name,
                  NVFP4_GROUP, cols);
        return ERR_INVAL;
    }
    const int64_t codes_shape[2] = {rows, cols / 2};
    const int64_t scale_shape[2] = {rows, cols / NVFP4_GROUP};
    if ((err = ckpt_get(ck, codes_name, 2, codes_shape, CKPT_DTYPE_BIT(CKPT_DTYPE_U8), &codes))) {
        return err;
    }
    if ((err = ckpt_get(ck, scale_name, 2, scale_shape,
                        CKPT_DTYPE_BIT(CKPT_DTYPE_F8_E4M3) | CKPT_DTYPE_BIT(CKPT_DTYPE_U8),
                        &scale))) {
        return err;
    }
    // E4M3 "fn" has no infinities; 0x7f/0xff are NaN and would poison a whole group.
    const uint8_t *s = scale->data;
    for (size_t i = 0; i < scale->n_bytes; i++) {
        if ((s[i] & 0x7f) == 0x7f) {
            LOG_ERROR("tensor \"%s\" in \"%s\": scale [%zu, %zu] is a NaN encoding (0x%02x)",
                      scale_name, ckpt_shard_path(ck, scale), i / (size_t) (cols / NVFP4_GROUP),
                      i % (size_t) (cols / NVFP4_GROUP), s[i]);
            return ERR_FORMAT;
        }
    }
    w->format = CKPT_LINEAR_NVFP4;
    w->data = codes->data;
    w->scale = s;
    return ERR_OK;
}

Err ckpt_linear(const Ckpt *ck, const char *base, int rows, int cols, CkptLinear *out)
{
    Err err = ERR_OK;
    char name[512], aux[512];
    CkptLinear w = {.rows = rows, .cols = cols, .global_scale = 1.0f};
    if (rows <= 0 || cols <= 0 || strlen(base) > 400) {
        LOG_ERROR("linear \"%.400s\": bad request for a [%d, %d] weight", base, rows, cols);
        return ERR_INVAL;
    }
    snprintf(name, sizeof name, "%s.weight_packed", base);
    const CkptTensor *packed = ckpt_find(ck, name);
    snprintf(name, sizeof name, "%s.weight", base);
    const CkptTensor *t = packed ? packed : ckpt_find(ck, name);
    if (!t) {
        char file[4200];
        LOG_ERROR("tensor \"%s\" not found in \"%s\"", name, where(ck, file, sizeof file));
        return ERR_NOTFOUND;
    }
    w.name = t->name;
    if (packed) {
        // compressed-tensors NVFP4: weight_global_scale is a divisor.
        snprintf(aux, sizeof aux, "%s.weight_scale", base);
        if ((err = get_nvfp4(ck, packed->name, aux, rows, cols, &w))) return err;
        snprintf(aux, sizeof aux, "%s.weight_global_scale", base);
        float gs = 0.0f;
        if ((err = get_scalar_f32(ck, aux, &gs))) return err;
        w.global_scale = 1.0f / gs;
    } else if (t->dtype == CKPT_DTYPE_U8) {
        // ModelOpt NVFP4; input_scale (activations) is not used in W4A16.
        snprintf(aux, sizeof aux, "%s.weight_scale", base);
        if ((err = get_nvfp4(ck, t->name, aux, rows, cols, &w))) return err;
        snprintf(aux, sizeof aux, "%s.weight_scale_2", base);
        if ((err = get_scalar_f32(ck, aux, &w.global_scale))) return err;
    } else if (t->dtype == CKPT_DTYPE_F8_E4M3) {
        const int64_t shape[2] = {rows, cols};
        if ((err = ckpt_get(ck, name, 2, shape, CKPT_DTYPE_BIT(CKPT_DTYPE_F8_E4M3), &t))) {
            return err;
        }
        w.format = CKPT_LINEAR_FP8;
        w.data = t->data;
        snprintf(aux, sizeof aux, "%s.weight_scale_inv", base);
        const CkptTensor *inv = ckpt_find(ck, aux);
        if (inv && inv->n_bytes > 4) {
            // DeepSeek-style 128x128 blocks; despite the name the value multiplies.
            const int64_t bshape[2] = {(rows + 127) / 128, (cols + 127) / 128};
            if ((err = ckpt_get(ck, aux, 2, bshape, CKPT_DTYPE_BIT(CKPT_DTYPE_F32), &inv))) {
                return err;
            }
            w.scale_f32 = inv->data;
        } else if (inv) {
            if ((err = get_scalar_f32(ck, aux, &w.global_scale))) return err;
        } else {
            snprintf(aux, sizeof aux, "%s.weight_scale", base);
            if ((err = get_scalar_f32(ck, aux, &w.global_scale))) return err;
        }
    } else {
        const int64_t shape[2] = {rows, cols};
        const unsigned plain = CKPT_DTYPE_BIT(CKPT_DTYPE_BF16) | CKPT_DTYPE_BIT(CKPT_DTYPE_F16)
                               | CKPT_DTYPE_BIT(CKPT_DTYPE_F32);
        if ((err = ckpt_get(ck, name, 2, shape, plain, &t))) return err;
        w.format = t->dtype == CKPT_DTYPE_BF16  ? CKPT_LINEAR_BF16
                   : t->dtype == CKPT_DTYPE_F16 ? CKPT_LINEAR_F16
                                                : CKPT_LINEAR_F32;
        w.data = t->data;
    }
    *out = w;
    return ERR_OK;
}

// ---------------------------------------------------------------------------
// Dequantization

static float f16_to_float(uint16_t h)
{
    const int exponent = (h >> 10) & 31, mantissa = h & 1023;
    float v;
    if (exponent == 0) {
        v = ldexpf((float) mantissa, -24);
    } else if (exponent == 31) {
        v = mantissa ? NAN : INFINITY;
    } else {
        v = ldexpf((float) (mantissa | 1024), exponent - 25);
    }
    return (h & 0x8000) ? -v : v;
}

static float bf16_to_float(uint16_t b)
{
    const uint32_t bits = (uint32_t) b << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

void ckpt_linear_row(const CkptLinear *w, int r, float *out)
{
    ASSERT(r >= 0 && r < w->rows);
    const size_t cols = (size_t) w->cols, row = (size_t) r;
    switch (w->format) {
    case CKPT_LINEAR_F32:
        memcpy(out, (const float *) w->data + row * cols, cols * sizeof(float));
        break;
    case CKPT_LINEAR_F16:
    case CKPT_LINEAR_BF16: {
        const uint8_t *p = (const uint8_t *) w->data + row * cols * 2;  // [cols] 16-bit
        for (size_t c = 0; c < cols; c++) {
            uint16_t h;
            memcpy(&h, p + 2 * c, 2);
            out[c] = w->format == CKPT_LINEAR_BF16 ? bf16_to_float(h) : f16_to_float(h);
        }
        break;
    }
    case CKPT_LINEAR_FP8: {
        const uint8_t *p = (const uint8_t *) w->data + row * cols;  // e4m3 [cols]
        const size_t n_col_blocks = (cols + 127) / 128;
        for (size_t c = 0; c < cols; c++) {
            float s = w->global_scale;
            if (w->scale_f32) {
                memcpy(&s,
                       (const uint8_t *) w->scale_f32
                           + ((row / 128) * n_col_blocks + c / 128) * sizeof(float),
                       sizeof(float));
            }
            out[c] = nvfp4_e4m3_to_float(p[c]) * s;
        }
        break;
    }
    case CKPT_LINEAR_NVFP4: {
        const uint8_t *q = (const uint8_t *) w->data + row * cols / 2;  // [cols / 2]
        const uint8_t *s = w->scale + row * (cols / NVFP4_GROUP);       // e4m3 [cols / 16]
        for (size_t c = 0; c < cols; c++) {
            const uint8_t byte = q[c / 2];
            const uint8_t code = (c & 1) ? byte >> 4 : byte & 15;
            out[c] = nvfp4_e2m1_to_float(code) * nvfp4_e4m3_to_float(s[c / NVFP4_GROUP])
                     * w->global_scale;
        }
        break;
    }
    }
}
