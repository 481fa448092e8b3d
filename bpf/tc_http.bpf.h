/* tc_http.bpf.h: the HTTP/1.x request scan of tc_classify.bpf.c over the
 * per-CPU scratch: method, header lines, header values, Content-Type modality,
 * WebSocket upgrade, path hash. No maps: pure reads of s->buf. */
#ifndef TC_HTTP_BPF_H
#define TC_HTTP_BPF_H

#include "tc_classify.h"

/* Method of a request line starting with `w` (first 8 bytes); 0 if none. */
static __always_inline __u8 http_method(__u64 w, __u32 *len)
{
    __u64 w4 = w & 0xffffffffULL, w5 = w & 0xffffffffffULL, w6 = w & 0xffffffffffffULL;
    if (w4 == C4('G', 'E', 'T', ' ')) { *len = 4; return METHOD_GET; }
    if (w5 == (C4('P', 'O', 'S', 'T') | ((__u64)' ' << 32))) { *len = 5; return METHOD_POST; }
    if (w4 == C4('P', 'U', 'T', ' ')) { *len = 4; return METHOD_PUT; }
    if (w5 == (C4('H', 'E', 'A', 'D') | ((__u64)' ' << 32))) { *len = 5; return METHOD_HEAD; }
    if ((w & 0xffffffffffffffULL) == (C4('D', 'E', 'L', 'E') | (C4('T', 'E', ' ', 0) << 32))) {
        *len = 7; return METHOD_DELETE;
    }
    if (w == C8('O', 'P', 'T', 'I', 'O', 'N', 'S', ' ')) { *len = 8; return METHOD_OPTIONS; }
    if (w6 == (C4('P', 'A', 'T', 'C') | (C2('H', ' ') << 32))) { *len = 6; return METHOD_PATCH; }
    if (w == C8('C', 'O', 'N', 'N', 'E', 'C', 'T', ' ')) { *len = 8; return METHOD_CONNECT; }
    if (w6 == (C4('T', 'R', 'A', 'C') | (C2('E', ' ') << 32))) { *len = 6; return METHOD_TRACE; }
    return 0;
}

/* Record where a header line starts, first occurrence only. */
static __always_inline void mark_header(__u32 *slot, __u32 at)
{
    if (*(volatile __u32 *)slot == 0)
        *(volatile __u32 *)slot = at;
}

static __always_inline __u64 scan_len(const struct tc_scratch *s)
{
    __u64 n = *(volatile const __u32 *)&s->scan_len;
    return n > SPANLET_TC_SCAN_BYTES ? 0 : n;
}

/* Find the header lines we read, in two passes so that the verifier can walk
 * them: the first only notes where lines start (one branch per byte), the
 * second looks at those lines. Anything a pass learns goes through volatile
 * memory, never a register, so that the verifier's state at each loop head is
 * the same whatever was found and each loop is walked once per offset. */
static __always_inline void scan_headers(struct tc_scratch *s)
{
    __u64 n = scan_len(s);
    *(volatile __u32 *)&s->lines = 0;
    for (__u32 i = 0; i < SPANLET_TC_SCAN_BYTES; i++) {
        if (i + 1 >= n)
            break;
        if (s->buf[i] != '\n')
            continue;
        if (s->buf[i + 1] == '\r' || s->buf[i + 1] == '\n')
            break; /* end of the header block (CRLF CRLF, or bare LF LF) */
        __u32 k = *(volatile __u32 *)&s->lines;
        if (k >= TC_MAX_LINES)
            break;
        s->line_at[k] = i + 1;
        *(volatile __u32 *)&s->lines = k + 1;
    }

    *(volatile __u32 *)&s->traceparent_at = 0;
    *(volatile __u32 *)&s->traceparent_dup = 0;
    *(volatile __u32 *)&s->content_type_at = 0;
    *(volatile __u32 *)&s->upgrade_at = 0;
    for (__u32 j = 0; j < TC_MAX_LINES; j++) {
        if (j >= *(volatile __u32 *)&s->lines)
            break;
        __u64 at = *(volatile __u32 *)&s->line_at[j];
        if (at > SPANLET_TC_SCAN_BYTES)
            break;
        /* Past the packet's bytes the buffer holds an older packet's: a name
         * must end inside this one (the longest we look for is 13 bytes). */
        if (at + 13 > *(volatile __u32 *)&s->scan_len)
            break;
        __u8 c = s->buf[at] | 0x20;
        __u64 w = ld64(&s->buf[at]) | LOWER8;
        if (c == 't') {
            if (w == C8('t', 'r', 'a', 'c', 'e', 'p', 'a', 'r') &&
                (ld32(&s->buf[at + 8]) | LOWER4) == C4('e', 'n', 't', ':')) {
                if (*(volatile __u32 *)&s->traceparent_at)
                    *(volatile __u32 *)&s->traceparent_dup = 1;
                mark_header(&s->traceparent_at, at + 1);
            }
        } else if (c == 'c') {
            if (w == C8('c', 'o', 'n', 't', 'e', 'n', 't', '-') &&
                (ld32(&s->buf[at + 8]) | LOWER4) == C4('t', 'y', 'p', 'e') &&
                s->buf[at + 12] == ':')
                mark_header(&s->content_type_at, at + 1);
        } else if (c == 'u') {
            if (w == C8('u', 'p', 'g', 'r', 'a', 'd', 'e', ':'))
                mark_header(&s->upgrade_at, at + 1);
        }
    }
}


/* Offset of a header's value: `at` (name offset + 1, from the scan) plus the
 * name, then optional whitespace. Returns 0 when absent. */
static __always_inline __u64 header_value(const struct tc_scratch *s, __u64 at, __u64 name_len)
{
    if (at == 0)
        return 0;
    __u64 v = at - 1 + name_len;
    BOUND_VAR(v);
    if (v > SPANLET_TC_SCAN_BYTES + 16)
        return 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        __u8 c = s->buf[v];
        if (c != ' ' && c != '\t')
            break;
        v++;
    }
    return v;
}

static __always_inline __u8 content_modality(const struct tc_scratch *s, __u64 v, __u64 n)
{
    BOUND_VAR(v);
    if (v == 0 || v > VALUE_MAX || v + 5 > n)
        return SPANLET_MOD_OTHER;
    __u64 w = ld64(&s->buf[v]) | LOWER8;
    __u64 w6 = w & 0xffffffffffffULL;
    if (v + 6 <= n) {
        if (w6 == (C4('i', 'm', 'a', 'g') | (C2('e', '/') << 32)))
            return SPANLET_MOD_IMAGE;
        if (w6 == (C4('a', 'u', 'd', 'i') | (C2('o', '/') << 32)))
            return SPANLET_MOD_AUDIO;
        if (w6 == (C4('v', 'i', 'd', 'e') | (C2('o', '/') << 32)))
            return SPANLET_MOD_VIDEO;
    }
    if ((w & 0xffffffffffULL) == (C4('t', 'e', 'x', 't') | ((__u64)'/' << 32)))
        return SPANLET_MOD_TEXT;
    if (v + 16 <= n && w == C8('a', 'p', 'p', 'l', 'i', 'c', 'a', 't') &&
        (ld64(&s->buf[v + 8]) | LOWER8) == C8('i', 'o', 'n', '/', 'j', 's', 'o', 'n'))
        return SPANLET_MOD_TEXT;
    return SPANLET_MOD_OTHER;
}

static __always_inline int is_websocket(const struct tc_scratch *s, __u64 v, __u64 n)
{
    BOUND_VAR(v);
    if (v == 0 || v > VALUE_MAX || v + 9 > n)
        return 0;
    return (ld64(&s->buf[v]) | LOWER8) == C8('w', 'e', 'b', 's', 'o', 'c', 'k', 'e') &&
           (s->buf[v + 8] | 0x20) == 't';
}

/* FNV-1a (32 bit) of the request path, query string excluded. */
static __always_inline __u32 path_hash(const struct tc_scratch *s, __u64 start, __u64 n)
{
    __u32 h = 2166136261U;
    BOUND_VAR(start);
    if (start > 8)
        return h;
    for (__u64 i = 0; i < TC_PATH_MAX; i++) {
        __u64 at = start + i;
        if (at >= n)
            break;
        __u8 c = s->buf[at];
        if (c == ' ' || c == '?' || c == '\r' || c == '\n')
            break;
        h ^= c;
        h *= 16777619U;
    }
    return h;
}

#endif /* TC_HTTP_BPF_H */
