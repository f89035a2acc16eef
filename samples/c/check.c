/* The one error path: everything that can fail becomes an OrtStatus* and goes through
 * CHECK (mars.h), which prints file, line and the message, then exits. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "mars.h"

const OrtApi *g_ort = NULL;

void check_status(OrtStatus *status, const char *file, int line) {
    if (status == NULL) return;
    fprintf(stderr, "mars_c: error at %s:%d: %s\n", file, line, g_ort->GetErrorMessage(status));
    g_ort->ReleaseStatus(status);
    exit(EXIT_FAILURE);
}

static OrtStatus *verrorf(const char *fmt, va_list args) {
    char message[1024];
    vsnprintf(message, sizeof message, fmt, args);
    return g_ort->CreateStatus(ORT_INVALID_ARGUMENT, message);
}

OrtStatus *errorf(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    OrtStatus *status = verrorf(fmt, args);
    va_end(args);
    return status;
}

OrtStatus *require(int ok, const char *fmt, ...) {
    if (ok) return NULL;
    va_list args;
    va_start(args, fmt);
    OrtStatus *status = verrorf(fmt, args);
    va_end(args);
    return status;
}

void *check_malloc(size_t num_bytes, const char *file, int line) {
    void *p = malloc(num_bytes > 0 ? num_bytes : 1);
    if (p == NULL) check_status(errorf("out of memory allocating %zu bytes", num_bytes), file, line);
    return p;
}
