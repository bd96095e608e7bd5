// Does a fork, or its child, cost more while many children of the same parent are alive?
// Forks N children that stay (each writes 64 pages of a 4 MiB heap, then stops itself), prints
// the fork time per block of 512 and the children's CPU each (BENCHMARKS.md, section 21).
//   gcc -O2 -o /tmp/fork_live scripts/bench/fork_live.c && /tmp/fork_live 2048
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <signal.h>
#include <time.h>
#include <string.h>
#include <sys/wait.h>
#include <sys/resource.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
int main(int c,char**v){int n=atoi(v[1]);char*heap=malloc(4<<20);memset(heap,1,4<<20);
 pid_t*p=malloc(n*sizeof(pid_t));double t0=now();
 for(int i=0;i<n;i++){ if(i%512==0&&i){double t=now();fprintf(stderr,"%d..: %.1f us/fork\n",i-512,(t-t0)/512*1e6);t0=t;}
  pid_t k=fork(); if(k==0){for(int j=0;j<64;j++)heap[j*4096*8]=2; kill(getpid(),SIGSTOP); _exit(0);} p[i]=k;}
 double t=now();fprintf(stderr,"last block: %.1f us/fork\n",(t-t0)/512*1e6);
 for(int i=0;i<n;i++)kill(p[i],SIGKILL); for(int i=0;i<n;i++)waitpid(p[i],0,0); struct rusage r; getrusage(RUSAGE_CHILDREN,&r); fprintf(stderr,"children cpu %.1f us each\n",(r.ru_utime.tv_sec*1e6+r.ru_utime.tv_usec+r.ru_stime.tv_sec*1e6+r.ru_stime.tv_usec)/n); return 0;}
