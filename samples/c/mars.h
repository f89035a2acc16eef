/* MARS decoding on the ONNX Runtime C API: shared types, the check macro, prototypes.
 *
 * MARS: "Enabling Autoregressive Models Multi-Token Generation", arXiv 2604.07023.
 * Semantics: ../../../shared/DESIGN.md §3 (decoding) and §5 (export contract); the
 * Python reference this program must match is runtime/decode/decoder.py.
 *
 * Dimension letters (as in runtime/bundle.py): L layers, H KV heads, D head dim,
 * W window, V vocabulary, P committed (cached) positions, S cache capacity.
 */
#ifndef MARS_H
#define MARS_H

#include <stddef.h>
#include <stdint.h>

#include <onnxruntime_c_api.h>

/* The ORT function table, set once by init_ort() before anything else runs. A global
 * because every ORT call and every error goes through it (as in ONNX Runtime's samples). */
extern const OrtApi *g_ort;

/* ---- errors: ONE check macro ------------------------------------------------------
 * Every failure is an OrtStatus*: those returned by ORT calls, and our own made by
 * require()/errorf() (bad config, bad ids, bad arguments, out of memory). CHECK prints
 * "mars_c: error at FILE:LINE: MESSAGE" and exits with status 1. */
#ifdef __FILE_NAME__  /* gcc >= 12, clang: the file name without its directory */
#define SOURCE_FILE __FILE_NAME__
#else
#define SOURCE_FILE __FILE__
#endif
#define CHECK(status_expr) check_status((status_expr), SOURCE_FILE, __LINE__)
void check_status(OrtStatus *status, const char *file, int line);
/* A new ORT_INVALID_ARGUMENT status with a printf-formatted message. */
OrtStatus *errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* NULL when ok, else errorf(fmt, ...): CHECK(require(x > 0, "x must be > 0, got %d", x)). */
OrtStatus *require(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void *check_malloc(size_t num_bytes, const char *file, int line);
/* malloc whose failure goes through the same path, reported at the caller's line. */
#define MALLOC(num_bytes) check_malloc((num_bytes), SOURCE_FILE, __LINE__)

/* ---- weights on huge pages (huge_pages.c) -----------------------------------------
 * anon_ranges_read() notes the writable private anonymous mappings (and the heap) of this
 * process; collapse_new_ranges() moves what was mapped since onto transparent huge pages and
 * returns the bytes moved (0 where THP is off, off Linux, or the kernel refuses). */
typedef struct {
    uintptr_t (*ranges)[2];      /* [count] [start, end) byte addresses */
    size_t count;
} AnonRanges;
void anon_ranges_read(AnonRanges *r);
size_t collapse_new_ranges(const AnonRanges *before);

/* ---- adaptive masks (mask_backoff.c; runtime/decode/mask_backoff.py) -------------
 * One sequence's backoff state: the next step feeds masks while skip is 0. */
typedef struct {
    int skip;                    /* steps left to run without masks (0: the next step feeds masks) */
    int backoff;                 /* length of the last run without masks (0 after a step whose masks gained) */
} MaskBackoff;
/* Update after one decode step: fed_masks = the step fed at least one mask token, gained = a token
 * came from a mask (here, without drafts: the step accepted more than its one AR token). */
void mask_backoff_record(MaskBackoff *backoff, int fed_masks, int gained);

/* ---- the bundle config (mars_config.json), only the fields this program needs ---- */
#define MAX_EOS_IDS 16
#define MAX_NAME 256

typedef struct {
    int block_size;              /* B, most tokens accepted per decode step, 1..W */
    int window;                  /* W, fixed sequence length of the step graph */
    int mask_token_id;           /* MARS mask token, fed after the real tokens */
    int pad_token_id;            /* fed after the real tokens of a prefill chunk */
    int eos_token_ids[MAX_EOS_IDS]; /* [num_eos] ids that end generation */
    int num_eos;                 /* 1..MAX_EOS_IDS */
    int num_layers;              /* L */
    int num_kv_heads;            /* H */
    int head_dim;                /* D */
    int vocab_size;              /* V */
    int max_context;             /* largest position + 1 the model supports */
    int kv_elem_size;            /* bytes per KV element: 4 (float32) or 2 (float16) */
    ONNXTensorElementDataType kv_type; /* FLOAT or FLOAT16; logits are always FLOAT */
    char onnx_file[MAX_NAME];    /* step graph file name inside the bundle */
} MarsConfig;

/* Reads and validates BUNDLE_DIR/mars_config.json; any problem is a CHECK failure. */
void load_config(MarsConfig *cfg, const char *bundle_dir);

/* ---- the KV cache: per layer a contiguous [1, H, S, D] block --------------------
 * As runtime/decode/kv_cache.py: position p of head h at index p of row h, the first P
 * committed. A step is fed the whole [1, H, S, D] as its past and has it as its present
 * (the same buffer): the graph writes the KV of its w tokens at P .. P+w-1 in place and
 * its mask hides indices beyond each query's own. Committing the KV of the real tokens
 * (DESIGN.md §3) then only advances P; the entries of fill tokens stay beyond P, hidden,
 * until a later step overwrites them. S doubles (from 16, up to the capacity) when a step
 * needs more room (P + w). */
typedef struct {
    void **keys;                 /* [L] buffers of H * capacity * D elements, the first H * S * D as [1, H, S, D] */
    void **values;               /* [L] same as keys */
    int num_layers;              /* L */
    int num_kv_heads;            /* H */
    int head_dim;                /* D */
    size_t elem_size;            /* bytes per element: 4 or 2 */
    ONNXTensorElementDataType type; /* FLOAT or FLOAT16, as the config's kv_type */
    int length;                  /* P, committed positions */
    int size;                    /* S, positions per head in the layout the graph reads and writes */
    int capacity;                /* the most positions S may grow to */
} KVCache;

void kv_cache_init(KVCache *cache, const MarsConfig *cfg, int capacity);
void kv_cache_free(KVCache *cache);

/* ---- the step graph: session and its fixed-shape I/O buffers ------------------ */
typedef struct {
    OrtEnv *env;
    OrtSession *session;
    OrtMemoryInfo *cpu;          /* where all our tensors live */
    const char **input_names;    /* [3 + 2L + 1] graph order: input_ids, position_ids, attention_mask, past k/v;
                                    then num_logits, fed to prefill forwards of graphs that take it */
    const char **output_names;   /* [1 + 2L]: logits, present k/v (bound to the past k/v's buffers) */
    int num_layers;              /* L */
    int window;                  /* W */
    int vocab_size;              /* V */
    int is_window_dynamic;       /* 1: the window axis is symbolic (exports since 2026-11-30): T-token prefill */
    int takes_num_logits;        /* 1: num_logits can be fed (exports since 2026-12-02): prefill skips the head */
    size_t huge_page_bytes;      /* bytes of the session's memory moved onto huge pages at load (huge_pages.c) */
    int64_t *input_ids;          /* [1, w] int64, w <= W the step's window */
    int64_t *position_ids;       /* [1, w] int64 */
    uint8_t *attention_mask;     /* [1, 1, w, S] bool (1 byte), S up to the cache's capacity */
    float *logits;               /* [1, w, V] float32, output */
    OrtValue **inputs;           /* [3 + 2L + 1] made per run over the buffers above and the cache (+ num_logits) */
    OrtValue **outputs;          /* [1 + 2L] per run: logits, then the past k/v values of inputs[3 ..] themselves,
                                    so ORT writes the logits and the presents into our buffers, the cache in place */
} StepGraph;

void step_graph_init(StepGraph *graph, const MarsConfig *cfg, const char *bundle_dir, int num_threads,
                     int max_cache);
void step_graph_free(StepGraph *graph);
/* Feed tokens[0..num_tokens-1] (1..w real tokens) padded with fill_id to w at positions
 * P..P+w-1 over the cache's [1, H, S, D], S >= P + w, under a causal mask; the graph writes
 * their KV into the cache at P..P+w-1, and the num_tokens real tokens are committed (P
 * advances, nothing is copied). The window w is 1..W on graphs with is_window_dynamic, else
 * W. Afterwards graph->logits holds the [w, V] logits of this window. */
void run_window(StepGraph *graph, KVCache *cache, const int64_t *tokens, int num_tokens, int width, int64_t fill_id);
/* Feed tokens[0..num_tokens-1] (T >= 1 prompt tokens, graphs with is_window_dynamic only) in one
 * forward at positions P..P+T-1 over the cache's [1, H, S, D], S >= P + T (as the Python
 * runtime's prefill), under a causal mask; the graph writes their KV into the cache in place
 * and all T are committed; no logits are read (num_logits = 0 where the graph takes it: the
 * output head is skipped). */
void run_prefill(StepGraph *graph, KVCache *cache, const int64_t *tokens, int num_tokens);

#endif
