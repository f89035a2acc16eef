/* The step graph on ONNX Runtime, and the KV cache it reads and writes in place.
 *
 * Step graph I/O (runtime/bundle.py; DESIGN.md §5), batch 1:
 *   inputs   input_ids                 int64   [1, W]
 *            position_ids              int64   [1, W]            each < S: where the entry's KV is written
 *            attention_mask            bool    [1, 1, W, S]      over the cache's indices: query q sees k <= P + q
 *                                                                (the P committed keys, then the window's 0..q)
 *            past_key_values.{i}.key   kv      [1, H, S, D]      the KV cache, position p at index p
 *            past_key_values.{i}.value kv      [1, H, S, D]      (kv = float32 or float16)
 *            num_logits                int64   []                optional (an initializer with a default)
 *            num_greedy                int64   []                optional, default 0: not fed here
 *            confidence_tau            float32 [1]               optional, default -1 (the head always runs): not fed
 *   outputs  logits                    float32 [1, W, V]
 *            present.{i}.key / .value  kv      [1, H, S, D]      the past with entry j written at position_ids[j]
 *            greedy_ids                int64   [1, G]            with num_greedy (float32 graphs): not fetched
 *            head_skipped              bool    []                with confidence_tau: not fetched
 * Each present is bound to its past's own buffer (one OrtValue over the cache, passed to Run as
 * both the input and the pre-allocated output; ORT writes an output into a pre-allocated value),
 * so the graph writes the window's W entries into the cache in place and a commit copies nothing:
 * it only advances P. Older step graphs, whose presents hold only the W new entries ([1, H, W, D]),
 * are refused (re-export). Graphs whose window axis is symbolic also take T prompt tokens in place
 * of W (prefill), and those with num_logits skip the output head when it is 0 (logits [1, 0, V]).
 * Float16 KV is moved as opaque 2-byte elements: this program never does arithmetic on it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mars.h"

/* ---- KV cache ------------------------------------------------------------------ */

#define MIN_CACHE_SIZE 16  /* S of a new cache, as runtime.decode.kv_cache.MIN_CAPACITY */

void kv_cache_init(KVCache *cache, const MarsConfig *cfg, int capacity) {
    size_t num_bytes = (size_t)cfg->num_kv_heads * (size_t)capacity * (size_t)cfg->head_dim * (size_t)cfg->kv_elem_size;
    cache->num_layers = cfg->num_layers;
    cache->num_kv_heads = cfg->num_kv_heads;
    cache->head_dim = cfg->head_dim;
    cache->elem_size = (size_t)cfg->kv_elem_size;
    cache->type = cfg->kv_type;
    cache->length = 0;
    cache->capacity = capacity;
    cache->size = capacity < MIN_CACHE_SIZE ? capacity : MIN_CACHE_SIZE;
    cache->keys = MALLOC((size_t)cfg->num_layers * sizeof(void *));
    cache->values = MALLOC((size_t)cfg->num_layers * sizeof(void *));
    /* zeroed: a step reads the masked positions too (weight 0 x finite = 0, 0 x NaN = NaN); later they hold
     * finite KV only (committed entries, a window's uncommitted ones, what a relayout left behind) */
    for (int i = 0; i < cfg->num_layers; i++) {
        cache->keys[i] = memset(MALLOC(num_bytes), 0, num_bytes);
        cache->values[i] = memset(MALLOC(num_bytes), 0, num_bytes);
    }
}

void kv_cache_free(KVCache *cache) {
    for (int i = 0; i < cache->num_layers; i++) {
        free(cache->keys[i]);
        free(cache->values[i]);
    }
    free(cache->keys);
    free(cache->values);
}

/* Lays one block out again from S = old to new (> old) positions per head, keeping the first P of
 * each. Heads move from last to first, so that no source is overwritten before it has moved (head h
 * goes from row h*old to row h*new >= h*old). */
static void relayout(char *block, int H, int P, int old, int new, size_t row_bytes) {
    for (int h = H - 1; h > 0; h--)
        memmove(block + (size_t)h * (size_t)new * row_bytes, block + (size_t)h * (size_t)old * row_bytes,
                (size_t)P * row_bytes);
}

/* Makes S at least `needed`: doubles it until it fits, capped at the capacity (O(P) per doubling,
 * so O(1) per generated position overall). A step reserves P + w first: the graph writes its w
 * entries at indices P .. P+w-1 of the [1, H, S, D] it is fed, which must exist. */
static void kv_cache_reserve(KVCache *cache, int needed) {
    CHECK(require(needed <= cache->capacity, "KV cache overflow: %d positions > capacity %d", needed,
                  cache->capacity));
    int size = cache->size;
    while (size < needed) size = size * 2 < cache->capacity ? size * 2 : cache->capacity;
    if (size == cache->size) return;
    size_t row_bytes = (size_t)cache->head_dim * cache->elem_size;
    for (int i = 0; i < cache->num_layers; i++) {
        relayout(cache->keys[i], cache->num_kv_heads, cache->length, cache->size, size, row_bytes);
        relayout(cache->values[i], cache->num_kv_heads, cache->length, cache->size, size, row_bytes);
    }
    cache->size = size;
}

/* ---- session and I/O checks ---------------------------------------------------- */

static char *format_name(const char *fmt, int layer) {
    char *name = MALLOC(64);
    snprintf(name, 64, fmt, layer);
    return name;
}

static void make_names(StepGraph *g) {
    int L = g->num_layers;
    g->input_names = MALLOC((size_t)(4 + 2 * L) * sizeof(char *));
    g->output_names = MALLOC((size_t)(1 + 2 * L) * sizeof(char *));
    g->input_names[0] = "input_ids";
    g->input_names[1] = "position_ids";
    g->input_names[2] = "attention_mask";
    g->input_names[3 + 2 * L] = "num_logits";
    g->output_names[0] = "logits";
    for (int i = 0; i < L; i++) {
        g->input_names[3 + 2 * i] = format_name("past_key_values.%d.key", i);
        g->input_names[4 + 2 * i] = format_name("past_key_values.%d.value", i);
        g->output_names[1 + 2 * i] = format_name("present.%d.key", i);
        g->output_names[2 + 2 * i] = format_name("present.%d.value", i);
    }
}

/* Element type and the first 4 dims (-1 = symbolic) of input `index` (or output if is_output). */
static ONNXTensorElementDataType io_type(const StepGraph *g, int is_output, size_t index, int64_t dims[4], size_t *rank) {
    OrtTypeInfo *type_info;
    const OrtTensorTypeAndShapeInfo *tensor_info;
    ONNXTensorElementDataType type;
    CHECK(is_output ? g_ort->SessionGetOutputTypeInfo(g->session, index, &type_info)
                    : g_ort->SessionGetInputTypeInfo(g->session, index, &type_info));
    CHECK(g_ort->CastTypeInfoToTensorInfo(type_info, &tensor_info));
    CHECK(require(tensor_info != NULL, "step graph I/O %zu is not a tensor", index));
    CHECK(g_ort->GetTensorElementType(tensor_info, &type));
    CHECK(g_ort->GetDimensionsCount(tensor_info, rank));
    int64_t all[8] = {0};
    CHECK(require(*rank <= 8, "step graph I/O %zu has rank %zu", index, *rank));
    CHECK(g_ort->GetDimensions(tensor_info, all, *rank));
    memcpy(dims, all, 4 * sizeof(int64_t));
    g_ort->ReleaseTypeInfo(type_info);
    return type;
}

/* Axis `axis` (< 4) of input `index` (or output if is_output), written into `name` as onnxruntime declares it:
 * its size, or its symbol ("?" when it has none). */
static void io_axis(const StepGraph *g, int is_output, size_t index, size_t axis, char name[64]) {
    OrtTypeInfo *type_info;
    const OrtTensorTypeAndShapeInfo *tensor_info;
    size_t rank;
    int64_t dims[4];
    const char *symbols[4] = {NULL};
    io_type(g, is_output, index, dims, &rank);
    CHECK(require(rank == 4 && axis < 4, "step graph %s %zu has rank %zu, expected 4", is_output ? "output" : "input",
                  index, rank));
    CHECK(is_output ? g_ort->SessionGetOutputTypeInfo(g->session, index, &type_info)
                    : g_ort->SessionGetInputTypeInfo(g->session, index, &type_info));
    CHECK(g_ort->CastTypeInfoToTensorInfo(type_info, &tensor_info));
    CHECK(g_ort->GetSymbolicDimensions(tensor_info, symbols, 4));
    if (dims[axis] >= 0) snprintf(name, 64, "%lld", (long long)dims[axis]);
    else snprintf(name, 64, "%s", symbols[axis] != NULL && symbols[axis][0] ? symbols[axis] : "?");  /* a copy: type_info owns it */
    g_ort->ReleaseTypeInfo(type_info);
}

/* Whether the graph has an initializer named `wanted` that a run may feed (an input with a default). */
static int has_overridable_initializer(const StepGraph *g, const char *wanted) {
    OrtAllocator *allocator;
    size_t count;
    int found = 0;
    CHECK(g_ort->GetAllocatorWithDefaultOptions(&allocator));
    CHECK(g_ort->SessionGetOverridableInitializerCount(g->session, &count));
    for (size_t k = 0; k < count && !found; k++) {
        char *name;
        CHECK(g_ort->SessionGetOverridableInitializerName(g->session, k, allocator, &name));
        found = strcmp(name, wanted) == 0;
        CHECK(g_ort->AllocatorFree(allocator, name));
    }
    return found;
}

/* The graph's I/O names (in order), window and KV dtype must match mars_config.json. */
static void check_io(StepGraph *g, const MarsConfig *cfg, const char *path) {
    size_t num_in, num_out, L = (size_t)cfg->num_layers, rank;
    OrtAllocator *allocator;
    CHECK(g_ort->GetAllocatorWithDefaultOptions(&allocator));
    CHECK(g_ort->SessionGetInputCount(g->session, &num_in));
    CHECK(g_ort->SessionGetOutputCount(g->session, &num_out));
    /* A float32 graph's greedy head (mars_export/greedy_head.py) adds the output greedy_ids after the presents, and its
       confidence gate (mars_export/confidence_gate.py) the output head_skipped; their inputs num_greedy and
       confidence_tau default to no rows and to always running the output head, so this program neither feeds nor
       fetches them. */
    size_t head = (size_t)has_overridable_initializer(g, "num_greedy")
                  + (size_t)has_overridable_initializer(g, "confidence_tau");
    CHECK(require(num_in == 3 + 2 * L && num_out == 1 + 2 * L + head, "%s has %zu inputs and %zu outputs, but "
                  "mars_config.json says %zu layers (%zu inputs, %zu outputs); re-export the bundle", path, num_in,
                  num_out, L, 3 + 2 * L, 1 + 2 * L + head));
    num_out -= head;
    for (size_t k = 0; k < num_in + num_out; k++) {
        int is_output = k >= num_in;
        size_t index = is_output ? k - num_in : k;
        const char *expected = is_output ? g->output_names[index] : g->input_names[index];
        char *name;
        CHECK(is_output ? g_ort->SessionGetOutputName(g->session, index, allocator, &name)
                        : g_ort->SessionGetInputName(g->session, index, allocator, &name));
        int same = strcmp(name, expected) == 0;
        OrtStatus *status = require(same, "%s: %s %zu is named %s, expected %s; re-export the bundle", path,
                                    is_output ? "output" : "input", index, name, expected);
        CHECK(g_ort->AllocatorFree(allocator, name));
        CHECK(status);
    }
    int64_t dims[4];
    ONNXTensorElementDataType type = io_type(g, 0, 0, dims, &rank);
    /* dims[1] is -1 in graphs with a dynamic window axis (any length: W per decode step, T per prefill). */
    CHECK(require(type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 && rank == 2 && (dims[1] == cfg->window || dims[1] < 0),
                  "%s: input_ids must be int64 [batch, %d] (the config's window), got rank %zu with %lld tokens; "
                  "re-export the bundle", path, cfg->window, rank, (long long)dims[1]));
    g->is_window_dynamic = dims[1] < 0;
    g->takes_num_logits = has_overridable_initializer(g, "num_logits");
    type = io_type(g, 0, 3, dims, &rank);
    CHECK(require(type == cfg->kv_type && rank == 4, "%s: past_key_values.0.key has element type %d (rank %zu), but "
                  "mars_config.json's dtype needs %d (1 float32, 10 float16); re-export the bundle", path, (int)type,
                  rank, (int)cfg->kv_type));
    CHECK(require((dims[1] <= 0 || dims[1] == cfg->num_kv_heads) && (dims[3] <= 0 || dims[3] == cfg->head_dim),
                  "%s: past KV shape [.., %lld, .., %lld] does not match num_kv_heads %d, head_dim %d", path,
                  (long long)dims[1], (long long)dims[3], cfg->num_kv_heads, cfg->head_dim));
    /* The presents must be the pasts written in place ([1, H, S, D], the past's own S axis): older step graphs
     * output only the W new entries ([1, H, W, D]), which this program no longer copies into its cache. */
    type = io_type(g, 1, 1, dims, &rank);
    CHECK(require(type == cfg->kv_type && rank == 4, "%s: present.0.key has element type %d (rank %zu), but its past "
                  "needs %d (it is written into the past's buffer); re-export the bundle", path, (int)type, rank,
                  (int)cfg->kv_type));
    char past_axis[64], present_axis[64];
    io_axis(g, 0, 3, 2, past_axis);
    io_axis(g, 1, 1, 2, present_axis);
    CHECK(require(strcmp(past_axis, present_axis) == 0,
                  "%s is an older step graph that outputs only the window's new KV entries (present.0.key's axis 2 "
                  "is '%s', past_key_values.0.key's '%s'; this program has the graph write them into its KV cache in "
                  "place); re-export the bundle with mars-export", path, present_axis, past_axis));
    type = io_type(g, 1, 0, dims, &rank);
    CHECK(require(type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && rank == 3 && (dims[2] <= 0 || dims[2] == cfg->vocab_size),
                  "%s: logits must be float32 [batch, %d, %d] (window, vocab_size), got type %d, rank %zu, vocab %lld; "
                  "re-export the bundle", path, cfg->window, cfg->vocab_size, (int)type, rank, (long long)dims[2]));
}

static OrtValue *make_tensor(const StepGraph *g, void *data, size_t num_bytes, const int64_t *shape, size_t rank,
                             ONNXTensorElementDataType type) {
    OrtValue *value;
    CHECK(g_ort->CreateTensorWithDataAsOrtValue(g->cpu, data, num_bytes, shape, rank, type, &value));
    return value;
}

void step_graph_init(StepGraph *g, const MarsConfig *cfg, const char *bundle_dir, int num_threads, int max_cache) {
    memset(g, 0, sizeof *g);
    g->num_layers = cfg->num_layers;
    g->window = cfg->window;
    g->vocab_size = cfg->vocab_size;
    char path[4096];
    CHECK(require(snprintf(path, sizeof path, "%s/%s", bundle_dir, cfg->onnx_file) < (int)sizeof path,
                  "bundle path too long: %s", bundle_dir));
    FILE *f = fopen(path, "rb");
    CHECK(require(f != NULL, "%s not found; re-export the bundle with mars-export", path));
    fclose(f);
    OrtSessionOptions *options;
    CHECK(g_ort->CreateEnv(ORT_LOGGING_LEVEL_ERROR, "mars_c", &g->env));
    CHECK(g_ort->CreateSessionOptions(&options));
    CHECK(g_ort->SetIntraOpNumThreads(options, num_threads));
    AnonRanges before;  /* the session's weights onto huge pages, as the Python runtime (huge_pages.c) */
    anon_ranges_read(&before);
    CHECK(g_ort->CreateSession(g->env, path, options, &g->session));
    g->huge_page_bytes = collapse_new_ranges(&before);
    free(before.ranges);
    g_ort->ReleaseSessionOptions(options);
    make_names(g);
    check_io(g, cfg, path);
    CHECK(g_ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &g->cpu));

    int W = cfg->window, L = cfg->num_layers;
    g->input_ids = MALLOC((size_t)W * sizeof(int64_t));
    g->position_ids = MALLOC((size_t)W * sizeof(int64_t));
    g->attention_mask = MALLOC((size_t)W * (size_t)max_cache);  /* S <= the cache's capacity, max_cache */
    g->logits = MALLOC((size_t)W * (size_t)cfg->vocab_size * sizeof(float));
    g->outputs = MALLOC((size_t)(1 + 2 * L) * sizeof(OrtValue *));
    g->inputs = MALLOC((size_t)(4 + 2 * L) * sizeof(OrtValue *));
}

void step_graph_free(StepGraph *g) {
    for (int k = 3; k < 3 + 2 * g->num_layers; k++) free((char *)g->input_names[k]);
    for (int k = 1; k < 1 + 2 * g->num_layers; k++) free((char *)g->output_names[k]);
    free(g->inputs);
    free(g->outputs);
    free(g->input_names);
    free(g->output_names);
    free(g->input_ids);
    free(g->position_ids);
    free(g->attention_mask);
    free(g->logits);
    g_ort->ReleaseMemoryInfo(g->cpu);
    g_ort->ReleaseSession(g->session);
    g_ort->ReleaseEnv(g->env);
}

/* ---- one forward ----------------------------------------------------------------- */

/* One forward of the T ids in `ids` at positions P .. P+T-1 (written into `positions`) over the cache,
 * which must hold S >= P + T positions (kv_cache_reserve): the mask [1, 1, T, S] over the cache's
 * indices, query i seeing k <= P + i (the P committed keys, then the window's keys 0 .. i at their
 * positions), is written into `mask` (T * S bytes); each layer's key and value block [1, H, S, D] is
 * wrapped in one OrtValue, fed as past_key_values.{i}.* and passed to Run as the pre-allocated
 * present.{i}.*, so ORT writes the present into the cache itself: the graph puts the T new entries at
 * indices P .. P+T-1 in place and nothing is copied. `logits` is the pre-allocated logits output
 * [1, T, V], or NULL: ORT allocates them and they are dropped unread. `num_logits`, if not NULL, is fed
 * as the num_logits input. Commits nothing: the caller advances P over the real tokens. */
static void forward(StepGraph *g, KVCache *cache, int64_t *ids, int64_t *positions, int T, uint8_t *mask,
                    float *logits, int64_t *num_logits) {
    int P = cache->length, S = cache->size, L = g->num_layers, H = cache->num_kv_heads;
    CHECK(require(P + T <= S, "forward: %d cached + %d new positions exceed the KV cache layout of %d (reserve first)", P, T, S));
    for (int i = 0; i < T; i++) {
        positions[i] = P + i;  /* [1, T]: entry i goes to index P + i, where it is committed */
        for (int k = 0; k < S; k++) mask[(size_t)i * (size_t)S + (size_t)k] = k <= P + i;
    }
    int64_t ids_shape[2] = {1, T}, mask_shape[4] = {1, 1, T, S}, kv_shape[4] = {1, H, S, cache->head_dim};
    int64_t logits_shape[3] = {1, T, g->vocab_size};
    size_t kv_bytes = (size_t)H * (size_t)S * (size_t)cache->head_dim * cache->elem_size;
    OrtValue **inputs = g->inputs, **outputs = g->outputs;  /* over this program's buffers: ORT writes into them */
    inputs[0] = make_tensor(g, ids, (size_t)T * sizeof(int64_t), ids_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    inputs[1] = make_tensor(g, positions, (size_t)T * sizeof(int64_t), ids_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    inputs[2] = make_tensor(g, mask, (size_t)T * (size_t)S, mask_shape, 4, ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL);
    for (int k = 0; k < 2 * L; k++) {  /* k0, v0, k1, v1, ...: the same value in and out */
        inputs[3 + k] = make_tensor(g, k % 2 ? cache->values[k / 2] : cache->keys[k / 2], kv_bytes, kv_shape, 4, cache->type);
        outputs[1 + k] = inputs[3 + k];
    }
    size_t num_inputs = (size_t)(3 + 2 * L);
    if (num_logits != NULL)
        inputs[num_inputs++] = make_tensor(g, num_logits, sizeof *num_logits, NULL, 0, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    outputs[0] = logits == NULL ? NULL : make_tensor(g, logits, (size_t)T * (size_t)g->vocab_size * sizeof(float),
                                                     logits_shape, 3, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    CHECK(g_ort->Run(g->session, NULL, g->input_names, (const OrtValue *const *)inputs, num_inputs,
                     g->output_names, (size_t)(1 + 2 * L), outputs));
    for (size_t k = 0; k < num_inputs; k++) g_ort->ReleaseValue(inputs[k]);  /* the presents among them */
    g_ort->ReleaseValue(outputs[0]);
}

void run_window(StepGraph *g, KVCache *cache, const int64_t *tokens, int num_tokens, int width, int64_t fill_id) {
    CHECK(require(width >= 1 && width <= g->window && (width == g->window || g->is_window_dynamic) &&
                  num_tokens >= 1 && num_tokens <= width, "run_window: %d tokens in a window of %d (graph window %d, %s)",
                  num_tokens, width, g->window, g->is_window_dynamic ? "dynamic" : "fixed"));
    kv_cache_reserve(cache, cache->length + width);  /* the graph writes the window's entries at P .. P+w-1 */
    for (int i = 0; i < width; i++) g->input_ids[i] = i < num_tokens ? tokens[i] : fill_id;  /* [1, w] */
    forward(g, cache, g->input_ids, g->position_ids, width, g->attention_mask, g->logits, NULL);
    cache->length += num_tokens;  /* commit: the real tokens' KV is already at P ..; the fill's stays beyond, hidden */
}

void run_prefill(StepGraph *g, KVCache *cache, const int64_t *tokens, int T) {
    CHECK(require(g->is_window_dynamic && T >= 1, "run_prefill: %d tokens through a graph whose window is %s", T,
                  g->is_window_dynamic ? "dynamic" : "fixed (prefill W tokens at a time with run_window)"));
    kv_cache_reserve(cache, cache->length + T);  /* the graph writes the T entries at P .. P+T-1 */
    int64_t *ids = MALLOC((size_t)T * sizeof(int64_t)), *positions = MALLOC((size_t)T * sizeof(int64_t)), no_logits = 0;
    uint8_t *mask = MALLOC((size_t)T * (size_t)cache->size);
    memcpy(ids, tokens, (size_t)T * sizeof(int64_t));  /* [1, T] */
    /* logits allocated by ORT: [1, 0, V] where num_logits = 0 skips the output head, else [1, T, V], unread */
    forward(g, cache, ids, positions, T, mask, NULL, g->takes_num_logits ? &no_logits : NULL);
    cache->length += T;
    free(mask);
    free(positions);
    free(ids);
}
