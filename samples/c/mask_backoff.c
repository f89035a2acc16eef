/* Adaptive masks (--adaptive-masks): a row feeds its mask tokens only while they pay.
 *
 * The rule of runtime/decode/mask_backoff.py (MaskBackoff.record), its one home in Python: after a
 * decode step whose masks gained no token the row runs FIRST_BACKOFF, then BACKOFF_GROWTH times as
 * many, ... up to MAX_BACKOFF steps without masks (1, 2, 4, 8, 16, 16, ...), each time followed by
 * one step with masks (a probe); a step whose masks gain a token puts it back to masks every step.
 * It reads only the row's own tokens, never a clock, so the ids are the Python runtime's. */
#include "mars.h"

/* The backoff constants, as runtime/decode/mask_backoff.py (MAX_BACKOFF there, and the 1 and 2 of
 * MaskBackoff.record): change them there and here together. */
#define FIRST_BACKOFF 1   /* steps without masks after a first missed probe */
#define BACKOFF_GROWTH 2  /* each further missed probe multiplies the run by this */
#define MAX_BACKOFF 16    /* the longest run of steps without masks between two probes */

void mask_backoff_record(MaskBackoff *backoff, int fed_masks, int gained) {
    if (gained) {
        backoff->skip = backoff->backoff = 0;
    } else if (fed_masks) {
        int next = BACKOFF_GROWTH * backoff->backoff;
        next = next < FIRST_BACKOFF ? FIRST_BACKOFF : next;
        backoff->backoff = next > MAX_BACKOFF ? MAX_BACKOFF : next;
        backoff->skip = backoff->backoff;
    } else if (backoff->skip > 0) {
        backoff->skip--;
    }
}
