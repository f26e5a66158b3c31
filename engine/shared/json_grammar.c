/*
 * json_grammar.c - JSON / JSON-Schema subset automaton (json_grammar.h).
 *
 * Compiling: every schema object becomes a node (an index into g->nodes): the JSON types it
 * allows, or a list of literal texts (enum, const: their compact serialisation), or a union
 * of other nodes (anyOf, flattened). Node 0 is "any value". $ref is inlined (a reference
 * to itself, directly or not, is refused). Each node also gets the shortest text that is
 * a valid value of it (node->min), which jgram_completion() stitches together.
 *
 * Matching: a thread is a stack of frames, one per value being read (ROOT at the bottom,
 * then objects, arrays, and on top a key, string, number or literal). A byte goes to the
 * top frame; numbers and literals end when a byte does not continue them (greedy: no
 * JSON value is a proper prefix of another except by digits, letters, '.', '+', '-', which
 * never follow a value), and the byte then goes to the frame below. Where a value of a
 * union starts, the thread splits into one per alternative; threads that reject a byte
 * die, equal ones merge.
 *
 * Frame fields, per kind (a, b, c, set):
 *   ROOT  st 0 waiting for the value (a: whitespace bytes seen), 1 done
 *   OBJ   st OB_*; set: declared properties seen; a: keys read; b: a space may come;
 *         c: the node of the value after the key being read
 *   KEY   set: declared names still matching; a: bytes read while some match; st, b:
 *         string escape state and UTF-8 bytes pending
 *   STR   a: code points (saturating at minLength without maxLength); st, b as KEY
 *   NUM   st N_*; a: digits in the current part; c: 1 for integers
 *   LIT   set: literals still matching; a: bytes read; b: 1 for true/false/null
 *   ARR   st AR_*; a: items begun; b: a space may come
 */
#include "engine/shared/json_grammar.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/shared/buf.h"
#include "engine/shared/utf8.h"

enum { T_NULL = 1, T_BOOL = 2, T_INT = 4, T_NUM = 8, T_STR = 16, T_ARR = 32, T_OBJ = 64, T_ALL = 127 };
enum { K_ROOT = 1, K_OBJ, K_KEY, K_STR, K_NUM, K_LIT, K_ARR, K_CALL, K_XNAME, K_XKEY, K_XLIT, K_RAW };
// Tool calls (GLM's "NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>"): the
// phases of the K_CALL frame and the markup literals.
enum { CL_NAME, CL_ARGS, CL_INLIT, CL_KEY, CL_KEYEND, CL_VALUE, CL_INVAL, CL_VALEND, CL_DONE };
enum { XL_ARGKEY, XL_END, XL_KEYEND, XL_VALEND, XL_N };
static const char *const XLITS[XL_N] = {"<arg_key>", "</tool_call>", "</arg_key><arg_value>",
                                        "</arg_value>"};
enum { OB_FIRST, OB_INKEY, OB_COLON, OB_VALUE, OB_INVAL, OB_NEXT, OB_KEY };
enum { AR_FIRST, AR_INVAL, AR_NEXT, AR_VALUE };
enum { N_SIGN, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };
enum {
    MAX_ALTS = 8,
    MAX_PROPS = 64,
    MAX_LITS = 64,
    MAX_NODES = 4096,
    MAX_TEXT = 1 << 16,
    MAX_MIN_TOTAL = 1 << 22,  // the shortest texts of all nodes together
    MAX_SCHEMA_DEPTH = 32,
    MAX_REFS = 32,
};
#define NONE UINT32_MAX  // no maxLength / maxItems

typedef struct Node {
    uint8_t types;  // T_* (with no literals and no alternatives)
    int n_lits, lit0;          // literals g->lits[lit0 ..]
    int n_alts;                // union of alts[] (leaf nodes)
    uint16_t alts[MAX_ALTS];
    uint32_t min_len, max_len;      // strings, code points (max NONE: unbounded)
    uint32_t min_items, max_items;  // arrays (max NONE: unbounded)
    int items;                      // node of the items
    int n_props, prop0;             // properties g->props[prop0 ..]
    uint64_t required;              // bit i: property prop0 + i
    int addl;                       // node of additional properties' values, -1: none
    char *min;                      // shortest valid text (owned)
    int n_min;
    int min_depth;  // automaton frames writing `min` takes, its own included
    int threads;    // ways (JgramThreads) a value of this node can be read at once, at most
} Node;

typedef struct Text {  // bytes in g->text
    int off, len;
} Text;

typedef struct Prop {
    Text name;  // JSON-escaped, without quotes
    Text raw;   // as written (a tool call's <arg_key>)
    int node;
    // Tool calls: the value is raw text when the schema's "type" names "string" (as the
    // chat parser reads it, engine/shared/chat.c); its enum/const strings as raw texts.
    bool is_raw;
    int raw_lit0, n_raw_lits;  // g->lits
} Prop;

typedef struct Call {  // one tool of a tool-call grammar
    Text name;
    int params;  // an object node
} Call;

struct JgramGrammar {
    Node *nodes;
    int n_nodes, cap_nodes;
    Text *lits;
    int n_lits, cap_lits;
    Prop *props;
    int n_props, cap_props;
    Buf text;  // names and literals (Text offsets into it)
    int root;
    Call *calls;  // tool-call grammars: the tools a call may name
    int n_calls, cap_calls;
    bool is_tools, is_named;
};

static const char *const BUILTIN[3] = {"true", "false", "null"};

// ---------------------------------------------------------------------------
// Compiling

typedef struct RefNode {  // a $ref compiled once, its node shared by every use
    const char *ref;
    int node;
} RefNode;

typedef struct Compiler {
    JgramGrammar *g;
    json_object *root_schema;
    const char *refs[MAX_REFS];  // $refs being compiled (cycle check)
    int n_refs;
    RefNode *done;  // $refs compiled against root_schema (reset when it changes)
    int n_done, cap_done;
    size_t min_total;  // bytes of every node's shortest text
    bool tool_params;  // the next object compiled is a tool's parameters (set_raw)
    char *msg;
    size_t cap;
    Err err;
} Compiler;

static int fail(Compiler *c, Err err, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

// Record the first error (message "<detail> at <JSON pointer>"); returns -1.
static int fail(Compiler *c, Err err, const char *path, const char *fmt, ...)
{
    if (c->err == ERR_OK) {
        c->err = err;
        char detail[160];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(detail, sizeof detail, fmt, ap);
        va_end(ap);
        snprintf(c->msg, c->cap, "%s at %s", detail, *path ? path : "/");
    }
    return -1;
}

static bool grow(void **p, int *cap, int need, size_t size)
{
    if (need <= *cap) return true;
    int n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *q = realloc(*p, (size_t) n * size);
    if (!q) return false;
    *p = q;
    *cap = n;
    return true;
}

static bool add_text(JgramGrammar *g, const char *s, int n, Text *out)
{
    if (g->text.n + (size_t) n > MAX_TEXT) return false;
    out->off = (int) g->text.n;
    out->len = n;
    return buf_add(&g->text, s, (size_t) n) == ERR_OK;
}

static int new_node(Compiler *c, const char *path)
{
    JgramGrammar *g = c->g;
    if (g->n_nodes == MAX_NODES) return fail(c, ERR_INVAL, path, "schema has too many nodes");
    if (!grow((void **) &g->nodes, &g->cap_nodes, g->n_nodes + 1, sizeof(Node)))
        return fail(c, ERR_NOMEM, path, "out of memory");
    Node *n = &g->nodes[g->n_nodes];
    memset(n, 0, sizeof *n);
    n->max_len = n->max_items = NONE;
    n->addl = -1;
    return g->n_nodes++;
}

// Candidate s, which takes `depth` frames to write, becomes best when it is the shortest so
// far (and within MAX_TEXT bytes); s is emptied for the next one (the two swap memory).
static void keep_shorter(Buf *s, int depth, Buf *best, int *best_depth, bool *has_best)
{
    if (!s->is_oom && s->n <= MAX_TEXT && (!*has_best || s->n < best->n)) {
        const Buf t = *best;
        *best = *s;
        *s = t;
        *best_depth = depth;
        *has_best = true;
    }
    buf_clear(s);
}

// Frames the automaton needs below a container of node n that it has opened, for the
// shortest way to close it: an array's min_items items (their shortest texts), an object's
// required properties (a key frame, then each value). These plus the depth after the
// container's frame is pushed must stay within JGRAM_MAX_DEPTH (begin_value).
static int arr_frames_below(const JgramGrammar *g, const Node *n)
{
    return n->min_items > 0 ? g->nodes[n->items].min_depth : 0;
}

static int obj_frames_below(const JgramGrammar *g, const Node *n)
{
    int below = 0;
    for (int i = 0; i < n->n_props; i++) {
        if (!(n->required >> i & 1)) continue;
        const int d = g->nodes[g->props[n->prop0 + i].node].min_depth;  // >= 1: the key's too
        below = below > d ? below : d;
    }
    return below;
}

// Fill node->min: the shortest valid text of a value of node k (each kind of value it
// allows is written in turn, the shortest kept; the loops stop past MAX_TEXT bytes).
static int set_min(Compiler *c, int k, const char *path)
{
    JgramGrammar *g = c->g;
    const Node *n = &g->nodes[k];
    const char *text = g->text.p;  // nothing is added to g->text here
    Buf s = {0}, best = {0};
    bool has_best = false;
    int depth = 1;
    if (n->n_lits > 0) {
        for (int i = 0; i < n->n_lits; i++) {
            const Text *t = &g->lits[n->lit0 + i];
            buf_add(&s, text + t->off, (size_t) t->len);
            keep_shorter(&s, 1, &best, &depth, &has_best);
        }
    } else if (n->n_alts > 0) {
        for (int i = 0; i < n->n_alts; i++) {
            const Node *a = &g->nodes[n->alts[i]];
            buf_add(&s, a->min, (size_t) a->n_min);
            keep_shorter(&s, a->min_depth, &best, &depth, &has_best);
        }
    } else {
        static const struct {
            int types;
            const char *min;
        } scalars[] = {{T_NULL, "null"}, {T_BOOL, "true"}, {T_INT | T_NUM, "0"}};
        for (int i = 0; i < 3; i++)
            if (n->types & scalars[i].types) {
                buf_adds(&s, scalars[i].min);
                keep_shorter(&s, 1, &best, &depth, &has_best);
            }
        if (n->types & T_STR) {
            static const char letters[64] = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
            buf_adds(&s, "\"");
            for (uint32_t i = 0; i < n->min_len && s.n <= MAX_TEXT; i += 64)
                buf_add(&s, letters, n->min_len - i < 64 ? n->min_len - i : 64);
            buf_adds(&s, "\"");
            keep_shorter(&s, 1, &best, &depth, &has_best);
        }
        if (n->types & T_ARR) {
            const Node *it = &g->nodes[n->items];
            buf_adds(&s, "[");
            for (uint32_t i = 0; i < n->min_items && s.n <= MAX_TEXT; i++) {
                if (i) buf_adds(&s, ",");
                buf_add(&s, it->min, (size_t) it->n_min);
            }
            buf_adds(&s, "]");
            keep_shorter(&s, 1 + arr_frames_below(g, n), &best, &depth, &has_best);
        }
        if (n->types & T_OBJ) {
            buf_adds(&s, "{");
            bool first = true;
            for (int i = 0; i < n->n_props; i++) {
                if (!(n->required >> i & 1)) continue;
                const Prop *p = &g->props[n->prop0 + i];
                const Node *v = &g->nodes[p->node];
                if (!first) buf_adds(&s, ",");
                first = false;
                buf_adds(&s, "\"");
                buf_add(&s, text + p->name.off, (size_t) p->name.len);
                buf_adds(&s, "\":");
                buf_add(&s, v->min, (size_t) v->n_min);
            }
            buf_adds(&s, "}");
            keep_shorter(&s, 1 + obj_frames_below(g, n), &best, &depth, &has_best);
        }
    }
    buf_free(&s);
    size_t n_best = 0;
    char *min = has_best ? buf_take(&best, &n_best) : NULL;
    buf_free(&best);
    if (!min) return fail(c, ERR_INVAL, path, "no value satisfies the schema (or its smallest one exceeds 64 KiB)");
    g->nodes[k].min = min;
    g->nodes[k].n_min = (int) n_best;
    g->nodes[k].min_depth = depth;
    // Threads: one per alternative (flattened) while a value is read, each of which may split
    // again inside (an array's current item, an object's current value). A state keeps
    // JGRAM_MAX_THREADS: a schema that could need more would lose ways to read valid output.
    int threads = 0;
    if (n->n_lits > 0) {
        threads = 1;
    } else if (n->n_alts > 0) {
        for (int i = 0; i < n->n_alts; i++) threads += g->nodes[n->alts[i]].threads;
    } else {
        threads = 1;
        if (n->types & T_ARR && g->nodes[n->items].threads > threads)
            threads = g->nodes[n->items].threads;
        for (int i = 0; n->types & T_OBJ && i < n->n_props; i++)
            if (g->nodes[g->props[n->prop0 + i].node].threads > threads)
                threads = g->nodes[g->props[n->prop0 + i].node].threads;
        if (n->types & T_OBJ && n->addl >= 0 && g->nodes[n->addl].threads > threads)
            threads = g->nodes[n->addl].threads;
    }
    g->nodes[k].threads = threads;
    if (threads > JGRAM_MAX_THREADS)
        return fail(c, ERR_INVAL, path,
                    "'anyOf' alternatives nest into more than %d ways to read one value",
                    JGRAM_MAX_THREADS);
    c->min_total += n_best;
    if (c->min_total > MAX_MIN_TOTAL)
        return fail(c, ERR_INVAL, path, "the schema's shortest values exceed 4 MiB together");
    // A value must be writable within the automaton's frames: the root's frame, this one,
    // and what its shortest text nests.
    if (depth > JGRAM_MAX_DEPTH - 1)
        return fail(c, ERR_INVAL, path, "the schema's values nest deeper than %d levels",
                    JGRAM_MAX_DEPTH - 2);
    return k;
}

// Names and literals the automaton must be able to write: valid UTF-8 (fcgi's parser
// ensures it for requests; a schema from elsewhere may not).
static bool is_utf8(const char *s)
{
    const size_t n = strlen(s);
    return utf8_valid_prefix((const uint8_t *) s, n) == n;
}

// Tool calls: whether property k's value is written raw (its schema's "type" is "string"
// or a list naming it: chat.c's param_is_string) and, when raw, its string enum/const values
// as raw texts (none may hold '<', which ends the value).
static int set_raw(Compiler *c, int k, json_object *ps, const char *path)
{
    JgramGrammar *g = c->g;
    json_object *type = NULL;
    bool raw = false;
    if (json_object_is_type(ps, json_type_object) && json_object_object_get_ex(ps, "type", &type)) {
        if (json_object_is_type(type, json_type_string)) {
            raw = !strcmp(json_object_get_string(type), "string");
        } else if (json_object_is_type(type, json_type_array)) {
            for (size_t j = 0; j < json_object_array_length(type); j++) {
                json_object *tj = json_object_array_get_idx(type, j);
                raw |= json_object_is_type(tj, json_type_string) && !strcmp(json_object_get_string(tj), "string");
            }
        }
    }
    g->props[k].is_raw = raw;
    const Node *n = &g->nodes[g->props[k].node];
    if (!raw || n->n_lits == 0) return 0;
    const int lit0 = n->lit0, n_lits = n->n_lits;
    g->props[k].raw_lit0 = g->n_lits;
    for (int i = 0; i < n_lits; i++) {
        char lit[512];
        const Text *t = &g->lits[lit0 + i];
        if (t->len >= (int) sizeof lit) continue;
        memcpy(lit, g->text.p + t->off, (size_t) t->len);
        lit[t->len] = 0;
        json_object *v = json_tokener_parse(lit);
        if (json_object_is_type(v, json_type_string)) {
            const char *r = json_object_get_string(v);
            Text out;
            if (strchr(r, '<')) {
                json_object_put(v);
                return fail(c, ERR_INVAL, path, "a string value of a tool parameter's 'enum' holds '<'");
            }
            if (!grow((void **) &g->lits, &g->cap_lits, g->n_lits + 1, sizeof(Text)) ||
                !add_text(g, r, (int) strlen(r), &out)) {
                json_object_put(v);
                return fail(c, ERR_INVAL, path, "the schema's literals exceed 64 KiB");
            }
            g->lits[g->n_lits++] = out;
            g->props[k].n_raw_lits++;
        }
        json_object_put(v);
    }
    if (g->props[k].n_raw_lits == 0)
        return fail(c, ERR_INVAL, path, "a string tool parameter's 'enum' or 'const' has no string");
    return 0;
}

static bool is_annotation(const char *key)
{
    static const char *const ann[] = {"title",      "description", "default",  "examples",
                                      "$schema",    "$id",         "$comment", "deprecated",
                                      "readOnly",   "writeOnly",   "strict",   "$defs",
                                      "definitions", NULL};
    for (int i = 0; ann[i]; i++)
        if (!strcmp(key, ann[i])) return true;
    return false;
}

static int compile_node(Compiler *c, json_object *s, const char *path, int depth);

static bool get_count(Compiler *c, json_object *s, const char *key, uint32_t *out, const char *path)
{
    json_object *v;
    if (!json_object_object_get_ex(s, key, &v)) return true;
    if (!json_object_is_type(v, json_type_int) || json_object_get_int64(v) < 0 ||
        json_object_get_int64(v) > 65535) {
        fail(c, ERR_INVAL, path, "'%s' must be an integer from 0 to 65535", key);
        return false;
    }
    *out = (uint32_t) json_object_get_int64(v);
    return true;
}

static int type_bit(const char *t)
{
    static const char *const names[] = {"null", "boolean", "integer", "number", "string", "array", "object"};
    for (int i = 0; i < 7; i++)
        if (!strcmp(t, names[i])) return 1 << i;
    return 0;
}

static int compile_ref(Compiler *c, const char *ref, const char *path, int depth)
{
    const char *name = NULL;
    const char *box = NULL;
    if (!strncmp(ref, "#/$defs/", 8)) name = ref + 8, box = "$defs";
    else if (!strncmp(ref, "#/definitions/", 14)) name = ref + 14, box = "definitions";
    json_object *defs, *target;
    if (!name || !json_object_object_get_ex(c->root_schema, box, &defs) ||
        !json_object_is_type(defs, json_type_object) ||
        !json_object_object_get_ex(defs, name, &target))
        return fail(c, ERR_INVAL, path, "'$ref' \"%.80s\" does not name an entry of $defs", ref);
    for (int i = 0; i < c->n_refs; i++)
        if (!strcmp(c->refs[i], ref))
            return fail(c, ERR_INVAL, path, "recursive '$ref' \"%.80s\" is not supported", ref);
    // A target compiles once (its node is read-only and means the same at every use): a
    // schema whose $defs refer to one another many times would otherwise compile
    // exponentially many copies.
    for (int i = 0; i < c->n_done; i++)
        if (!strcmp(c->done[i].ref, ref)) return c->done[i].node;
    if (c->n_refs == MAX_REFS) return fail(c, ERR_INVAL, path, "'$ref' nested too deep");
    c->refs[c->n_refs++] = ref;
    const int k = compile_node(c, target, path, depth + 1);
    c->n_refs--;
    if (k < 0) return k;
    if (!grow((void **) &c->done, &c->cap_done, c->n_done + 1, sizeof *c->done))
        return fail(c, ERR_NOMEM, path, "out of memory");
    c->done[c->n_done++] = (RefNode){ref, k};
    return k;
}

static int compile_node(Compiler *c, json_object *s, const char *path, int depth)
{
    JgramGrammar *g = c->g;
    if (depth > MAX_SCHEMA_DEPTH) return fail(c, ERR_INVAL, path, "schema nested too deep");
    if (json_object_is_type(s, json_type_boolean)) {
        if (json_object_get_boolean(s)) return 0;
        return fail(c, ERR_INVAL, path, "the schema false accepts nothing");
    }
    if (!json_object_is_type(s, json_type_object))
        return fail(c, ERR_INVAL, path, "a schema must be an object");
    // Every keyword must be one we honour (or an annotation).
    static const char *const known[] = {"type",  "enum",      "const",     "properties",
                                        "required", "additionalProperties", "items", "minItems",
                                        "maxItems", "minLength", "maxLength", "anyOf", "$ref", NULL};
    json_object_object_foreach(s, key, val) {
        (void) val;
        bool ok = is_annotation(key);
        for (int i = 0; known[i] && !ok; i++) ok = !strcmp(key, known[i]);
        if (!ok) return fail(c, ERR_INVAL, path, "unsupported keyword '%.64s'", key);
    }
    json_object *v;
    char sub[256];
    if (json_object_object_get_ex(s, "$ref", &v)) {
        if (!json_object_is_type(v, json_type_string))
            return fail(c, ERR_INVAL, path, "'$ref' must be a string");
        json_object_object_foreach(s, k2, v2) {
            (void) v2;
            if (strcmp(k2, "$ref") && !is_annotation(k2))
                return fail(c, ERR_INVAL, path, "'%.64s' alongside '$ref' is not supported", k2);
        }
        return compile_ref(c, json_object_get_string(v), path, depth);
    }
    // Only a tool's parameters (not the objects inside their values) have raw arguments.
    const bool raw_props = c->tool_params;
    c->tool_params = false;
    if (json_object_object_get_ex(s, "anyOf", &v)) {
        json_object_object_foreach(s, k2, v2) {
            (void) v2;
            if (strcmp(k2, "anyOf") && !is_annotation(k2))
                return fail(c, ERR_INVAL, path, "'%.64s' alongside 'anyOf' is not supported", k2);
        }
        if (!json_object_is_type(v, json_type_array) || json_object_array_length(v) == 0)
            return fail(c, ERR_INVAL, path, "'anyOf' must be a non-empty array");
        uint16_t alts[MAX_ALTS];
        int n_alts = 0;
        for (size_t i = 0; i < json_object_array_length(v); i++) {
            snprintf(sub, sizeof sub, "%s/anyOf/%zu", path, i);
            const int a = compile_node(c, json_object_array_get_idx(v, i), sub, depth + 1);
            if (a < 0) return -1;
            const Node *an = &g->nodes[a];
            const int n_add = an->n_alts ? an->n_alts : 1;
            if (n_alts + n_add > MAX_ALTS)
                return fail(c, ERR_INVAL, path, "'anyOf' with more than 8 alternatives");
            if (an->n_alts) memcpy(alts + n_alts, an->alts, (size_t) an->n_alts * sizeof *alts);
            else alts[n_alts] = (uint16_t) a;
            n_alts += n_add;
        }
        const int k = new_node(c, path);
        if (k < 0) return -1;
        memcpy(g->nodes[k].alts, alts, sizeof alts);
        g->nodes[k].n_alts = n_alts;
        return set_min(c, k, path);
    }
    const int k = new_node(c, path);
    if (k < 0) return -1;
    // enum / const: the literal texts.
    json_object *e = NULL, *cst = NULL;
    json_object_object_get_ex(s, "enum", &e);
    json_object_object_get_ex(s, "const", &cst);
    if (e || cst) {
        if (e && cst) return fail(c, ERR_INVAL, path, "'enum' alongside 'const' is not supported");
        if (e && (!json_object_is_type(e, json_type_array) || json_object_array_length(e) == 0))
            return fail(c, ERR_INVAL, path, "'enum' must be a non-empty array");
        const int n = e ? (int) json_object_array_length(e) : 1;
        if (n > MAX_LITS) return fail(c, ERR_INVAL, path, "'enum' with more than 64 values");
        g->nodes[k].lit0 = g->n_lits;
        for (int i = 0; i < n; i++) {
            json_object *x = e ? json_object_array_get_idx(e, (size_t) i) : cst;
            const char *t = x ? json_object_to_json_string_ext(
                                    x, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE)
                              : "null";
            if (!is_utf8(t)) return fail(c, ERR_INVAL, path, "an 'enum' or 'const' value is not valid UTF-8");
            if (!grow((void **) &g->lits, &g->cap_lits, g->n_lits + 1, sizeof(Text)) ||
                !add_text(g, t, (int) strlen(t), &g->lits[g->n_lits]))
                return fail(c, ERR_INVAL, path, "the schema's literals exceed 64 KiB");
            g->n_lits++;
        }
        g->nodes[k].n_lits = n;
        return set_min(c, k, path);
    }
    // type
    int types = 0;
    if (json_object_object_get_ex(s, "type", &v)) {
        if (json_object_is_type(v, json_type_string)) {
            types = type_bit(json_object_get_string(v));
        } else if (json_object_is_type(v, json_type_array) && json_object_array_length(v) > 0) {
            for (size_t i = 0; i < json_object_array_length(v); i++) {
                json_object *t = json_object_array_get_idx(v, i);
                const int b = json_object_is_type(t, json_type_string) ? type_bit(json_object_get_string(t)) : 0;
                if (!b) {
                    types = 0;
                    break;
                }
                types |= b;
            }
        }
        if (!types)
            return fail(c, ERR_INVAL, path, "%s",
                        "'type' must be null, boolean, integer, number, string, array, object or an array of them");
    } else if (json_object_object_get_ex(s, "properties", &v) ||
               json_object_object_get_ex(s, "required", &v) ||
               json_object_object_get_ex(s, "additionalProperties", &v)) {
        types = T_OBJ;
    } else if (json_object_object_get_ex(s, "items", &v) ||
               json_object_object_get_ex(s, "minItems", &v) ||
               json_object_object_get_ex(s, "maxItems", &v)) {
        types = T_ARR;
    } else if (json_object_object_get_ex(s, "minLength", &v) ||
               json_object_object_get_ex(s, "maxLength", &v)) {
        types = T_STR;
    } else {
        types = T_ALL;
    }
    g->nodes[k].types = (uint8_t) types;
    // strings
    uint32_t lo = 0, hi = NONE;
    if (!get_count(c, s, "minLength", &lo, path) || !get_count(c, s, "maxLength", &hi, path)) return -1;
    if (hi != NONE && hi < lo) return fail(c, ERR_INVAL, path, "'maxLength' is below 'minLength'");
    g->nodes[k].min_len = lo;
    g->nodes[k].max_len = hi;
    // arrays
    lo = 0, hi = NONE;
    if (!get_count(c, s, "minItems", &lo, path) || !get_count(c, s, "maxItems", &hi, path)) return -1;
    if (hi != NONE && hi < lo) return fail(c, ERR_INVAL, path, "'maxItems' is below 'minItems'");
    g->nodes[k].min_items = lo;
    g->nodes[k].max_items = hi;
    int items = 0;
    if (json_object_object_get_ex(s, "items", &v)) {
        snprintf(sub, sizeof sub, "%s/items", path);
        if ((items = compile_node(c, v, sub, depth + 1)) < 0) return -1;
    }
    g->nodes[k].items = items;
    // objects
    json_object *props = NULL, *req = NULL, *addl = NULL;
    json_object_object_get_ex(s, "properties", &props);
    json_object_object_get_ex(s, "required", &req);
    json_object_object_get_ex(s, "additionalProperties", &addl);
    if (props && !json_object_is_type(props, json_type_object))
        return fail(c, ERR_INVAL, path, "'properties' must be an object");
    const int n_props = props ? json_object_object_length(props) : 0;
    if (n_props > MAX_PROPS) return fail(c, ERR_INVAL, path, "more than 64 'properties'");
    // Reserve the property slots first: compiling a property's schema adds others.
    const int prop0 = g->n_props;
    if (!grow((void **) &g->props, &g->cap_props, g->n_props + n_props, sizeof(Prop)))
        return fail(c, ERR_NOMEM, path, "out of memory");
    if (n_props) memset(&g->props[prop0], 0, (size_t) n_props * sizeof(Prop));
    g->n_props += n_props;
    g->nodes[k].prop0 = prop0;
    g->nodes[k].n_props = n_props;
    int i = 0;
    if (props) {
        json_object_object_foreach(props, name, ps) {
            if (!is_utf8(name)) return fail(c, ERR_INVAL, path, "a property name is not valid UTF-8");
            json_object *js = json_object_new_string(name);
            const char *esc = js ? json_object_to_json_string_ext(
                                       js, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE)
                                 : NULL;
            Text t = {0};
            const bool ok = esc && add_text(g, esc + 1, (int) strlen(esc) - 2, &t);
            json_object_put(js);
            if (!ok) return fail(c, ERR_INVAL, path, "the schema's names exceed 64 KiB");
            snprintf(sub, sizeof sub, "%s/properties/%.64s", path, name);
            const int pn = compile_node(c, ps, sub, depth + 1);
            if (pn < 0) return -1;
            Prop *pr = &g->props[prop0 + i];
            pr->name = t;
            pr->node = pn;
            if (!add_text(g, name, (int) strlen(name), &g->props[prop0 + i].raw))
                return fail(c, ERR_INVAL, path, "the schema's names exceed 64 KiB");
            if (raw_props && set_raw(c, prop0 + i, ps, sub) < 0) return -1;
            i++;
        }
    }
    if (req) {
        if (!json_object_is_type(req, json_type_array))
            return fail(c, ERR_INVAL, path, "'required' must be an array of property names");
        for (size_t r = 0; r < json_object_array_length(req); r++) {
            json_object *x = json_object_array_get_idx(req, r);
            int found = -1;
            if (json_object_is_type(x, json_type_string) && props) {
                int j = 0;
                json_object_object_foreach(props, name, ps) {
                    (void) ps;
                    if (!strcmp(name, json_object_get_string(x))) found = j;
                    j++;
                }
            }
            if (found < 0)
                return fail(c, ERR_INVAL, path, "'required' names \"%.64s\", which is not in 'properties'",
                            json_object_is_type(x, json_type_string) ? json_object_get_string(x) : "?");
            g->nodes[k].required |= 1ull << found;
        }
    }
    if (addl) {
        if (json_object_is_type(addl, json_type_boolean)) {
            g->nodes[k].addl = json_object_get_boolean(addl) ? 0 : -1;
        } else {
            snprintf(sub, sizeof sub, "%s/additionalProperties", path);
            const int a = compile_node(c, addl, sub, depth + 1);
            if (a < 0) return -1;
            g->nodes[k].addl = a;
        }
    } else {
        g->nodes[k].addl = n_props > 0 ? -1 : 0;
    }
    return set_min(c, k, path);
}

// A new grammar whose node 0 is "any value" (any properties, any items), compiled by *c;
// NULL when out of memory (the compiler then has the error).
static JgramGrammar *grammar_new(Compiler *c, json_object *root_schema, char *msg, size_t cap)
{
    if (cap) msg[0] = 0;
    JgramGrammar *g = calloc(1, sizeof *g);
    *c = (Compiler){.g = g, .root_schema = root_schema, .msg = msg, .cap = cap,
                    .err = g ? ERR_OK : ERR_NOMEM};
    if (!g) return NULL;
    if (new_node(c, "") == 0) {
        g->nodes[0].types = T_ALL;
        g->nodes[0].addl = 0;
        g->nodes[0].items = 0;
        if (set_min(c, 0, "") == 0) return g;
    }
    jgram_free(g);
    return NULL;
}

Err jgram_compile(json_object *schema, JgramGrammar **out, char *msg, size_t cap)
{
    *out = NULL;
    Compiler c;
    JgramGrammar *g = grammar_new(&c, schema, msg, cap);
    if (!g) return c.err ? c.err : ERR_NOMEM;
    int k = 0;
    if (!schema) {  // {"type": "json_object"}: an object of any values
        if ((k = new_node(&c, "")) > 0) {
            g->nodes[k].types = T_OBJ;
            g->nodes[k].addl = 0;
            k = set_min(&c, k, "");
        }
    } else {
        k = compile_node(&c, schema, "", 0);
    }
    free(c.done);
    if (k < 0) {
        jgram_free(g);
        return c.err ? c.err : ERR_INVAL;
    }
    g->root = k;
    *out = g;
    return ERR_OK;
}

Err jgram_compile_tools(json_object *tools, const char *name, JgramGrammar **out, char *msg,
                        size_t cap)
{
    *out = NULL;
    Compiler c;
    JgramGrammar *g = grammar_new(&c, NULL, msg, cap);
    if (!g) return c.err ? c.err : ERR_NOMEM;
    int k = 0;
    const size_t n = json_object_is_type(tools, json_type_array) ? json_object_array_length(tools) : 0;
    for (size_t i = 0; i < n && k >= 0; i++) {
        json_object *fn = NULL, *fname = NULL, *params = NULL;
        if (!json_object_object_get_ex(json_object_array_get_idx(tools, i), "function", &fn) ||
            !json_object_object_get_ex(fn, "name", &fname) || !json_object_is_type(fname, json_type_string))
            continue;
        const char *nm = json_object_get_string(fname);
        if (name && strcmp(nm, name)) continue;
        char path[96];
        snprintf(path, sizeof path, "/tools/%zu/function/parameters", i);
        if (g->n_calls == 64) {
            k = fail(&c, ERR_INVAL, path, "more than 64 tools");
            break;
        }
        if (!*nm || strchr(nm, '<') || !is_utf8(nm)) {
            k = fail(&c, ERR_INVAL, path, "a tool name must be non-empty UTF-8 without '<'");
            break;
        }
        for (int j = 0; j < g->n_calls && k >= 0; j++)
            if (g->calls[j].name.len == (int) strlen(nm) && !memcmp(g->text.p + g->calls[j].name.off, nm, strlen(nm)))
                k = fail(&c, ERR_INVAL, path, "two tools are named \"%.64s\"", nm);
        if (k < 0) break;
        json_object_object_get_ex(fn, "parameters", &params);
        if (params && !json_object_is_type(params, json_type_null)) {
            c.root_schema = params;  // its own $defs: no $ref compiled so far applies
            c.n_done = 0;
            c.tool_params = true;
            k = compile_node(&c, params, path, 0);
            c.tool_params = false;  // (a schema that is not an object leaves it unread)
        } else if ((k = new_node(&c, path)) >= 0) {
            g->nodes[k].types = T_OBJ;
            k = set_min(&c, k, path);
        }
        if (k < 0) break;
        const Node *pn = &g->nodes[k];
        if (pn->n_lits || pn->n_alts || !(pn->types & T_OBJ)) {
            k = fail(&c, ERR_INVAL, path, "tool parameters must be an object schema");
            break;
        }
        for (int j = 0; j < pn->n_props && k >= 0; j++) {
            const Text *r = &g->props[pn->prop0 + j].raw;
            if (r->len == 0 || memchr(g->text.p + r->off, '<', (size_t) r->len))
                k = fail(&c, ERR_INVAL, path, "a tool parameter's name must be non-empty without '<'");
        }
        if (k < 0) break;
        Text t;
        if (!grow((void **) &g->calls, &g->cap_calls, g->n_calls + 1, sizeof(Call)) ||
            !add_text(g, nm, (int) strlen(nm), &t)) {
            k = fail(&c, ERR_NOMEM, path, "out of memory");
            break;
        }
        g->calls[g->n_calls++] = (Call){t, k};
    }
    if (k >= 0 && g->n_calls == 0) k = fail(&c, ERR_INVAL, "/tools", "no tool to call");
    free(c.done);
    if (k < 0) {
        jgram_free(g);
        return c.err ? c.err : ERR_INVAL;
    }
    g->is_tools = true;
    g->is_named = name != NULL;
    *out = g;
    return ERR_OK;
}

bool jgram_wants_markup(const JgramGrammar *g) { return g->is_tools; }

void jgram_free(JgramGrammar *g)
{
    if (!g) return;
    free(g->calls);
    for (int i = 0; i < g->n_nodes; i++) free(g->nodes[i].min);
    free(g->nodes);
    free(g->lits);
    free(g->props);
    buf_free(&g->text);
    free(g);
}

// ---------------------------------------------------------------------------
// Matching

static JgramFrame *top(JgramThread *t) { return &t->f[t->depth - 1]; }

static bool push(JgramThread *t, int kind, int node)
{
    if (t->depth == JGRAM_MAX_DEPTH) return false;
    JgramFrame *f = &t->f[t->depth++];
    memset(f, 0, sizeof *f);
    f->kind = (uint8_t) kind;
    f->node = (uint16_t) node;
    return true;
}

// The top value is complete: pop it and move its container on.
static void pop_value(JgramThread *t)
{
    t->depth--;
    JgramFrame *p = top(t);
    if (p->kind == K_ROOT) p->st = 1;
    else if (p->kind == K_OBJ) p->st = OB_NEXT;
    else if (p->kind == K_ARR) p->st = AR_NEXT;
    else if (p->kind == K_CALL) p->st = CL_VALEND;
}

// UTF-8 inside strings and raw values, a byte at a time. f->b: low bits the continuation
// bytes pending, high bits the range the first of them must be in (no overlong forms, no
// surrogates, nothing past U+10FFFF).
//
// A continuation byte while f->b > 0: 0, or -1 when it is not one the character allows.
static int utf8_cont(JgramFrame *f, uint8_t c)
{
    const uint32_t r = f->b >> 4;
    const int lo = r == 1 ? 0xA0 : r == 3 ? 0x90 : 0x80, hi = r == 2 ? 0x9F : r == 4 ? 0x8F : 0xBF;
    if (c < lo || c > hi) return -1;
    f->b = (f->b & 0xF) - 1;
    return 0;
}

// The first byte of a character (c >= 0x20, past the caller's own special bytes): 1, or -1
// when no character starts with it.
static int utf8_lead(JgramFrame *f, uint8_t c)
{
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) f->b = 1;
    else if (c == 0xE0) f->b = 2 | 1 << 4;  // A0..BF next (no overlong forms)
    else if (c == 0xED) f->b = 2 | 2 << 4;  // 80..9F next (no surrogates)
    else if (c >= 0xE1 && c <= 0xEF) f->b = 2;
    else if (c == 0xF0) f->b = 3 | 3 << 4;  // 90..BF next
    else if (c == 0xF4) f->b = 3 | 4 << 4;  // 80..8F next (up to U+10FFFF)
    else if (c >= 0xF1 && c <= 0xF3) f->b = 3;
    else return -1;
    return 1;
}

// A byte of a string (or key): -1 invalid, 0 inside a character or escape, 1 a new
// character starts, 2 the closing quote.
static int str_byte(JgramFrame *f, uint8_t c)
{
    if (f->st == 1) {
        if (c == 'u') {
            f->st = 2;
            return 0;
        }
        if (!strchr("\"\\/bfnrt", c) || !c) return -1;
        f->st = 0;
        return 0;
    }
    if (f->st >= 2) {
        const bool hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
        if (!hex) return -1;
        f->st = f->st == 5 ? 0 : (uint8_t) (f->st + 1);
        return 0;
    }
    if (f->b > 0) return utf8_cont(f, c);
    if (c == '"') return 2;
    if (c == '\\') {
        f->st = 1;
        return 1;
    }
    if (c < 0x20) return -1;
    return utf8_lead(f, c);
}

static int lit_len(const JgramGrammar *g, const JgramFrame *f, int i)
{
    return f->b ? (int) strlen(BUILTIN[i]) : g->lits[g->nodes[f->node].lit0 + i].len;
}

static const char *lit_text(const JgramGrammar *g, const JgramFrame *f, int i)
{
    return f->b ? BUILTIN[i] : g->text.p + g->lits[g->nodes[f->node].lit0 + i].off;
}

static bool num_complete(const JgramFrame *f)
{
    return f->st == N_ZERO || f->st == N_INT || f->st == N_FRAC || f->st == N_EXP;
}

static bool lit_complete(const JgramGrammar *g, const JgramFrame *f)
{
    for (int i = 0; i < 64; i++)
        if ((f->set >> i & 1) && lit_len(g, f, i) == (int) f->a) return true;
    return false;
}

typedef struct Out {
    JgramThread *t;
    int n, cap;
} Out;

static void emit(Out *o, const JgramThread *t)
{
    if (o->n < o->cap) {
        JgramThread *d = &o->t[o->n++];
        d->depth = t->depth;
        memcpy(d->f, t->f, (size_t) t->depth * sizeof *t->f);
    }
}

static void feed_thread(const JgramGrammar *g, JgramThread *t, uint8_t c, Out *o);

// Push the value of leaf node k that byte c starts, then feed c to it.
static void begin_value(const JgramGrammar *g, JgramThread *t, int k, uint8_t c, Out *o)
{
    const Node *n = &g->nodes[k];
    if (n->n_lits > 0) {
        if (!push(t, K_LIT, k)) return;
        top(t)->set = n->n_lits == 64 ? ~0ull : (1ull << n->n_lits) - 1;
        feed_thread(g, t, c, o);
        return;
    }
    int kind = 0;
    uint64_t set = 0;
    if (c == '"' && (n->types & T_STR)) kind = K_STR;
    else if (c == '{' && (n->types & T_OBJ)) kind = K_OBJ;
    else if (c == '[' && (n->types & T_ARR)) kind = K_ARR;
    else if ((c == '-' || (c >= '0' && c <= '9')) && (n->types & (T_INT | T_NUM))) kind = K_NUM;
    else if ((c == 't' || c == 'f') && (n->types & T_BOOL)) kind = K_LIT, set = 3;
    else if (c == 'n' && (n->types & T_NULL)) kind = K_LIT, set = 4;
    // A container opens only where the shortest way to close it fits the frames left, so
    // that every live state keeps a completion.
    if ((kind == K_ARR && t->depth + 1 + arr_frames_below(g, n) > JGRAM_MAX_DEPTH) ||
        (kind == K_OBJ && t->depth + 1 + obj_frames_below(g, n) > JGRAM_MAX_DEPTH))
        return;
    if (!kind || !push(t, kind, k)) return;
    JgramFrame *f = top(t);
    switch (kind) {
    case K_STR:
        break;  // the opening quote
    case K_OBJ:
        f->st = OB_FIRST;
        break;
    case K_ARR:
        f->st = AR_FIRST;
        break;
    case K_NUM:
        f->c = !(n->types & T_NUM);
        f->st = c == '-' ? N_SIGN : c == '0' ? N_ZERO : N_INT;
        f->a = c >= '1' && c <= '9';
        break;
    case K_LIT:
        f->b = 1;
        f->set = set;
        feed_thread(g, t, c, o);
        return;
    }
    emit(o, t);
}

// A value of node k starts with byte c: one thread per alternative.
static void start_value(const JgramGrammar *g, JgramThread *t, int k, uint8_t c, Out *o)
{
    const Node *n = &g->nodes[k];
    if (n->n_alts == 0) {
        begin_value(g, t, k, c, o);
        return;
    }
    for (int i = 0; i < n->n_alts; i++) {
        JgramThread copy;
        copy.depth = t->depth;
        memcpy(copy.f, t->f, (size_t) t->depth * sizeof *t->f);
        begin_value(g, &copy, n->alts[i], c, o);
    }
}

static bool more_keys(const JgramGrammar *g, const JgramFrame *f)
{
    const Node *n = &g->nodes[f->node];
    const uint64_t all = n->n_props == 64 ? ~0ull : (1ull << n->n_props) - 1;
    return n->addl >= 0 || (f->set & all) != all;
}

// The declared names a new key may still become: all of them where additional keys are
// allowed (a key equal to a seen name is then caught as a duplicate when it closes), else
// the unseen ones.
static uint64_t key_candidates(const Node *n, uint64_t seen)
{
    const uint64_t all = n->n_props == 64 ? ~0ull : (1ull << n->n_props) - 1;
    return n->addl >= 0 ? all : all & ~seen;
}

static int pick_key(const JgramGrammar *g, const Node *n, uint64_t seen, int *value);

// Frames below an object's frame that the completion's next key takes (pick_key's): the
// key's own, then its value's shortest text.
static int key_value_frames(const JgramGrammar *g, const Node *n, uint64_t seen)
{
    int value;
    pick_key(g, n, seen, &value);
    const int d = value >= 0 ? g->nodes[value].min_depth : 1;
    return d > 1 ? d : 1;
}

// ---------------------------------------------------------------------------
// Tool calls

static const Node *call_params(const JgramGrammar *g, const JgramFrame *call)
{
    return &g->nodes[g->calls[call->node].params];
}

static uint64_t all_props(const Node *n) { return n->n_props == 64 ? ~0ull : (1ull << n->n_props) - 1; }

// A byte of a raw tool-call value (any UTF-8 but '<', which ends it; no control bytes
// but tab, CR and LF): -1 invalid, 0 inside a character, 1 a new character.
static int raw_byte(JgramFrame *f, uint8_t c)
{
    if (f->b > 0) return utf8_cont(f, c);
    if (c == '<' || (c < 0x20 && c != '\t' && c != '\n' && c != '\r')) return -1;
    return utf8_lead(f, c);
}

// Texts a frame matches byte by byte (JSON keys, tool names, argument names, raw enum
// values).
typedef const Text *(*TextAt)(const JgramGrammar *g, int base, int i);
static const Text *call_name(const JgramGrammar *g, int base, int i)
{
    (void) base;
    return &g->calls[i].name;
}
static const Text *prop_raw(const JgramGrammar *g, int base, int i) { return &g->props[base + i].raw; }
static const Text *prop_name(const JgramGrammar *g, int base, int i) { return &g->props[base + i].name; }
static const Text *lit_at(const JgramGrammar *g, int base, int i) { return &g->lits[base + i]; }

// Of the candidates in set (texts at(g, base, 0 .. n-1)) matched up to byte a: those whose
// next byte is c (returned), and in *exact one that ends at a (-1: none).
static uint64_t match_texts(const JgramGrammar *g, TextAt at, int base, int n, uint64_t set, uint32_t a,
                            uint8_t c, int *exact)
{
    uint64_t keep = 0;
    *exact = -1;
    for (int i = 0; i < n; i++) {
        const Text *t = at(g, base, i);
        if (!(set >> i & 1)) continue;
        if ((int) a < t->len && (uint8_t) g->text.p[t->off + (int) a] == c) keep |= 1ull << i;
        if ((int) a == t->len && *exact < 0) *exact = i;
    }
    return keep;
}

// A byte for the tool-call frames on top (K_CALL and what it pushes). Returns true when
// the byte is to go to the new top frame (the loop in feed_thread continues), false when
// it was taken (emitted) or refused.
static bool feed_call(const JgramGrammar *g, JgramThread *t, uint8_t c, Out *o)
{
    JgramFrame *f = top(t);
    switch (f->kind) {
    case K_CALL: {
        const Node *pn = call_params(g, f);
        uint64_t set = 0;
        switch (f->st) {
        case CL_ARGS:
            if ((f->set & all_props(pn)) != all_props(pn)) set |= 1u << XL_ARGKEY;
            if ((f->set & pn->required) == pn->required) set |= 1u << XL_END;
            break;
        case CL_KEYEND:
            set = 1u << XL_KEYEND;
            break;
        case CL_VALEND:
            set = 1u << XL_VALEND;
            break;
        case CL_VALUE: {
            const Prop *p = &g->props[pn->prop0 + (int) f->c];
            f->st = CL_INVAL;
            if (!p->is_raw) {
                start_value(g, t, p->node, c, o);
                return false;
            }
            if (!push(t, K_RAW, p->node)) return false;
            top(t)->c = f->c;
            if (p->n_raw_lits) top(t)->set = p->n_raw_lits >= 64 ? ~0ull : (1ull << p->n_raw_lits) - 1;
            return true;
        }
        default:
            return false;
        }
        if (!set) return false;
        f->st = CL_INLIT;
        if (!push(t, K_XLIT, 0)) return false;
        top(t)->set = set;
        return true;
    }
    case K_XLIT: {
        if (c == 0) return false;
        uint64_t keep = 0;
        int done = -1;
        for (int i = 0; i < XL_N; i++)
            if ((f->set >> i & 1) && XLITS[i][f->a] == (char) c) {
                keep |= 1ull << i;
                if (XLITS[i][f->a + 1] == 0) done = i;
            }
        if (!keep) return false;
        f->set = keep;
        f->a++;
        if (done >= 0) {  // the literals are no prefix of one another: it is this one
            t->depth--;
            JgramFrame *call = top(t);
            if (done == XL_ARGKEY) {
                const Node *pn = call_params(g, call);
                call->st = CL_KEY;
                if (!push(t, K_XKEY, g->calls[call->node].params)) return false;
                top(t)->set = all_props(pn) & ~call->set;
            } else {
                call->st = done == XL_END ? CL_DONE : done == XL_KEYEND ? CL_VALUE : CL_ARGS;
            }
        }
        emit(o, t);
        return false;
    }
    case K_XNAME:  // a tool's name, then '<' starts its arguments
    case K_XKEY: {  // an argument's name, then '<' starts "</arg_key>"
        const bool is_name = f->kind == K_XNAME;
        const Node *pn = &g->nodes[f->node];  // K_XKEY: the tool's parameters
        int exact;
        const uint64_t keep = is_name ? match_texts(g, call_name, 0, g->n_calls, f->set, f->a, c, &exact)
                                      : match_texts(g, prop_raw, pn->prop0, pn->n_props, f->set, f->a, c, &exact);
        if (keep) {
            f->set = keep;
            f->a++;
            emit(o, t);
            return false;
        }
        if (c != '<' || exact < 0) return false;
        t->depth--;
        JgramFrame *call = top(t);
        if (is_name) {
            call->node = (uint16_t) exact;
            call->st = CL_ARGS;
        } else {
            call->set |= 1ull << exact;
            call->c = (uint32_t) exact;
            call->st = CL_KEYEND;
        }
        return true;
    }
    case K_RAW: {
        const Node *n = &g->nodes[f->node];
        const Prop *p = &g->props[call_params(g, &t->f[t->depth - 2])->prop0 + (int) f->c];
        int exact = -1;
        const uint64_t keep =
            p->n_raw_lits ? match_texts(g, lit_at, p->raw_lit0, p->n_raw_lits, f->set, f->a, c, &exact) : 0;
        if (c == '<' && f->b == 0) {  // the end of the value
            if (p->n_raw_lits ? exact < 0 : f->a < n->min_len) return false;
            pop_value(t);
            return true;
        }
        if (p->n_raw_lits) {
            if (!keep) return false;
            f->set = keep;
            f->a++;
            emit(o, t);
            return false;
        }
        const int r = raw_byte(f, c);
        if (r < 0) return false;
        if (r == 1) {
            if (n->max_len != NONE) {
                if (f->a >= n->max_len) return false;
                f->a++;
            } else if (f->a < n->min_len) {
                f->a++;
            }
        }
        emit(o, t);
        return false;
    }
    default:
        return false;
    }
}

// The one optional space after ':' or ',' (the frame on top allows it while b is set):
// true when c was that space (taken).
static bool take_space(JgramThread *t, uint8_t c, Out *o)
{
    JgramFrame *f = top(t);
    if (c != ' ' || !f->b) return false;
    f->b = 0;
    emit(o, t);
    return true;
}

// The object on top (node n) starts a key (its '"' read).
static void open_key(JgramThread *t, const Node *n, Out *o)
{
    JgramFrame *f = top(t);
    f->st = OB_INKEY;
    f->b = 0;
    const uint64_t seen = f->set;
    if (!push(t, K_KEY, f->node)) return;
    top(t)->set = key_candidates(n, seen);
    emit(o, t);
}

static void feed_thread(const JgramGrammar *g, JgramThread *t, uint8_t c, Out *o)
{
    for (;;) {
        JgramFrame *f = top(t);
        const Node *n = f->kind == K_CALL ? NULL : &g->nodes[f->node];  // a call's node: its tool
        switch (f->kind) {
        case K_ROOT:
            if (f->st != 0) return;
            if ((c == ' ' || c == '\n') && f->a < 2) {
                f->a++;
                emit(o, t);
                return;
            }
            start_value(g, t, g->root, c, o);
            return;
        case K_OBJ:
            switch (f->st) {
            case OB_FIRST:
            case OB_NEXT:
                if (c == '}' && (f->set & n->required) == n->required) {
                    pop_value(t);
                    emit(o, t);
                } else if (c == '"' && f->st == OB_FIRST && more_keys(g, f)) {
                    open_key(t, n, o);
                } else if (c == ',' && f->st == OB_NEXT && more_keys(g, f) &&
                           t->depth + key_value_frames(g, n, f->set) <= JGRAM_MAX_DEPTH) {
                    f->st = OB_KEY;
                    f->b = 1;
                    emit(o, t);
                }
                return;
            case OB_KEY:
                if (!take_space(t, c, o) && c == '"') open_key(t, n, o);
                return;
            case OB_COLON:
                if (c == ':') {
                    f->st = OB_VALUE;
                    f->b = 1;
                    emit(o, t);
                }
                return;
            case OB_VALUE:
                if (take_space(t, c, o)) return;
                f->st = OB_INVAL;
                f->b = 0;
                start_value(g, t, (int) f->c, c, o);
                return;
            default:
                return;
            }
        case K_KEY: {
            int prop;  // a declared name the key equals so far
            const uint64_t keep = match_texts(g, prop_name, n->prop0, n->n_props, f->set, f->a, c, &prop);
            if (f->st == 0 && f->b == 0 && c == '"') {
                t->depth--;
                JgramFrame *p = top(t);
                const int value = prop >= 0 ? g->props[n->prop0 + prop].node : n->addl;
                // (the value's shortest text must fit below the object's frame)
                if (value < 0 || t->depth + g->nodes[value].min_depth > JGRAM_MAX_DEPTH) return;
                if (prop >= 0) {
                    if (p->set >> prop & 1) return;  // a duplicate key
                    p->set |= 1ull << prop;
                }
                p->c = (uint32_t) value;
                p->st = OB_COLON;
                p->a++;
                emit(o, t);
                return;
            }
            if (str_byte(f, c) < 0) return;  // (a closing quote here was handled above)
            if (!keep && n->addl < 0) return;
            f->set = keep;
            if (keep) f->a++;
            else f->a = 0;  // no declared name matches: the count no longer matters
            emit(o, t);
            return;
        }
        case K_STR: {
            const int r = str_byte(f, c);
            if (r < 0) return;
            if (r == 2) {
                if (f->a < n->min_len) return;
                pop_value(t);
            } else if (r == 1) {
                if (n->max_len != NONE) {
                    if (f->a >= n->max_len) return;
                    f->a++;
                } else if (f->a < n->min_len) {
                    f->a++;
                }
            }
            emit(o, t);
            return;
        }
        case K_NUM: {
            const bool digit = c >= '0' && c <= '9';
            int next = -1;
            switch (f->st) {
            case N_SIGN:
                if (digit) next = c == '0' ? N_ZERO : N_INT;
                break;
            case N_ZERO:
            case N_INT:
                if (digit && f->st == N_INT && f->a < 16) next = N_INT;
                else if (c == '.' && !f->c) next = N_DOT;
                else if ((c == 'e' || c == 'E') && !f->c) next = N_E;
                break;
            case N_DOT:
                if (digit) next = N_FRAC;
                break;
            case N_FRAC:
                if (digit && f->a < 16) next = N_FRAC;
                else if (c == 'e' || c == 'E') next = N_E;
                break;
            case N_E:
                if (c == '+' || c == '-') next = N_ESIGN;
                else if (digit) next = N_EXP;
                break;
            case N_ESIGN:
                if (digit) next = N_EXP;
                break;
            case N_EXP:
                if (digit && f->a < 3) next = N_EXP;
                break;
            }
            if (next >= 0) {
                f->a = next == f->st ? f->a + 1 : digit ? 1 : 0;
                f->st = (uint8_t) next;
                emit(o, t);
                return;
            }
            if (!num_complete(f)) return;
            pop_value(t);
            continue;  // the byte goes to the container
        }
        case K_LIT: {
            uint64_t keep = 0;
            for (int i = 0; i < 64; i++)
                if ((f->set >> i & 1) && lit_len(g, f, i) > (int) f->a &&
                    (uint8_t) lit_text(g, f, i)[f->a] == c)
                    keep |= 1ull << i;
            if (keep) {
                f->set = keep;
                f->a++;
                emit(o, t);
                return;
            }
            if (!lit_complete(g, f)) return;
            pop_value(t);
            continue;
        }
        case K_ARR:
            switch (f->st) {
            case AR_FIRST:
            case AR_NEXT:
                if (c == ']' && f->a >= n->min_items) {
                    pop_value(t);
                    emit(o, t);
                } else if (c == ',' && f->st == AR_NEXT && f->a < n->max_items &&
                           t->depth + g->nodes[n->items].min_depth <= JGRAM_MAX_DEPTH) {
                    f->st = AR_VALUE;
                    f->b = 1;
                    emit(o, t);
                } else if (f->st == AR_FIRST && c != ']' && f->a < n->max_items) {
                    f->st = AR_INVAL;
                    f->a++;
                    start_value(g, t, n->items, c, o);
                }
                return;
            case AR_VALUE:
                if (take_space(t, c, o)) return;
                f->st = AR_INVAL;
                f->b = 0;
                f->a++;
                start_value(g, t, n->items, c, o);
                return;
            default:
                return;
            }
        case K_CALL:
        case K_XNAME:
        case K_XKEY:
        case K_XLIT:
        case K_RAW:
            if (feed_call(g, t, c, o)) continue;
            return;
        default:
            return;
        }
    }
}

static bool thread_equal(const JgramThread *a, const JgramThread *b)
{
    return a->depth == b->depth && !memcmp(a->f, b->f, (size_t) a->depth * sizeof *a->f);
}

void jgram_start(const JgramGrammar *g, JgramState *st)
{
    st->n = 1;
    st->t[0].depth = 0;
    if (!g->is_tools) {
        push(&st->t[0], K_ROOT, g->root);
        return;
    }
    // A tool call: the arguments of the named tool, or first the name of one of them.
    push(&st->t[0], K_CALL, 0);
    if (g->is_named) {
        st->t[0].f[0].st = CL_ARGS;
    } else {
        st->t[0].f[0].st = CL_NAME;
        push(&st->t[0], K_XNAME, 0);
        st->t[0].f[1].set = g->n_calls == 64 ? ~0ull : (1ull << g->n_calls) - 1;
    }
}

bool jgram_feed(const JgramGrammar *g, JgramState *st, uint8_t byte)
{
    JgramThread out[JGRAM_MAX_THREADS * MAX_ALTS];
    Out o = {out, 0, JGRAM_MAX_THREADS * MAX_ALTS};
    for (int i = 0; i < st->n; i++) feed_thread(g, &st->t[i], byte, &o);
    // Merge equal threads; keep at most JGRAM_MAX_THREADS (the first ones).
    int n = 0;
    for (int i = 0; i < o.n && n < JGRAM_MAX_THREADS; i++) {
        bool dup = false;
        for (int j = 0; j < n && !dup; j++) dup = thread_equal(&st->t[j], &out[i]);
        if (!dup) {
            st->t[n].depth = out[i].depth;
            memcpy(st->t[n].f, out[i].f, (size_t) out[i].depth * sizeof *out[i].f);
            n++;
        }
    }
    st->n = n;
    return n > 0;
}

bool jgram_feed_bytes(const JgramGrammar *g, JgramState *st, const void *bytes, size_t n)
{
    const uint8_t *b = bytes;
    for (size_t i = 0; i < n && st->n > 0; i++) jgram_feed(g, st, b[i]);
    return st->n > 0;
}

static bool thread_can_end(const JgramGrammar *g, const JgramThread *t)
{
    const JgramFrame *f = &t->f[t->depth - 1];
    if (f->kind == K_ROOT) return f->st == 1;
    if (f->kind == K_CALL) return f->st == CL_DONE;
    if (t->depth != 2 || t->f[0].kind != K_ROOT) return false;
    return (f->kind == K_NUM && num_complete(f)) || (f->kind == K_LIT && lit_complete(g, f));
}

bool jgram_can_end(const JgramGrammar *g, const JgramState *st)
{
    for (int i = 0; i < st->n; i++)
        if (thread_can_end(g, &st->t[i])) return true;
    return false;
}

// ---------------------------------------------------------------------------
// Completion

// The completion under construction: bytes into a caller's buffer of cap bytes; bad once
// it would overflow (the completion does not fit: no allocation, early exit).
typedef struct Wb {
    char *p;
    int n, cap;
    bool bad;
} Wb;

static void put(Wb *s, const char *t, int n)
{
    if (s->bad || s->n + n > s->cap) {
        s->bad = true;
        return;
    }
    memcpy(s->p + s->n, t, (size_t) n);
    s->n += n;
}

// The continuation bytes a character begun with pending state b (utf8_lead) still needs:
// a first one its lead allows, then 0x80s.
static void put_utf8_rest(Wb *s, uint32_t b)
{
    if (!b) return;
    const uint32_t r = b >> 4;
    put(s, r == 1 || r == 3 ? "\xA0" : "\x80", 1);
    for (uint32_t i = 1; i < (b & 0xF); i++) put(s, "\x80", 1);
}

static void put_min(const JgramGrammar *g, Wb *s, int k) { put(s, g->nodes[k].min, g->nodes[k].n_min); }

// Close object frame f (its pending value written): the required properties not yet
// seen, then '}'.
static void close_obj(const JgramGrammar *g, Wb *s, const Node *n, uint64_t seen, bool any_key)
{
    for (int i = 0; i < n->n_props; i++) {
        if (!(n->required >> i & 1) || (seen >> i & 1)) continue;
        const Prop *p = &g->props[n->prop0 + i];
        if (any_key) put(s, ",", 1);
        any_key = true;
        put(s, "\"", 1);
        put(s, g->text.p + p->name.off, p->name.len);
        put(s, "\":", 2);
        put_min(g, s, p->node);
    }
    put(s, "}", 1);
}

// A key for object node n (after '"' has been written when open): the first unseen
// required property, else the first unseen one, else an additional key "".
static int pick_key(const JgramGrammar *g, const Node *n, uint64_t seen, int *value)
{
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n->n_props; i++)
            if (!(seen >> i & 1) && (pass || (n->required >> i & 1))) {
                *value = g->props[n->prop0 + i].node;
                return i;
            }
    *value = n->addl;
    return -1;
}

// The shortest value of tool parameter k as written in a call: raw text (its shortest
// raw enum value, or minLength letters) or JSON.
static void put_prop_min(const JgramGrammar *g, Wb *s, int k)
{
    const Prop *p = &g->props[k];
    if (!p->is_raw) {
        put_min(g, s, p->node);
        return;
    }
    if (p->n_raw_lits) {
        int best = 0;
        for (int i = 1; i < p->n_raw_lits; i++)
            if (g->lits[p->raw_lit0 + i].len < g->lits[p->raw_lit0 + best].len) best = i;
        put(s, g->text.p + g->lits[p->raw_lit0 + best].off, g->lits[p->raw_lit0 + best].len);
        return;
    }
    for (uint32_t i = 0; i < g->nodes[p->node].min_len; i++) put(s, "a", 1);
}

// The rest of call `call` with its arguments `seen` written: the required ones missing,
// then "</tool_call>".
static void call_args_rest(const JgramGrammar *g, Wb *s, int call, uint64_t seen)
{
    const Node *pn = &g->nodes[g->calls[call].params];
    for (int i = 0; i < pn->n_props; i++) {
        if (!(pn->required >> i & 1) || (seen >> i & 1)) continue;
        const Text *r = &g->props[pn->prop0 + i].raw;
        put(s, "<arg_key>", 9);
        put(s, g->text.p + r->off, r->len);
        put(s, "</arg_key><arg_value>", 21);
        put_prop_min(g, s, pn->prop0 + i);
        put(s, "</arg_value>", 12);
    }
    put(s, "</tool_call>", 12);
}

// The rest of an escape (\n, or \u's hex digits as zeros) or of a UTF-8 character that
// string frame f has begun.
static void finish_char(Wb *s, const JgramFrame *f)
{
    if (f->st == 1) put(s, "n", 1);
    for (int i = f->st >= 2 ? f->st : 6; i < 6; i++) put(s, "0", 1);
    put_utf8_rest(s, f->b);
}

// For a key whose bytes written so far (`pos` of them, after the frame's last matched byte)
// may spell some of the declared names `names` of object n: nothing when the key cannot
// equal one of them as it stands, else one more plain character that no such name has at
// `pos`, so that the key closes as an additional one and never as a duplicate. Names that
// matched up to the frame's count but not the bytes since differ already, and the check
// here treats them alike (one character unlike every candidate's at pos suffices).
static void put_unlike_names(const JgramGrammar *g, Wb *s, const Node *n, uint64_t names, int pos)
{
    static const char pool[] =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.~!#$%&()*+,;=?@[]^`{|}";
    bool equal = false, used[128] = {false};
    for (int i = 0; i < n->n_props; i++) {
        if (!(names >> i & 1)) continue;
        const Text *nm = &g->props[n->prop0 + i].name;
        if (nm->len == pos) equal = true;
        else if (nm->len > pos) used[(uint8_t) g->text.p[nm->off + pos] & 127] = true;
    }
    if (!equal) return;
    for (const char *c = pool; *c; c++)
        if (!used[(uint8_t) *c]) {
            put(s, c, 1);
            return;
        }
    s->bad = true;  // not reached: 86 characters, at most 64 names
}

static void thread_completion(const JgramGrammar *g, const JgramThread *t, Wb *s)
{
    uint64_t seen_add = 0;  // a property the completed key on top chose
    int call_st = -1;       // tool calls: the phase the frames above leave the call in
    for (int d = t->depth - 1; d >= 0; d--) {
        const JgramFrame *f = &t->f[d];
        const Node *n = f->kind == K_CALL ? NULL : &g->nodes[f->node];
        const bool is_top = d == t->depth - 1;
        switch (f->kind) {
        case K_XNAME: {  // finish the shortest name still matching
            int best = -1;
            for (int i = 0; i < g->n_calls; i++)
                if ((f->set >> i & 1) && g->calls[i].name.len >= (int) f->a &&
                    (best < 0 || g->calls[i].name.len < g->calls[best].name.len))
                    best = i;
            if (best < 0) {
                s->bad = true;
                return;
            }
            const Text *nm = &g->calls[best].name;
            put(s, g->text.p + nm->off + f->a, nm->len - (int) f->a);
            call_args_rest(g, s, best, 0);
            return;  // the call frame below is done with
        }
        case K_XKEY: {  // finish a name still matching (required first), its value
            const JgramFrame *call = &t->f[d - 1];
            const Node *pn = call_params(g, call);
            int best = -1;
            for (int pass = 0; pass < 2 && best < 0; pass++)
                for (int i = 0; i < pn->n_props && best < 0; i++)
                    if ((f->set >> i & 1) && (pass || (pn->required >> i & 1))) best = i;
            if (best < 0) {
                s->bad = true;
                return;
            }
            const Text *r = &g->props[pn->prop0 + best].raw;
            put(s, g->text.p + r->off + f->a, r->len - (int) f->a);
            put(s, "</arg_key><arg_value>", 21);
            put_prop_min(g, s, pn->prop0 + best);
            put(s, "</arg_value>", 12);
            call_args_rest(g, s, call->node, call->set | 1ull << best);
            return;
        }
        case K_XLIT: {
            const JgramFrame *call = &t->f[d - 1];
            const Node *pn = call_params(g, call);
            // End the call when its required arguments are there, else write another key.
            const bool may_end = (f->set >> XL_END & 1) && (call->set & pn->required) == pn->required;
            int which = -1;
            for (int i = 0; i < XL_N && which < 0; i++)
                if ((f->set >> i & 1) && (i != XL_END || may_end) && (i != XL_ARGKEY || !may_end)) which = i;
            if (which < 0) {
                s->bad = true;
                return;
            }
            put(s, XLITS[which] + f->a, (int) strlen(XLITS[which]) - (int) f->a);
            if (which == XL_END) return;
            if (which == XL_ARGKEY) {
                int value;
                const int i = pick_key(g, pn, call->set, &value);
                if (i < 0) {
                    s->bad = true;
                    return;
                }
                const Text *r = &g->props[pn->prop0 + i].raw;
                put(s, g->text.p + r->off, r->len);
                put(s, "</arg_key><arg_value>", 21);
                put_prop_min(g, s, pn->prop0 + i);
                put(s, "</arg_value>", 12);
                call_args_rest(g, s, call->node, call->set | 1ull << i);
                return;
            }
            if (which == XL_KEYEND) {
                put_prop_min(g, s, pn->prop0 + (int) call->c);
                put(s, "</arg_value>", 12);
            }
            call_args_rest(g, s, call->node, call->set);
            return;
        }
        case K_RAW: {
            const JgramFrame *call = &t->f[d - 1];
            const Prop *p = &g->props[call_params(g, call)->prop0 + (int) f->c];
            if (p->n_raw_lits) {
                int best = -1;
                for (int i = 0; i < p->n_raw_lits; i++) {
                    const int len = g->lits[p->raw_lit0 + i].len;
                    if ((f->set >> i & 1) && len >= (int) f->a &&
                        (best < 0 || len < g->lits[p->raw_lit0 + best].len))
                        best = i;
                }
                if (best < 0) {
                    s->bad = true;
                    return;
                }
                const Text *l = &g->lits[p->raw_lit0 + best];
                put(s, g->text.p + l->off + f->a, l->len - (int) f->a);
            } else {
                put_utf8_rest(s, f->b);
                for (uint32_t i = f->a; i < n->min_len; i++) put(s, "a", 1);
            }
            call_st = CL_VALEND;
            break;
        }
        case K_CALL: {
            const int st = call_st >= 0 ? call_st : is_top ? f->st : CL_VALEND;  // below: a JSON value
            const Node *pn = call_params(g, f);
            if (st == CL_DONE) break;
            if (st == CL_KEYEND) put(s, "</arg_key><arg_value>", 21);
            if (st == CL_KEYEND || st == CL_VALUE) put_prop_min(g, s, pn->prop0 + (int) f->c);
            if (st == CL_KEYEND || st == CL_VALUE || st == CL_VALEND || st == CL_INVAL)
                put(s, "</arg_value>", 12);
            call_args_rest(g, s, f->node, f->set);
            break;
        }
        case K_ROOT:
            if (is_top && f->st == 0) put_min(g, s, g->root);
            break;
        case K_STR:
            finish_char(s, f);
            for (uint32_t i = f->a; i < n->min_len; i++) put(s, "a", 1);
            put(s, "\"", 1);
            break;
        case K_KEY: {
            // Finish a declared name still matching (unseen, required first): its own bytes
            // also finish an escape or a character begun. Else close the key as an
            // additional one, which must not equal a declared (seen) name.
            const uint64_t seen = t->f[d - 1].set;
            int best = -1;
            for (int pass = 0; pass < 2 && best < 0; pass++)
                for (int i = 0; i < n->n_props && best < 0; i++)
                    if ((f->set >> i & 1) && !(seen >> i & 1) && (pass || (n->required >> i & 1)))
                        best = i;
            int value = n->addl;
            if (best >= 0) {
                const Prop *p = &g->props[n->prop0 + best];
                put(s, g->text.p + p->name.off + f->a, p->name.len - (int) f->a);
                value = p->node;
                seen_add = 1ull << best;
            } else {
                if (value < 0) {
                    s->bad = true;
                    return;
                }
                const int at = s->n;
                finish_char(s, f);
                if (f->set) put_unlike_names(g, s, n, f->set, (int) f->a + (s->n - at));
            }
            put(s, "\":", 2);
            put_min(g, s, value);
            break;
        }
        case K_NUM:
            if (f->st == N_SIGN || f->st == N_DOT || f->st == N_E || f->st == N_ESIGN) put(s, "0", 1);
            break;
        case K_LIT: {
            int best = -1;
            for (int i = 0; i < 64; i++)
                if ((f->set >> i & 1) && lit_len(g, f, i) >= (int) f->a &&
                    (best < 0 || lit_len(g, f, i) < lit_len(g, f, best)))
                    best = i;
            if (best >= 0) put(s, lit_text(g, f, best) + f->a, lit_len(g, f, best) - (int) f->a);
            break;
        }
        case K_OBJ: {
            uint64_t seen = f->set | seen_add;
            seen_add = 0;
            int st = is_top ? f->st : OB_NEXT;
            int value;
            if (st == OB_KEY) {
                const int i = pick_key(g, n, seen, &value);
                if (value < 0) {
                    s->bad = true;
                    return;
                }
                put(s, "\"", 1);
                if (i >= 0) {
                    const Prop *p = &g->props[n->prop0 + i];
                    put(s, g->text.p + p->name.off, p->name.len);
                    seen |= 1ull << i;
                } else {  // every declared name is seen: an additional key unlike them
                    put_unlike_names(g, s, n, all_props(n), 0);
                }
                put(s, "\":", 2);
                put_min(g, s, value);
            } else if (st == OB_COLON) {
                put(s, ":", 1);
                put_min(g, s, (int) f->c);
            } else if (st == OB_VALUE) {
                put_min(g, s, (int) f->c);
            }
            close_obj(g, s, n, seen, st != OB_FIRST);
            break;
        }
        case K_ARR: {
            uint32_t count = f->a;
            const int st = is_top ? f->st : AR_NEXT;
            if (st == AR_VALUE) {
                put_min(g, s, n->items);
                count++;
            }
            for (; count < n->min_items; count++) {
                if (count > 0) put(s, ",", 1);
                put_min(g, s, n->items);
            }
            put(s, "]", 1);
            break;
        }
        }
    }
}

int jgram_completion(const JgramGrammar *g, const JgramState *st, char *out, int cap)
{
    if (jgram_can_end(g, st)) return 0;
    if (st->n == 0 || cap < 0) return -1;
    if (st->n == 1) {  // the common case: straight into out (a lone thread's completion
                       // cannot be crowded out: compiling bounds the threads, set_min)
        Wb s = {out, 0, cap, false};
        thread_completion(g, &st->t[0], &s);
        return s.bad ? -1 : s.n;
    }
    // Each thread's completion is valid for that thread; the shortest one that the whole
    // state accepts is returned (checked by feeding it, which costs a copy of the state: the
    // threads beside it could have crowded it out of JGRAM_MAX_THREADS were the schema not
    // bounded, set_min).
    char small[4096];
    char *tmp = cap <= (int) sizeof small ? small : malloc((size_t) cap);
    JgramState probe_st, *probe = &probe_st;
    int best = -1;
    for (int i = 0; tmp && i < st->n; i++) {
        Wb s = {tmp, 0, best < 0 ? cap : best - 1, false};  // only a shorter one is kept
        thread_completion(g, &st->t[i], &s);
        if (s.bad) continue;
        jgram_copy(probe, st);
        if (jgram_feed_bytes(g, probe, tmp, (size_t) s.n) && jgram_can_end(g, probe)) {
            memcpy(out, tmp, (size_t) s.n);
            best = s.n;
        }
    }
    if (tmp != small) free(tmp);
    return best;
}

// ---------------------------------------------------------------------------
// State helpers

void jgram_copy(JgramState *dst, const JgramState *src)
{
    dst->n = src->n;
    for (int i = 0; i < src->n; i++) {
        dst->t[i].depth = src->t[i].depth;
        memcpy(dst->t[i].f, src->t[i].f, (size_t) src->t[i].depth * sizeof *src->t[i].f);
    }
}

uint64_t jgram_hash(const JgramState *st)
{
    uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t) st->n;
    for (int i = 0; i < st->n; i++) {
        const uint8_t *p = (const uint8_t *) st->t[i].f;
        const size_t n = (size_t) st->t[i].depth * sizeof *st->t[i].f;
        h = (h ^ (uint64_t) st->t[i].depth) * 0x100000001b3ull;
        for (size_t k = 0; k < n; k++) h = (h ^ p[k]) * 0x100000001b3ull;
    }
    return h;
}

bool jgram_equal(const JgramState *a, const JgramState *b)
{
    if (a->n != b->n) return false;
    for (int i = 0; i < a->n; i++)
        if (!thread_equal(&a->t[i], &b->t[i])) return false;
    return true;
}

int32_t jgram_plain_room(const JgramGrammar *g, const JgramState *st)
{
    if (st->n != 1) return -1;
    const JgramThread *t = &st->t[0];
    const JgramFrame *f = &t->f[t->depth - 1];
    if (f->st != 0 || f->b != 0 || (f->kind != K_STR && f->kind != K_KEY)) return -1;
    const Node *n = &g->nodes[f->node];
    if (f->kind == K_STR) return n->max_len == NONE ? INT32_MAX : (int32_t) (n->max_len - f->a);
    if (f->kind == K_KEY && f->set == 0 && n->addl >= 0) return INT32_MAX;
    return -1;
}
