/* A minimal, strict reader for a bundle's mars_config.json (runtime/bundle.py, DESIGN.md §5).
 *
 * It parses the whole document as JSON (objects, arrays, strings with escapes, numbers,
 * true/false/null, nesting at most MAX_DEPTH deep) and keeps only the top-level fields
 * this program needs; the others (parity, source_model, ...) are validated and skipped.
 * Anything malformed, missing, of the wrong type or out of range is a CHECK failure
 * naming the file, the byte offset or the field, and what is allowed.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mars.h"

#define FORMAT_VERSION 1
#define MAX_CONFIG_BYTES (16 << 20)
#define MAX_DEPTH 32

typedef struct {
    const char *text;   /* [num_bytes] the file contents (plus a NUL) */
    size_t num_bytes;
    size_t pos;         /* next byte to read */
    const char *path;   /* for messages */
} Json;

static void fail(const Json *j, const char *what) {
    CHECK(errorf("%s: malformed JSON at byte %zu: %s; re-export the bundle", j->path, j->pos, what));
}

static int peek(Json *j) {
    while (j->pos < j->num_bytes && strchr(" \t\r\n", j->text[j->pos]) != NULL) j->pos++;
    return j->pos < j->num_bytes ? (unsigned char)j->text[j->pos] : -1;
}

static void expect(Json *j, char c) {
    if (peek(j) != c) {
        char what[32];
        snprintf(what, sizeof what, "expected '%c'", c);
        fail(j, what);
    }
    j->pos++;
}

static int hex_digit(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Appends byte c to out[0..cap-1] at *len unless out is NULL (skipping); too long is an error. */
static void put(Json *j, char *out, size_t cap, size_t *len, char c) {
    if (out == NULL) return;
    if (*len + 1 >= cap) fail(j, "string too long for this field");
    out[(*len)++] = c;
}

/* Reads a JSON string into out (NUL-terminated, UTF-8), or skips it when out is NULL. */
static void read_string(Json *j, char *out, size_t cap) {
    size_t len = 0;
    expect(j, '"');
    for (;;) {
        if (j->pos >= j->num_bytes) fail(j, "unterminated string");
        unsigned char c = (unsigned char)j->text[j->pos++];
        if (c == '"') break;
        if (c < 0x20) fail(j, "control character inside a string");
        if (c != '\\') { put(j, out, cap, &len, (char)c); continue; }
        if (j->pos >= j->num_bytes) fail(j, "unterminated escape");
        c = (unsigned char)j->text[j->pos++];
        const char *plain = strchr("\"\\/bfnrt", c), *meaning = "\"\\/\b\f\n\r\t";
        if (c != 0 && plain != NULL) { put(j, out, cap, &len, meaning[plain - "\"\\/bfnrt"]); continue; }
        if (c != 'u' || j->pos + 4 > j->num_bytes) fail(j, "bad escape in a string");
        unsigned code = 0;
        for (int k = 0; k < 4; k++) {
            int h = hex_digit((unsigned char)j->text[j->pos++]);
            if (h < 0) fail(j, "bad \\u escape in a string");
            code = code * 16 + (unsigned)h;
        }
        if (code < 0x80) { put(j, out, cap, &len, (char)code); continue; }  /* else UTF-8, 2 or 3 bytes */
        if (code < 0x800) put(j, out, cap, &len, (char)(0xC0 | (code >> 6)));
        else { put(j, out, cap, &len, (char)(0xE0 | (code >> 12))); put(j, out, cap, &len, (char)(0x80 | ((code >> 6) & 0x3F))); }
        put(j, out, cap, &len, (char)(0x80 | (code & 0x3F)));
    }
    if (out != NULL) out[len] = '\0';
    if (out != NULL && strlen(out) != len) fail(j, "string contains a NUL character");
}

/* Reads a JSON number; *is_integer tells whether it had no fraction or exponent. */
static double read_number(Json *j, int *is_integer) {
    peek(j);
    size_t start = j->pos;
    while (j->pos < j->num_bytes && strchr("+-0123456789.eE", j->text[j->pos]) != NULL) j->pos++;
    size_t len = j->pos - start;
    char buf[64];
    if (len == 0 || len >= sizeof buf) fail(j, "expected a number");
    memcpy(buf, j->text + start, len);
    buf[len] = '\0';
    char *end;
    double value = strtod(buf, &end);
    if (*end != '\0' || !(buf[0] == '-' || (buf[0] >= '0' && buf[0] <= '9'))) { j->pos = start; fail(j, "bad number"); }
    *is_integer = strpbrk(buf, ".eE") == NULL;
    return value;
}

static void skip_value(Json *j, int depth);

static void skip_literal(Json *j, const char *word) {
    size_t n = strlen(word);
    if (j->pos + n > j->num_bytes || memcmp(j->text + j->pos, word, n) != 0) fail(j, "unexpected token");
    j->pos += n;
}

/* Skips an object's members (close = '}') or an array's elements (close = ']'). */
static void skip_container(Json *j, int depth, char close) {
    j->pos++;  /* the opening bracket */
    if (peek(j) == close) { j->pos++; return; }
    for (;;) {
        if (close == '}') { read_string(j, NULL, 0); expect(j, ':'); }
        skip_value(j, depth + 1);
        if (peek(j) == close) { j->pos++; return; }
        expect(j, ',');
    }
}

static void skip_value(Json *j, int depth) {
    if (depth > MAX_DEPTH) fail(j, "nested too deeply");
    int c = peek(j), is_integer;
    if (c == '"') read_string(j, NULL, 0);
    else if (c == '{') skip_container(j, depth, '}');
    else if (c == '[') skip_container(j, depth, ']');
    else if (c == 't') skip_literal(j, "true");
    else if (c == 'f') skip_literal(j, "false");
    else if (c == 'n') skip_literal(j, "null");
    else (void)read_number(j, &is_integer);
}

/* ---- the fields ---------------------------------------------------------------- */

typedef struct {
    const char *name;
    size_t offset;   /* into MarsConfig, or SIZE_MAX for format_version */
    int min, max;    /* allowed range */
} IntField;

static const IntField INT_FIELDS[] = {
    {"format_version", SIZE_MAX, 0, 1 << 30},
    {"block_size", offsetof(MarsConfig, block_size), 1, 4096},
    {"window", offsetof(MarsConfig, window), 1, 4096},
    {"mask_token_id", offsetof(MarsConfig, mask_token_id), 0, (1 << 30) - 1},
    {"pad_token_id", offsetof(MarsConfig, pad_token_id), 0, (1 << 30) - 1},
    {"num_layers", offsetof(MarsConfig, num_layers), 1, 1024},
    {"num_kv_heads", offsetof(MarsConfig, num_kv_heads), 1, 1024},
    {"head_dim", offsetof(MarsConfig, head_dim), 1, 4096},
    {"vocab_size", offsetof(MarsConfig, vocab_size), 1, 1 << 24},
    {"max_context", offsetof(MarsConfig, max_context), 1, 1 << 24},
};
#define NUM_INT_FIELDS ((int)(sizeof INT_FIELDS / sizeof INT_FIELDS[0]))

static int read_int(Json *j, const char *field, int min, int max) {
    int is_integer, c = peek(j);
    CHECK(require(c == '-' || (c >= '0' && c <= '9'), "%s: field %s must be an integer in %d..%d, got something else "
                  "at byte %zu; re-export the bundle", j->path, field, min, max, j->pos));
    double value = read_number(j, &is_integer);
    CHECK(require(is_integer && value >= min && value <= max, "%s: field %s must be an integer in %d..%d, got %.17g; "
                  "re-export the bundle", j->path, field, min, max, value));
    return (int)value;
}

static void read_eos_ids(Json *j, MarsConfig *cfg) {
    cfg->num_eos = 0;
    if (peek(j) != '[') fail(j, "eos_token_ids must be an array of integers");
    j->pos++;
    if (peek(j) == ']') { j->pos++; return; }
    for (;;) {
        CHECK(require(cfg->num_eos < MAX_EOS_IDS, "%s: more than %d eos_token_ids", j->path, MAX_EOS_IDS));
        cfg->eos_token_ids[cfg->num_eos++] = read_int(j, "eos_token_ids[]", 0, (1 << 30) - 1);
        if (peek(j) == ']') { j->pos++; return; }
        expect(j, ',');
    }
}

static void read_dtype(Json *j, MarsConfig *cfg) {
    char dtype[MAX_NAME];
    if (peek(j) != '"') fail(j, "dtype must be a string");
    read_string(j, dtype, sizeof dtype);
    if (strcmp(dtype, "float32") == 0) { cfg->kv_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; cfg->kv_elem_size = 4; }
    else if (strcmp(dtype, "float16") == 0) { cfg->kv_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16; cfg->kv_elem_size = 2; }
    else CHECK(errorf("%s: dtype must be \"float32\" or \"float16\", got \"%s\"", j->path, dtype));
}

/* Reads the top-level object; returns a bit mask of the INT_FIELDS seen (bit k = field k),
 * plus bit NUM_INT_FIELDS for eos_token_ids and bit NUM_INT_FIELDS + 1 for dtype. */
static unsigned read_fields(Json *j, MarsConfig *cfg, int *format_version) {
    unsigned seen = 0;
    if (peek(j) != '{') fail(j, "the config must be a JSON object");
    j->pos++;
    if (peek(j) == '}') { j->pos++; return seen; }
    for (;;) {
        char key[MAX_NAME];
        if (peek(j) != '"') fail(j, "expected a field name");
        read_string(j, key, sizeof key);
        expect(j, ':');
        int k = 0;
        while (k < NUM_INT_FIELDS && strcmp(key, INT_FIELDS[k].name) != 0) k++;
        if (k < NUM_INT_FIELDS) {
            const IntField *f = &INT_FIELDS[k];
            int value = read_int(j, f->name, f->min, f->max);
            *(f->offset == SIZE_MAX ? format_version : (int *)((char *)cfg + f->offset)) = value;
            seen |= 1u << k;
        } else if (strcmp(key, "eos_token_ids") == 0) { read_eos_ids(j, cfg); seen |= 1u << NUM_INT_FIELDS; }
        else if (strcmp(key, "dtype") == 0) { read_dtype(j, cfg); seen |= 1u << (NUM_INT_FIELDS + 1); }
        else if (strcmp(key, "onnx_file") == 0) {
            if (peek(j) != '"') fail(j, "onnx_file must be a string");
            read_string(j, cfg->onnx_file, sizeof cfg->onnx_file);
        } else if (strcmp(key, "graph") == 0) {  /* absent: "step"; "fused" holds the model builder's batch-1 graph */
            char graph[MAX_NAME];
            if (peek(j) != '"') fail(j, "graph must be a string");
            read_string(j, graph, sizeof graph);
            CHECK(require(strcmp(graph, "step") == 0, "%s: graph \"%s\": this program runs the step graph only; "
                          "export the bundle with mars-export --graph step", j->path, graph));
        } else skip_value(j, 1);
        if (peek(j) == '}') { j->pos++; break; }
        expect(j, ',');
    }
    if (peek(j) != -1) fail(j, "trailing characters after the config object");
    return seen;
}

static void validate(const MarsConfig *cfg, unsigned seen, int format_version, const char *path) {
    const char *names[NUM_INT_FIELDS + 2];
    for (int k = 0; k < NUM_INT_FIELDS; k++) names[k] = INT_FIELDS[k].name;
    names[NUM_INT_FIELDS] = "eos_token_ids";
    names[NUM_INT_FIELDS + 1] = "dtype";
    for (int k = 0; k < NUM_INT_FIELDS + 2; k++)
        CHECK(require(seen & (1u << k), "%s lacks the field %s; re-export the bundle", path, names[k]));
    CHECK(require(format_version == FORMAT_VERSION, "%s: bundle format version %d is not supported (this program "
                  "reads version %d); re-export the bundle", path, format_version, FORMAT_VERSION));
    CHECK(require(cfg->block_size <= cfg->window, "%s: block_size %d must be in 1..window (%d)", path,
                  cfg->block_size, cfg->window));
    CHECK(require(cfg->num_eos > 0, "%s: eos_token_ids is empty: generation could never stop", path));
    int ids[2 + MAX_EOS_IDS] = {cfg->mask_token_id, cfg->pad_token_id};
    memcpy(ids + 2, cfg->eos_token_ids, (size_t)cfg->num_eos * sizeof(int));
    for (int k = 0; k < 2 + cfg->num_eos; k++)
        CHECK(require(ids[k] < cfg->vocab_size, "%s: token id %d (mask, pad or eos) is outside the vocabulary "
                      "(0..%d); re-export the bundle", path, ids[k], cfg->vocab_size - 1));
    CHECK(require(cfg->onnx_file[0] != '\0', "%s: onnx_file is empty", path));
}

void load_config(MarsConfig *cfg, const char *bundle_dir) {
    char path[4096];
    CHECK(require(snprintf(path, sizeof path, "%s/mars_config.json", bundle_dir) < (int)sizeof path,
                  "bundle path too long: %s", bundle_dir));
    FILE *f = fopen(path, "rb");
    CHECK(require(f != NULL, "%s not found: %s is not a MARS bundle (export one with mars-export)", path, bundle_dir));
    char *text = MALLOC(MAX_CONFIG_BYTES + 1);
    size_t num_bytes = fread(text, 1, MAX_CONFIG_BYTES + 1, f);
    int read_error = ferror(f);
    fclose(f);
    if (read_error || num_bytes > MAX_CONFIG_BYTES) free(text);
    CHECK(require(!read_error, "cannot read %s", path));
    CHECK(require(num_bytes <= MAX_CONFIG_BYTES, "%s is larger than %d bytes: not a bundle config", path, MAX_CONFIG_BYTES));
    text[num_bytes] = '\0';
    memset(cfg, 0, sizeof *cfg);
    strcpy(cfg->onnx_file, "model.onnx");
    int format_version = -1;
    Json j = {text, num_bytes, 0, path};
    unsigned seen = read_fields(&j, cfg, &format_version);
    free(text);
    validate(cfg, seen, format_version, path);
}
