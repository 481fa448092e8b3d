/* fd_holder.c: processes that hold many open files and do nothing else (the
 * sandbox's cost must not follow them). Usage: fd_holder N FDS FILES DIR:
 * forks N children that each open FDS fds over the files DIR/f0..f<FILES-1>
 * (round robin) and wait; prints each child's pid on a line, then "ready"
 * once all of them opened their files, then waits to be killed (its children
 * die with it: PR_SET_PDEATHSIG). */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 5)
        return 1;
    int n = atoi(argv[1]), fds = atoi(argv[2]), files = atoi(argv[3]);
    int ready[2];
    if (pipe(ready))
        return 1;
    for (int i = 0; i < n; i++) {
        pid_t p = fork();
        if (p < 0)
            return 2;
        if (p == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            char path[4096];
            for (int j = 0; j < fds; j++) {
                snprintf(path, sizeof(path), "%s/f%d", argv[4], j % files);
                if (open(path, O_RDONLY) < 0)
                    _exit(3);
            }
            if (write(ready[1], "r", 1) != 1)
                _exit(4);
            for (;;)
                pause();
        }
        printf("%d\n", p);
    }
    fflush(stdout);
    char c;
    for (int i = 0; i < n; i++)
        if (read(ready[0], &c, 1) != 1)
            return 5;
    printf("ready\n");
    fflush(stdout);
    for (;;)
        pause();
}
