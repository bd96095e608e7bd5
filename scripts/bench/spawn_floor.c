// Spawns N copies of argv[2..] (at most 64 at once) and waits for all: a floor for starting N processes.
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
extern char **environ;
int main(int argc, char **argv) {
  int n = atoi(argv[1]), running = 0, started = 0;
  while (started < n || running > 0) {
    while (started < n && running < 64) {
      pid_t p; if (posix_spawn(&p, argv[2], NULL, NULL, argv + 2, environ) != 0) { perror("spawn"); return 1; }
      started++; running++;
    }
    int st; if (wait(&st) > 0) running--;
  }
  return 0;
}
