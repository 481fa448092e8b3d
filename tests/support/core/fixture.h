/* Types of fixture.bpf.c, read by the tests both from the object's BTF and
 * by gcc (offsetof), which must agree. */
#ifndef FIXTURE_H
#define FIXTURE_H

struct fixture_seen {
    __u64 switches_out;
    __u64 sum_exec_runtime;
    __u32 tgid;
    __u8 kind;
    __u8 tag[3];
    __u64 last;
};

struct fixture_calls {
    __u64 n;
    __u64 args_sum;
};

struct fixture_event {
    __u32 tgid;
    __u32 tid;
    __u64 a;
    __u16 small;
    __u8 bytes[5];
};

#endif
