/* enforce_fork.c: forks batches of child processes for the sandbox's enforce
 * test (tests/kernel/test_enforce_runs.py). Line protocol on stdin/stdout:
 *
 *   batch N            then N lines "CGROUP_PROCS PATH MODE PROT FLAGS LEN" (CGROUP_PROCS
 *                      "-": stay; PATH "-": anonymous; MODE r|rw; PROT and FLAGS as numbers)
 *                      -> "pids P1 ... PN" once every child is in its cgroup, paused
 *   go                 the children open PATH and mmap it; each that returns from mmap
 *                      keeps the mapping and waits
 *                      -> "held I1 ..." (indices of the children that returned from mmap)
 *                         once every child has either returned or died
 *   release            the holders exit 0
 *                      -> "status P S" per child (S: exit<code> or signal<n>), then "done"
 *   exit
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_BATCH 1024

struct spec {
    char cgroup[512];
    char path[512];
    char mode[4];
    int prot, flags;
    long len;
};

static struct spec specs[MAX_BATCH];
static pid_t pids[MAX_BATCH];
static int status_of[MAX_BATCH];
static int done_of[MAX_BATCH];

static void child(int i, int ready_w, int go_r, int held_w, int release_r)
{
    struct spec *s = &specs[i];
    char c = 0;
    if (strcmp(s->cgroup, "-")) {
        int fd = open(s->cgroup, O_WRONLY);
        if (fd < 0 || write(fd, "0", 1) != 1)
            _exit(10);
        close(fd);
    }
    if (write(ready_w, "r", 1) != 1 || read(go_r, &c, 1) != 1)
        _exit(11);
    int fd = -1, flags = s->flags;
    if (strcmp(s->path, "-")) {
        fd = open(s->path, strcmp(s->mode, "rw") ? O_RDONLY : O_RDWR);
        if (fd < 0)
            _exit(12);
    } else {
        flags |= MAP_ANONYMOUS;
    }
    void *p = mmap(NULL, s->len, s->prot, flags, fd, 0);
    /* A violator never gets here: SIGKILL lands before mmap returns to it. */
    int idx = i;
    if (write(held_w, &idx, sizeof(idx)) != sizeof(idx))
        _exit(13);
    if (read(release_r, &c, 1) != 1)
        _exit(14);
    _exit(p == MAP_FAILED ? 2 : 0);
}

static void reap(int n, int block)
{
    for (;;) {
        int st;
        pid_t p = waitpid(-1, &st, block ? 0 : WNOHANG);
        if (p <= 0)
            return;
        for (int i = 0; i < n; i++)
            if (pids[i] == p) {
                status_of[i] = st;
                done_of[i] = 1;
            }
        if (block)
            return;
    }
}

static void run_batch(int n)
{
    int ready[2], go[2], held[2], release[2];
    if (pipe(ready) || pipe(go) || pipe2(held, O_NONBLOCK) || pipe(release)) {
        printf("error pipe %s\n", strerror(errno));
        return;
    }
    memset(done_of, 0, sizeof(done_of));
    for (int i = 0; i < n; i++) {
        pid_t p = fork();
        if (p == 0) {
            close(ready[0]);
            close(go[1]);
            close(held[0]);
            close(release[1]);
            child(i, ready[1], go[0], held[1], release[0]);
        }
        pids[i] = p;
    }
    close(ready[1]);
    close(go[0]);
    close(held[1]);
    close(release[0]);
    char c;
    for (int i = 0; i < n; i++)
        if (read(ready[0], &c, 1) != 1) {
            printf("error a child died before it was ready\n");
            return;
        }
    printf("pids");
    for (int i = 0; i < n; i++)
        printf(" %d", pids[i]);
    printf("\n");

    char line[64];
    if (!fgets(line, sizeof(line), stdin) || strncmp(line, "go", 2))
        exit(3);
    for (int i = 0; i < n; i++)
        if (write(go[1], "g", 1) != 1)
            exit(4);
    int holding[MAX_BATCH] = {0}, nheld = 0;
    for (;;) {
        int idx;
        while (read(held[0], &idx, sizeof(idx)) == sizeof(idx))
            if (idx >= 0 && idx < n && !holding[idx]) {
                holding[idx] = 1;
                nheld++;
            }
        reap(n, 0);
        int dead = 0;
        for (int i = 0; i < n; i++)
            dead += done_of[i] && !holding[i];
        if (nheld + dead >= n)
            break;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    printf("held");
    for (int i = 0; i < n; i++)
        if (holding[i])
            printf(" %d", i);
    printf("\n");

    if (!fgets(line, sizeof(line), stdin) || strncmp(line, "release", 7))
        exit(5);
    for (int i = 0; i < n; i++)
        if (write(release[1], "x", 1) != 1)
            exit(6);
    for (int i = 0; i < n; i++)
        while (!done_of[i])
            reap(n, 1);
    for (int i = 0; i < n; i++) {
        int st = status_of[i];
        if (WIFSIGNALED(st))
            printf("status %d signal%d\n", pids[i], WTERMSIG(st));
        else
            printf("status %d exit%d\n", pids[i], WEXITSTATUS(st));
    }
    printf("done\n");
    close(ready[0]);
    close(go[1]);
    close(held[0]);
    close(release[1]);
}

int main(void)
{
    char line[1200];
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof(line), stdin)) {
        int n;
        if (!strncmp(line, "exit", 4))
            break;
        if (sscanf(line, "batch %d", &n) != 1 || n <= 0 || n > MAX_BATCH) {
            printf("error bad line: %s", line);
            continue;
        }
        for (int i = 0; i < n; i++) {
            struct spec *s = &specs[i];
            if (!fgets(line, sizeof(line), stdin) ||
                sscanf(line, "%511s %511s %3s %d %d %ld", s->cgroup, s->path, s->mode, &s->prot,
                       &s->flags, &s->len) != 6) {
                printf("error bad spec %d\n", i);
                exit(2);
            }
        }
        run_batch(n);
    }
    return 0;
}
