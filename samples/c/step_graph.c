/* The step graph on ONNX Runtime, and the KV cache it reads and grows.
 *
 * Step graph I/O (runtime/bundle.py; DESIGN.md §5), batch 1:
 *   inputs   input_ids                 int64   [1, W]
 *            position_ids              int64   [1, W]
 *            attention_mask            bool    [1, 1, W, S + W]  (keys: S past, the first P cached; W new)
 *            past_key_values.{i}.key   kv      [1, H, S, D]      (kv = float32 or float16)
 *            past_key_values.{i}.value kv      [1, H, S, D]
 *            num_logits                int64   []                optional (an initializer with a default)
 *   outputs  logits                    float32 [1, W, V]
 *            present.{i}.key / .value  kv      [1, H, W, D]      ONLY the W new entries
 * Graphs whose window axis is symbolic also take T prompt tokens in place of W (prefill), and
 * those with num_logits skip the output head when it is 0 (logits [1, 0, V]).
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
    for (int i = 0; i < cfg->num_layers; i++) {  /* zeroed: a step reads the masked positions too (weight 0 x finite = 0) */
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
 * so O(1) per generated position overall). */
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

/* Commits the KV of the first n (real-token) positions of presents [2L] x [1, H, W, D] at P.. of every head. */
static void kv_cache_commit(KVCache *cache, void *const *presents, int W, int n) {
    kv_cache_reserve(cache, cache->length + n);
    size_t row_bytes = (size_t)cache->head_dim * cache->elem_size;
    for (int i = 0; i < 2 * cache->num_layers; i++) {
        char *block = i % 2 ? cache->values[i / 2] : cache->keys[i / 2];
        for (int h = 0; h < cache->num_kv_heads; h++)
            memcpy(block + ((size_t)h * (size_t)cache->size + (size_t)cache->length) * row_bytes,
                   (const char *)presents[i] + (size_t)h * (size_t)W * row_bytes, (size_t)n * row_bytes);
    }
    cache->length += n;
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
    CHECK(require(num_in == 3 + 2 * L && num_out == 1 + 2 * L, "%s has %zu inputs and %zu outputs, but mars_config.json "
                  "says %zu layers (%zu inputs, %zu outputs); re-export the bundle", path, num_in, num_out, L, 3 + 2 * L, 1 + 2 * L));
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
    CHECK(g_ort->CreateSession(g->env, path, options, &g->session));
    g_ort->ReleaseSessionOptions(options);
    make_names(g);
    check_io(g, cfg, path);
    CHECK(g_ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &g->cpu));

    int W = cfg->window, L = cfg->num_layers;
    size_t present_bytes = (size_t)cfg->num_kv_heads * (size_t)W * (size_t)cfg->head_dim * (size_t)cfg->kv_elem_size;
    g->input_ids = MALLOC((size_t)W * sizeof(int64_t));
    g->position_ids = MALLOC((size_t)W * sizeof(int64_t));
    g->attention_mask = MALLOC((size_t)W * (size_t)(max_cache + W));
    g->logits = MALLOC((size_t)W * (size_t)cfg->vocab_size * sizeof(float));
    g->presents = MALLOC((size_t)(2 * L) * sizeof(void *));
    g->outputs = MALLOC((size_t)(1 + 2 * L) * sizeof(OrtValue *));
    g->inputs = MALLOC((size_t)(3 + 2 * L) * sizeof(OrtValue *));
    for (int k = 0; k < 2 * L; k++) g->presents[k] = MALLOC(present_bytes);
}

void step_graph_free(StepGraph *g) {
    for (int k = 0; k < 2 * g->num_layers; k++) free(g->presents[k]);
    for (int k = 3; k < 3 + 2 * g->num_layers; k++) free((char *)g->input_names[k]);
    for (int k = 1; k < 1 + 2 * g->num_layers; k++) free((char *)g->output_names[k]);
    free(g->inputs);
    free(g->outputs);
    free(g->presents);
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

/* inputs[2 ..]: the attention mask [1, 1, T, S + T] (query i sees the P cached keys among the S
 * past positions and new keys 0..i), written into `mask` (T * (S + T) bytes), and per layer the
 * past [1, H, S, D] in keys[i], values[i]. */
static void make_mask_and_past(StepGraph *g, const KVCache *cache, int S, void **keys, void **values,
                               OrtValue **inputs, uint8_t *mask, int T) {
    int P = cache->length, H = cache->num_kv_heads;
    for (int i = 0; i < T; i++)
        for (int k = 0; k < S + T; k++) mask[(size_t)i * (size_t)(S + T) + (size_t)k] = k < P || (k >= S && k - S <= i);
    size_t past_bytes = (size_t)H * (size_t)S * (size_t)cache->head_dim * cache->elem_size;
    int64_t mask_shape[4] = {1, 1, T, S + T}, past_shape[4] = {1, H, S, cache->head_dim};
    inputs[2] = make_tensor(g, mask, (size_t)T * (size_t)(S + T), mask_shape, 4, ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL);
    for (int i = 0; i < g->num_layers; i++) {
        inputs[3 + 2 * i] = make_tensor(g, keys[i], past_bytes, past_shape, 4, cache->type);
        inputs[4 + 2 * i] = make_tensor(g, values[i], past_bytes, past_shape, 4, cache->type);
    }
}

void run_window(StepGraph *g, KVCache *cache, const int64_t *tokens, int num_tokens, int width, int64_t fill_id) {
    int P = cache->length, L = g->num_layers, H = cache->num_kv_heads, D = cache->head_dim;
    CHECK(require(width >= 1 && width <= g->window && (width == g->window || g->is_window_dynamic) &&
                  num_tokens >= 1 && num_tokens <= width, "run_window: %d tokens in a window of %d (graph window %d, %s)",
                  num_tokens, width, g->window, g->is_window_dynamic ? "dynamic" : "fixed"));
    kv_cache_reserve(cache, P + width);  /* the graph also writes the new entries at their positions P.. of the past */
    for (int i = 0; i < width; i++) {
        g->input_ids[i] = i < num_tokens ? tokens[i] : fill_id;  /* [1, w] */
        g->position_ids[i] = P + i;                              /* [1, w] */
    }
    int64_t ids_shape[2] = {1, width}, logits_shape[3] = {1, width, g->vocab_size}, present_shape[4] = {1, H, width, D};
    size_t present_bytes = (size_t)H * (size_t)width * (size_t)D * cache->elem_size;
    OrtValue **inputs = g->inputs, **outputs = g->outputs;  /* over this program's buffers: ORT writes into them */
    inputs[0] = make_tensor(g, g->input_ids, (size_t)width * sizeof(int64_t), ids_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    inputs[1] = make_tensor(g, g->position_ids, (size_t)width * sizeof(int64_t), ids_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    make_mask_and_past(g, cache, cache->size, cache->keys, cache->values, inputs, g->attention_mask, width);
    outputs[0] = make_tensor(g, g->logits, (size_t)width * (size_t)g->vocab_size * sizeof(float), logits_shape, 3,
                             ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    for (int k = 0; k < 2 * L; k++) outputs[1 + k] = make_tensor(g, g->presents[k], present_bytes, present_shape, 4, cache->type);
    CHECK(g_ort->Run(g->session, NULL, g->input_names, (const OrtValue *const *)inputs, (size_t)(3 + 2 * L),
                     g->output_names, (size_t)(1 + 2 * L), outputs));
    for (int k = 0; k < 3 + 2 * L; k++) g_ort->ReleaseValue(inputs[k]);
    for (int k = 0; k < 1 + 2 * L; k++) g_ort->ReleaseValue(outputs[k]);
    kv_cache_commit(cache, g->presents, width, num_tokens);
}

/* The P committed entries of every layer, copied into new [1, H, P, D] blocks: [2L] keys then values. */
static void **committed_copy(const KVCache *cache) {
    int L = cache->num_layers, H = cache->num_kv_heads, P = cache->length;
    size_t row_bytes = (size_t)cache->head_dim * cache->elem_size;
    void **blocks = MALLOC((size_t)(2 * L) * sizeof(void *));
    for (int i = 0; i < 2 * L; i++) {
        const char *src = i < L ? cache->keys[i] : cache->values[i - L];
        blocks[i] = MALLOC((size_t)H * (size_t)P * row_bytes);
        for (int h = 0; h < H; h++)
            memcpy((char *)blocks[i] + (size_t)h * (size_t)P * row_bytes, src + (size_t)h * (size_t)cache->size * row_bytes,
                   (size_t)P * row_bytes);
    }
    return blocks;
}

void run_prefill(StepGraph *g, KVCache *cache, const int64_t *tokens, int T) {
    int P = cache->length, L = g->num_layers;
    CHECK(require(g->is_window_dynamic && T >= 1, "run_prefill: %d tokens through a graph whose window is %s", T,
                  g->is_window_dynamic ? "dynamic" : "fixed (prefill W tokens at a time with run_window)"));
    int64_t *ids = MALLOC((size_t)T * sizeof(int64_t)), *positions = MALLOC((size_t)T * sizeof(int64_t));
    uint8_t *mask = MALLOC((size_t)T * (size_t)(P + T));
    for (int i = 0; i < T; i++) {
        ids[i] = tokens[i];   /* [1, T] */
        positions[i] = P + i; /* [1, T] */
    }
    int64_t ids_shape[2] = {1, T}, no_logits = 0;
    OrtValue **inputs = MALLOC((size_t)(4 + 2 * L) * sizeof(OrtValue *));
    inputs[0] = make_tensor(g, ids, (size_t)T * sizeof(int64_t), ids_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    inputs[1] = make_tensor(g, positions, (size_t)T * sizeof(int64_t), ids_shape, 2, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    void **past = committed_copy(cache);  /* [2L]: P + T keys per query, not S + T */
    make_mask_and_past(g, cache, P, past, past + L, inputs, mask, T);
    inputs[3 + 2 * L] = make_tensor(g, &no_logits, sizeof no_logits, NULL, 0, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    size_t num_inputs = (size_t)(3 + 2 * L + g->takes_num_logits);
    OrtValue **outputs = MALLOC((size_t)(1 + 2 * L) * sizeof(OrtValue *));  /* ORT allocates: [1, T or 0, V], [1, H, T, D] */
    memset(outputs, 0, (size_t)(1 + 2 * L) * sizeof(OrtValue *));
    CHECK(g_ort->Run(g->session, NULL, g->input_names, (const OrtValue *const *)inputs, num_inputs,
                     g->output_names, (size_t)(1 + 2 * L), outputs));
    void **presents = MALLOC((size_t)(2 * L) * sizeof(void *));
    for (int k = 0; k < 2 * L; k++) CHECK(g_ort->GetTensorMutableData(outputs[1 + k], &presents[k]));
    kv_cache_commit(cache, presents, T, T);
    for (int k = 0; k < 4 + 2 * L; k++) g_ort->ReleaseValue(inputs[k]);
    for (int k = 0; k < 1 + 2 * L; k++) g_ort->ReleaseValue(outputs[k]);
    for (int k = 0; k < 2 * L; k++) free(past[k]);
    free(past);
    free(presents);
    free(outputs);
    free(inputs);
    free(mask);
    free(positions);
    free(ids);
}
