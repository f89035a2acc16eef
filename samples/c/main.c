/* mars_c: prefill + the MARS acceptance loop (arXiv 2604.07023, §3) on the ONNX Runtime C API.
 *
 *   mars_c BUNDLE_DIR [--ids FILE|-] [--tau T] [--block-size N] [--max-new-tokens N] [--threads N]
 *          [--adaptive-masks]
 *
 * Reads whitespace-separated prompt token ids (FILE, or stdin for "-", the default),
 * prints the generated ids on stdout as one line, and one JSON object with the counts on
 * stderr. Same semantics, step by step, as runtime/decode/decoder.py (Decoder.generate):
 *   - prefill: prompt[:-1] through the step graph, PREFILL_CHUNK tokens per forward where its
 *     window axis is dynamic (without the output head where it takes num_logits), else W at a
 *     time padded with the pad id; the last prompt token is the first decode step's pending token;
 *   - decode step: the r pending real tokens, then w - r mask tokens, w = min(r + B - 1, W) at
 *     tau < 1 and r at tau >= 1 (no mask can be accepted) where the window axis is dynamic,
 *     else W; the logits at rows r-1 .. w-1 are the T = w - r + 1 predictions; the mask token's logit is set to
 *     the float32 minimum (it is never generated); accept (accept() below); only the KV
 *     of the r real tokens is committed; the accepted tokens are the next pending ones;
 *   - adaptive masks (--adaptive-masks, as DecodeParams.adaptive_masks): a step feeds its B - 1 masks only
 *     while the backoff (mask_backoff.c) lets it, else w = r; after each step the backoff records whether
 *     masks were fed (w > r) and whether one gained a token (more than the AR token accepted).
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mars.h"

#define MAX_THREADS 256
#define PREFILL_CHUNK 256  /* prompt tokens per prefill forward, as runtime.decode.engine.EngineConfig.prefill_chunk */
#define MAX_IDS_BYTES (64 << 20)

static const char USAGE[] =
    "usage: mars_c BUNDLE_DIR [--ids FILE|-] [--tau T] [--block-size N] [--max-new-tokens N] [--threads N]\n"
    "              [--adaptive-masks]\n"
    "  --ids FILE         whitespace-separated prompt token ids; '-' (default) reads stdin\n"
    "  --tau T            confidence threshold >= 0 (probability of the argmax); >= 1 is greedy AR (default 1.0)\n"
    "  --block-size N     most tokens accepted per step, 1..B (default: the bundle's B)\n"
    "  --max-new-tokens N most tokens to generate, >= 1 (default 128)\n"
    "  --threads N        onnxruntime intra-op threads, 0..256; 0 lets onnxruntime choose (default 0)\n"
    "  --adaptive-masks   feed mask tokens only while they gain tokens: after a step whose masks gained none,\n"
    "                     run 1, 2, 4, 8, then 16 steps without masks between probes (default off)\n"
    "Prints the generated ids on stdout (one line) and the counts as one JSON object on stderr.\n";

typedef struct {
    const char *bundle_dir;      /* directory with mars_config.json and the ONNX file */
    const char *ids_path;        /* prompt ids file; "-" = stdin */
    double tau;                  /* >= 0; >= 1 means one token per step */
    int block_size;              /* 0 = the bundle's B */
    int max_new_tokens;          /* >= 1 */
    int num_threads;             /* 0..MAX_THREADS */
    int adaptive_masks;          /* 1: feed masks only while they pay (mask_backoff.c) */
} Args;

typedef struct {
    int64_t *token_ids;          /* [max_new_tokens] generated ids, first num_tokens used */
    int num_tokens;
    int num_forwards;            /* decode forwards */
    int num_masked_forwards;     /* decode forwards that fed mask tokens after the real ones (w > r) */
    int num_prefill_forwards;
    double seconds;              /* whole generation, prefill included */
    double prefill_seconds;
    int is_stopped;              /* an end token was accepted (finish_reason "stop", else "length") */
} Generation;

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---- arguments and prompt ids ---------------------------------------------------- */

static long parse_long(const char *option, const char *text, long min, long max) {
    char *end;
    long value = strtol(text, &end, 10);
    CHECK(require(end != text && *end == '\0' && value >= min && value <= max,
                  "%s must be an integer in %ld..%ld, got '%s'", option, min, max, text));
    return value;
}

static void parse_args(Args *args, int argc, char **argv) {
    *args = (Args){NULL, "-", 1.0, 0, 128, 0, 0};
    for (int k = 1; k < argc; k++) {
        const char *a = argv[k];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) { fputs(USAGE, stdout); exit(EXIT_SUCCESS); }
        if (strcmp(a, "--adaptive-masks") == 0) { args->adaptive_masks = 1; continue; }  /* a flag: no value */
        if (a[0] != '-' || a[1] == '\0') {
            CHECK(require(args->bundle_dir == NULL, "unexpected argument '%s'\n%s", a, USAGE));
            args->bundle_dir = a;
            continue;
        }
        CHECK(require(k + 1 < argc, "option %s needs a value\n%s", a, USAGE));
        const char *value = argv[++k];
        if (strcmp(a, "--ids") == 0) args->ids_path = value;
        else if (strcmp(a, "--block-size") == 0) args->block_size = (int)parse_long(a, value, 1, 4096);
        else if (strcmp(a, "--max-new-tokens") == 0) args->max_new_tokens = (int)parse_long(a, value, 1, 1 << 24);
        else if (strcmp(a, "--threads") == 0) args->num_threads = (int)parse_long(a, value, 0, MAX_THREADS);
        else if (strcmp(a, "--tau") == 0) {
            char *end;
            args->tau = strtod(value, &end);
            CHECK(require(end != value && *end == '\0' && isfinite(args->tau) && args->tau >= 0,
                          "--tau must be a finite number >= 0, got '%s'; tau >= 1 means one token per step", value));
        } else CHECK(errorf("unknown option %s\n%s", a, USAGE));
    }
    CHECK(require(args->bundle_dir != NULL, "no bundle directory given\n%s", USAGE));
}

/* Reads whitespace-separated ids in 0..V-1; returns [*num_ids] int64 (caller frees). */
static int64_t *read_prompt_ids(const char *path, int vocab_size, int *num_ids) {
    int is_stdin = strcmp(path, "-") == 0;
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    CHECK(require(f != NULL, "cannot open the prompt ids file %s", path));
    size_t cap = 4096, len = 0;
    char *text = MALLOC(cap);
    for (size_t n; (n = fread(text + len, 1, cap - len - 1, f)) > 0;) {
        len += n;
        CHECK(require(len <= MAX_IDS_BYTES, "%s: more than %d bytes of prompt ids", path, MAX_IDS_BYTES));
        if (cap - len - 1 == 0) { char *bigger = MALLOC(2 * cap); memcpy(bigger, text, len); free(text); text = bigger; cap *= 2; }
    }
    text[len] = '\0';
    int read_error = ferror(f);
    if (!is_stdin) fclose(f);
    CHECK(require(!read_error, "cannot read the prompt ids from %s", path));
    CHECK(require(strlen(text) == len, "%s: the prompt ids contain a NUL byte; give text ids", path));
    int64_t *ids = MALLOC((len / 2 + 1) * sizeof(int64_t));  /* each id takes >= 2 bytes with its separator */
    int count = 0;
    for (char *p = strtok(text, " \t\r\n"); p != NULL; p = strtok(NULL, " \t\r\n")) {
        char *end;
        long long id = strtoll(p, &end, 10);
        CHECK(require(end != p && *end == '\0', "prompt ids: '%.40s' (item %d) is not an integer token id", p, count));
        CHECK(require(id >= 0 && id < vocab_size, "prompt ids: id %lld (item %d) is outside the vocabulary 0..%d",
                      id, count, vocab_size - 1));
        ids[count++] = id;
    }
    free(text);
    *num_ids = count;
    return ids;
}

/* ---- the acceptance rule --------------------------------------------------------- */

/* Argmax of one row [V] (first index on ties, as numpy); *prob = its softmax probability. */
static int64_t argmax(const float *row, int V, float *prob) {
    int best = 0;
    for (int v = 1; v < V; v++) if (row[v] > row[best]) best = v;
    if (prob != NULL) {
        double sum = 0.0;  /* softmax max = exp(0) / sum_v exp(x_v - max) */
        for (int v = 0; v < V; v++) sum += exp((double)row[v] - (double)row[best]);
        *prob = (float)(1.0 / sum);
    }
    return best;
}

static int is_stop_id(const MarsConfig *cfg, int64_t id) {
    for (int k = 0; k < cfg->num_eos; k++) if (cfg->eos_token_ids[k] == id) return 1;
    return 0;
}

/* Accepts from the [T, V] predictions rows; writes them to accepted[], returns how many.
 * MARS §3: prediction 0 (the AR token) is always accepted; prediction j >= 1 (the j-th
 * mask) while no end token was accepted, count < max_accept and p(argmax) > tau strictly.
 * (tau is compared as float32, as numpy compares a float32 score with a Python float.) */
static int accept(float *rows, int T, const MarsConfig *cfg, double tau, int max_accept, int64_t *accepted) {
    int V = cfg->vocab_size, limit = T < max_accept ? T : max_accept, count = 1;
    for (int t = 0; t < T; t++) rows[(size_t)t * (size_t)V + (size_t)cfg->mask_token_id] = -FLT_MAX;
    accepted[0] = argmax(rows, V, NULL);
    while (count < limit && !is_stop_id(cfg, accepted[count - 1]) && tau < 1.0) {
        float prob;
        int64_t id = argmax(rows + (size_t)count * (size_t)V, V, &prob);
        if (!(prob > (float)tau)) break;
        accepted[count++] = id;
    }
    return count;
}

/* ---- prefill + decode loop --------------------------------------------------------- */

/* The decode step's window w, as the Python scheduler's (Scheduler._row_width, runtime/decode/scheduler.py):
 * the r pending real tokens, then B - 1 masks where tau < 1 can accept them and, with adaptive masks, the
 * backoff lets the row feed them; at most W; W on a graph whose window axis is fixed. */
static int step_width(const StepGraph *graph, const Args *args, const MaskBackoff *backoff, int num_pending,
                      int block_size) {
    int feeds_masks = args->tau < 1.0 && (!args->adaptive_masks || backoff->skip == 0);
    int width = num_pending + (feeds_masks ? block_size - 1 : 0);
    return !graph->is_window_dynamic || width > graph->window ? graph->window : width;
}

static void generate(StepGraph *graph, KVCache *cache, const MarsConfig *cfg, const Args *args,
                     const int64_t *prompt, int num_prompt, Generation *out) {
    int W = cfg->window, block_size = args->block_size ? args->block_size : cfg->block_size;
    int64_t *pending = MALLOC((size_t)W * sizeof(int64_t));  /* [r] real tokens whose KV is not cached yet */
    double start = now_seconds();
    int chunk_size = graph->is_window_dynamic ? PREFILL_CHUNK : W;
    for (int chunk = 0; chunk < num_prompt - 1; chunk += chunk_size) {
        int n = num_prompt - 1 - chunk < chunk_size ? num_prompt - 1 - chunk : chunk_size;
        if (graph->is_window_dynamic)
            run_prefill(graph, cache, prompt + chunk, n);
        else
            run_window(graph, cache, prompt + chunk, n, W, cfg->pad_token_id);
        out->num_prefill_forwards++;
    }
    out->prefill_seconds = now_seconds() - start;
    int num_pending = 1;
    pending[0] = prompt[num_prompt - 1];
    MaskBackoff backoff = {0, 0};
    while (!out->is_stopped && out->num_tokens < args->max_new_tokens) {
        int width = step_width(graph, args, &backoff, num_pending, block_size), fed_masks = width > num_pending;
        run_window(graph, cache, pending, num_pending, width, cfg->mask_token_id);
        out->num_masked_forwards += fed_masks;
        int budget = args->max_new_tokens - out->num_tokens;
        float *rows = graph->logits + (size_t)(num_pending - 1) * (size_t)cfg->vocab_size;  /* [T, V] */
        num_pending = accept(rows, width - num_pending + 1, cfg, args->tau, budget < block_size ? budget : block_size, pending);
        /* without drafts every token after the first (the AR token) is a mask's (mask_backoff.tokens_from_masks) */
        if (args->adaptive_masks) mask_backoff_record(&backoff, fed_masks, num_pending > 1);
        memcpy(out->token_ids + out->num_tokens, pending, (size_t)num_pending * sizeof(int64_t));
        out->num_tokens += num_pending;
        out->is_stopped = is_stop_id(cfg, pending[num_pending - 1]);
        out->num_forwards++;
    }
    out->seconds = now_seconds() - start;
    free(pending);
}

static void print_result(const Generation *g, size_t huge_page_bytes) {
    for (int k = 0; k < g->num_tokens; k++) printf(k ? " %lld" : "%lld", (long long)g->token_ids[k]);
    printf("\n");
    double decode_seconds = g->seconds - g->prefill_seconds;
    fprintf(stderr, "{\"num_tokens\": %d, \"num_forwards\": %d, \"num_prefill_forwards\": %d, \"tpf\": %.6f, "
            "\"seconds\": %.6f, \"prefill_seconds\": %.6f, \"decode_tokens_per_second\": %.3f, "
            "\"finish_reason\": \"%s\", \"num_masked_forwards\": %d, \"huge_page_bytes\": %zu}\n", g->num_tokens,
            g->num_forwards, g->num_prefill_forwards, (double)g->num_tokens / (g->num_forwards > 0 ? g->num_forwards : 1),
            g->seconds, g->prefill_seconds, decode_seconds > 0 ? g->num_tokens / decode_seconds : 0.0,
            g->is_stopped ? "stop" : "length", g->num_masked_forwards, huge_page_bytes);
}

int main(int argc, char **argv) {
    g_ort = OrtGetApiBase()->GetApi(ORT_API_VERSION);
    if (g_ort == NULL) {  /* the one error that cannot go through CHECK: there is no API to make a status */
        fprintf(stderr, "mars_c: error at %s:%d: onnxruntime %s does not offer C API version %d (the headers'); "
                "use a library at least as new as the headers\n", __FILE__, __LINE__,
                OrtGetApiBase()->GetVersionString(), ORT_API_VERSION);
        return EXIT_FAILURE;
    }
    Args args;
    parse_args(&args, argc, argv);
    MarsConfig cfg;
    load_config(&cfg, args.bundle_dir);
    CHECK(require(args.block_size <= cfg.block_size, "--block-size %d exceeds the bundle's block size %d",
                  args.block_size, cfg.block_size));
    int num_prompt;
    int64_t *prompt = read_prompt_ids(args.ids_path, cfg.vocab_size, &num_prompt);
    CHECK(require(num_prompt > 0, "the prompt is empty: give at least one token id"));
    long needed = (long)num_prompt + args.max_new_tokens + cfg.window;  /* the cache capacity S, as runtime/decode/decoder.py */
    CHECK(require(needed <= cfg.max_context, "prompt (%d tokens) + max_new_tokens (%d) + window (%d) = %ld exceeds "
                  "the model's max context %d; shorten the prompt or lower --max-new-tokens", num_prompt,
                  args.max_new_tokens, cfg.window, needed, cfg.max_context));

    StepGraph graph;
    KVCache cache;
    step_graph_init(&graph, &cfg, args.bundle_dir, args.num_threads, (int)needed);
    CHECK(require(!args.adaptive_masks || graph.is_window_dynamic, "--adaptive-masks needs a step graph with a "
                  "dynamic window axis (exports since 2026-11-30), where a step without masks is narrower; every "
                  "step of this bundle's graph is W = %d wide: re-export the bundle, or drop --adaptive-masks",
                  cfg.window));
    kv_cache_init(&cache, &cfg, (int)needed);
    Generation result = {0};
    result.token_ids = MALLOC((size_t)args.max_new_tokens * sizeof(int64_t));
    generate(&graph, &cache, &cfg, &args, prompt, num_prompt, &result);
    print_result(&result, graph.huge_page_bytes);

    free(result.token_ids);
    kv_cache_free(&cache);
    step_graph_free(&graph);
    free(prompt);
    return EXIT_SUCCESS;
}
