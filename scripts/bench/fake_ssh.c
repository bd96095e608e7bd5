/* A stand-in for ssh in scripts/bench/tree.py: `ssh [opts] host command...` waits a set
 * handshake latency (FAKE_SSH_LATENCY_MS, sleeping), burns a set CPU time (FAKE_SSH_CPU_MS,
 * as a real ssh client's key exchange does on the host that runs it), logs who ran it
 * (FAKE_SSH_LOG: "host parent-is-an-nrun-agent"), then becomes the remote command on this
 * machine (sh -c command), so N "remote" nodes run here as local processes. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double cpu_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int parent_is_agent(void) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/cmdline", (int)getppid());
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    for (ssize_t i = 0; i < n; i++) if (buf[i] == 0) buf[i] = ' ';
    buf[n] = 0;
    return strstr(buf, "__agent") != NULL;
}

int main(int argc, char **argv) {
    /* ssh's options that take an argument. */
    const char *with_arg = "BbcDEeFIiJLlmOoPpQRSWw";
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (strcmp(argv[i], "--") == 0) { i++; break; }
        if (argv[i][1] && strchr(with_arg, argv[i][1]) && argv[i][2] == 0) i++;
    }
    if (i >= argc) { fprintf(stderr, "ssh: fake: no host\n"); return 255; }
    const char *host = argv[i++];
    size_t len = 1;
    for (int j = i; j < argc; j++) len += strlen(argv[j]) + 1;
    char *cmd = calloc(len, 1);
    for (int j = i; j < argc; j++) { strcat(cmd, argv[j]); if (j + 1 < argc) strcat(cmd, " "); }
    const char *lat = getenv("FAKE_SSH_LATENCY_MS"), *burn = getenv("FAKE_SSH_CPU_MS");
    double l = lat ? atof(lat) : 0, b = burn ? atof(burn) : 0;
    struct timespec ts = {(time_t)(l / 1e3), (long)((l - (long)(l / 1e3) * 1e3) * 1e6)};
    nanosleep(&ts, NULL);
    volatile unsigned long x = 0;
    double start = cpu_ms();
    while (cpu_ms() - start < b) x++;
    const char *log = getenv("FAKE_SSH_LOG");
    if (log) {
        int fd = open(log, O_WRONLY | O_APPEND | O_CREAT, 0644);
        if (fd >= 0) { dprintf(fd, "%s %d\n", host, parent_is_agent()); close(fd); }
    }
    if (cmd[0] == 0) return 0;
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    perror("ssh: fake: exec sh");
    return 255;
}
