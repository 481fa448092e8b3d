/* tc_traceparent.bpf.h: the W3C traceparent header of a scanned request.
 * Inlined into tc_classify.bpf.c after its maps: count_rejected() is there. */
#ifndef TC_TRACEPARENT_BPF_H
#define TC_TRACEPARENT_BPF_H

#include "tc_http.bpf.h"

static __always_inline int hexval(__u8 c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* Results of parse_traceparent: valid, or a REJECT_TRACEPARENT_* reason. */
#define TP_VALID -1
/* Whitespace allowed after the value before its line ends (HTTP's OWS). */
#define TP_OWS_MAX 8

/* W3C traceparent "vv-<32 hex>-<16 hex>-ff" at s->buf[v]; lowercase hex only,
 * as the Recommendation requires; version ff, all-zero ids and, for version
 * 00, anything but whitespace after the 55 characters make it invalid (a
 * higher version may append "-..."). The line must end (CR or LF) after the
 * value within what was scanned. TP_VALID and the ids, or why not. */
static __always_inline int parse_traceparent(const struct tc_scratch *s, __u64 v, __u64 n,
                                             struct spanlet_hdr *h, __u8 *flags)
{
    BOUND_VAR(v);
    if (v == 0 || v > VALUE_MAX || v + 56 > n)
        return REJECT_TRACEPARENT_TRUNCATED;
    const __u8 *t = &s->buf[v];
    int hi = hexval(t[0]), lo = hexval(t[1]);
    if (hi < 0 || lo < 0 || (hi == 15 && lo == 15))
        return REJECT_TRACEPARENT_INVALID;
    int version = hi * 16 + lo;
    if (t[2] != '-' || t[35] != '-' || t[52] != '-')
        return REJECT_TRACEPARENT_INVALID;
    if (!(version > 0 && t[55] == '-')) {
#pragma unroll
        for (int k = 0; k < TP_OWS_MAX; k++) {
            if (v + 55 + k >= n)
                return REJECT_TRACEPARENT_TRUNCATED;
            __u8 c = t[55 + k];
            if (c == '\r' || c == '\n')
                break;
            if ((c != ' ' && c != '\t') || k == TP_OWS_MAX - 1)
                return REJECT_TRACEPARENT_INVALID;
        }
    }
    __u8 tid[16];
    __u8 any = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        int a = hexval(t[3 + 2 * i]), b = hexval(t[4 + 2 * i]);
        if (a < 0 || b < 0)
            return REJECT_TRACEPARENT_INVALID;
        tid[i] = a * 16 + b;
        any |= tid[i];
    }
    if (!any)
        return REJECT_TRACEPARENT_INVALID;
    __u64 sid = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        int a = hexval(t[36 + i]);
        if (a < 0)
            return REJECT_TRACEPARENT_INVALID;
        sid = (sid << 4) | a;
    }
    if (!sid)
        return REJECT_TRACEPARENT_INVALID;
    int fa = hexval(t[53]), fb = hexval(t[54]);
    if (fa < 0 || fb < 0)
        return REJECT_TRACEPARENT_INVALID;
    __builtin_memcpy(h->trace_id, tid, 16);
    h->span_id = sid;
    *flags = fa * 16 + fb;
    return TP_VALID;
}

/* The request's traceparent into ev when there is exactly one and it is
 * valid; a header that is there but not used is counted, by reason. */
static __always_inline void request_traceparent(const struct tc_scratch *s, struct http_event *ev)
{
    if (!*(volatile const __u32 *)&s->traceparent_at)
        return;
    if (*(volatile const __u32 *)&s->traceparent_dup) {
        count_rejected(REJECT_TRACEPARENT_DUPLICATE);
        return;
    }
    __u64 v = header_value(s, s->traceparent_at, 12);
    int r = parse_traceparent(s, v, scan_len(s), &ev->hdr, &ev->trace_flags);
    if (r == TP_VALID)
        ev->hdr.flags |= SPANLET_HTTP_TRACEPARENT;
    else
        count_rejected(r);
}

#endif /* TC_TRACEPARENT_BPF_H */
