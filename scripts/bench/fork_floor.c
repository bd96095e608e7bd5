// Forks N children that exit at once (at most 64 at once): the floor of an agent forked without
// exec, beside spawn_floor.c. Usage: fork_floor N
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/wait.h>
int main(int argc, char **argv) {
  int n = atoi(argv[1]), running = 0, started = 0;
  while (started < n || running > 0) {
    while (started < n && running < 64) {
      pid_t p = fork(); if (p < 0) { perror("fork"); return 1; }
      if (p == 0) _exit(0);
      started++; running++;
    }
    int st; if (wait(&st) > 0) running--;
  }
  return 0;
}
