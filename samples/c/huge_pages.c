/* The session's weights on transparent huge pages, as runtime/backends/huge_pages.py does it.
 *
 * onnxruntime keeps its (prepacked) weights in anonymous memory it allocates at load. Where the
 * kernel's THP mode is "madvise" that memory lies on 4 KiB pages; the step then reads the
 * weights a few percent slower (BENCHMARKS.md, "Weights on huge pages"). So: note the writable
 * private anonymous mappings before CreateSession, and afterwards ask the kernel to move what is
 * new, in whole 2 MiB pages, onto huge pages at once (madvise MADV_HUGEPAGE, then MADV_COLLAPSE,
 * Linux 6.1+). Best-effort: a refusal (THP "never", an older kernel, no free huge page, a thread's
 * stack) leaves that memory where it is; nothing computed changes. Off Linux it does nothing. */
#include "mars.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef __linux__
#include <sys/mman.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  /* <asm-generic/mman-common.h>, Linux 6.1 */
#endif
#endif

#define HUGE_PAGE ((uintptr_t)2 << 20)

void anon_ranges_read(AnonRanges *r) {
    r->count = 0;
    r->ranges = NULL;
#ifdef __linux__
    FILE *maps = fopen("/proc/self/maps", "r");
    if (maps == NULL) return;
    size_t capacity = 0;
    char line[4096];
    while (fgets(line, sizeof line, maps) != NULL) {
        uintptr_t start, end;
        char perms[8] = "", path[4096] = "";
        if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %4095s", &start, &end, perms, path) < 3) continue;
        if (perms[0] != 'r' || perms[1] != 'w' || perms[3] != 'p') continue;  /* writable, private */
        if (path[0] != '\0' && strcmp(path, "[heap]") != 0) continue;        /* anonymous, or the heap */
        if (r->count == capacity) {
            capacity = capacity ? 2 * capacity : 64;
            r->ranges = realloc(r->ranges, capacity * sizeof *r->ranges);
            CHECK(require(r->ranges != NULL, "out of memory reading /proc/self/maps"));
        }
        r->ranges[r->count][0] = start;
        r->ranges[r->count][1] = end;
        r->count++;
    }
    fclose(maps);
#endif
}

#ifdef __linux__
/* Collapse [lo, hi) less every range of `before` (recursing on the parts either side of an
 * overlap), each part rounded inward to whole huge pages; returns the bytes moved. */
static size_t collapse_part(uintptr_t lo, uintptr_t hi, const AnonRanges *before, size_t from) {
    for (size_t i = from; i < before->count; i++) {
        uintptr_t old_lo = before->ranges[i][0], old_hi = before->ranges[i][1];
        if (old_lo < hi && lo < old_hi) {
            size_t moved = 0;
            if (lo < old_lo) moved += collapse_part(lo, old_lo, before, i + 1);
            if (old_hi < hi) moved += collapse_part(old_hi, hi, before, i + 1);
            return moved;
        }
    }
    uintptr_t a = (lo + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE, b = hi / HUGE_PAGE * HUGE_PAGE;
    if (a >= b) return 0;
    madvise((void *)a, b - a, MADV_HUGEPAGE);  /* later faults in the range get huge pages too */
    return madvise((void *)a, b - a, MADV_COLLAPSE) == 0 ? b - a : 0;
}
#endif

size_t collapse_new_ranges(const AnonRanges *before) {
    size_t moved = 0;
#ifdef __linux__
    FILE *mode = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    char text[128] = "";
    if (mode == NULL) return 0;
    if (fgets(text, sizeof text, mode) == NULL) text[0] = '\0';
    fclose(mode);
    if (text[0] == '\0' || strstr(text, "[never]") != NULL) return 0;
    AnonRanges after;
    anon_ranges_read(&after);
    for (size_t i = 0; i < after.count; i++) moved += collapse_part(after.ranges[i][0], after.ranges[i][1], before, 0);
    free(after.ranges);
#else
    (void)before;
#endif
    return moved;
}
