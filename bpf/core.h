/* core.h: what every CO-RE program includes (built by scripts/build_bpf.py
 * with clang, loaded by libbpf: agent/probes/libbpf.py). The UAPI types and
 * libbpf's helpers, and the kernel's own structs declared here with only the
 * members the programs read: `preserve_access_index` makes each read a CO-RE
 * relocation, which libbpf resolves at load against the running kernel's BTF
 * (or the BTF file the agent is given), so no kernel's headers are needed and
 * a member that moved between kernels is still read where it is. Kernel
 * structs are read through these and BPF_CORE_READ only. */
#ifndef SPANLET_CORE_H
#define SPANLET_CORE_H

#include <stdbool.h>
#include <linux/types.h>
#include <linux/bpf.h>

/* bpf_tracing.h names pt_regs' members as the kernel does once this is set */
#define __VMLINUX_H__ 1

#pragma clang attribute push(__attribute__((preserve_access_index)), apply_to = record)

#if defined(__TARGET_ARCH_x86)
struct pt_regs {
    unsigned long r15, r14, r13, r12, bp, bx, r11, r10, r9, r8, ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss;
};
#elif defined(__TARGET_ARCH_arm64)
struct user_pt_regs {
    __u64 regs[31];
    __u64 sp;
    __u64 pc;
    __u64 pstate;
};
struct pt_regs {
    struct user_pt_regs user_regs;
};
#else
#error "core.h: build with -D__TARGET_ARCH_x86 or -D__TARGET_ARCH_arm64"
#endif

struct sched_entity {
    __u64 exec_start;
    __u64 sum_exec_runtime;
};

struct sched_info {
    unsigned long pcount;
    unsigned long long run_delay;
};

struct task_struct {
    int pid;
    int tgid;
    unsigned int __state;
    struct sched_entity se;
    struct sched_info sched_info;
};

/* tracepoint records (the fields of /sys/kernel/tracing/events/.../format) */
struct trace_entry {
    unsigned short type;
};

struct trace_event_raw_sys_enter {
    struct trace_entry ent;
    long id;
    unsigned long args[6];
};

struct trace_event_raw_inet_sock_set_state {
    struct trace_entry ent;
    const void *skaddr;
    int oldstate;
    int newstate;
    __u16 sport;
    __u16 dport;
    __u16 family;
    __u16 protocol;
    __u8 saddr[4];
    __u8 daddr[4];
    __u8 saddr_v6[16];
    __u8 daddr_v6[16];
};

#pragma clang attribute pop

#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

/* A type the agent reads that no map names (a ring buffer's record): kept in
 * the object's BTF, where the agent takes its layout from, by a setting that
 * points at it and is never read. */
#define SPANLET_BTF_TYPE(type, tag) type *const volatile spanlet_btf_##tag = 0

#endif /* SPANLET_CORE_H */
