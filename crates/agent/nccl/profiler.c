/* nrun's NCCL profiler plugin: each rank's time in collectives on its GPU, for the watch's
 * straggler statistics, at no cost to the rank (no dump, no lock, no syscall per collective).
 *
 * NCCL (2.27 and later: API v4 and v5) loads it from NCCL_PROFILER_PLUGIN and calls it from the
 * rank's own threads: a collective's start on the thread that enqueues it, its kernel's
 * per-channel start and stop (GPU globaltimer stamps the kernel itself writes) on the proxy
 * thread. For each channel that stops, the plugin adds its kernel time over the collective's
 * channels to a counter in a file nrun's agent made (NRUN_NCCL_PROFILE, mapped shared), and a
 * collective's share to another: the agent reads them once a sample. A rank that waits for a
 * slow peer spends that wait inside the collective's kernel; the slow rank reaches the
 * collective last and hardly waits, so the rank with the least kernel time is the one the
 * others wait for.
 *
 * What the proxy thread changes lives in the channel's own handle, which the enqueuing thread
 * never writes: a collective's record is reused (RING) while its channels may still run.
 *
 * The file's layout (native endian) is read by crates/agent/src/gpu_time.rs; keep them alike:
 *   header, 64 bytes: magic u64, slots claimed u32
 *   SLOTS slots of 64 bytes: comm hash u64, rank i32, nranks i32, collectives u64 (in units
 *   of 1/65536: each channel adds its share), kernel ns u64, ready u32 (1 once the slot is
 *   filled in, by release; 0 again when NCCL finalizes the communicator)
 *
 * Only the parts of NCCL's structures that it reads are declared here, as NCCL publishes them
 * (ext-profiler/example/nccl/profiler_v5.h, profiler_v4.h). */
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

typedef enum { ncclSuccess = 0, ncclInternalError = 3 } ncclResult_t;
typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char* file, int line,
                                  const char* fmt, ...);

enum { ncclProfileGroup = 1 << 0, ncclProfileColl = 1 << 1, ncclProfileKernelCh = 1 << 6 };
enum { ncclProfilerKernelChStop = 22 };

typedef struct {
  uint64_t type;
  void* parentObj;
  int rank;
  union {
    struct {
      uint64_t seqNumber;
      const char* func;
      void const* sendBuff;
      void* recvBuff;
      size_t count;
      int root;
      const char* datatype;
      uint8_t nChannels;
      uint8_t nWarps;
      const char* algo;
      const char* proto;
      void* parentGroup;
    } coll;
    struct {
      uint8_t channelId;
      uint64_t pTimer;
    } kernelCh;
    /* The other events' descriptors, never read: room for the largest. */
    char others[96];
  };
} descr_v5;

/* v4's descriptor differs from v5's only in its first field, the type, one byte wide: the rest
 * lies at the same offsets, and is read through descr_v5. */
typedef struct {
  uint8_t type;
} descr_v4;

typedef union {
  struct {
    uint64_t pTimer;
  } kernelCh;
  char others[16];
} state_args_v5;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** context, uint64_t commId, int* eActivationMask,
                       const char* commName, int nNodes, int nranks, int rank,
                       ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void* context, void** eHandle, descr_v5* eDescr);
  ncclResult_t (*stopEvent)(void* eHandle);
  ncclResult_t (*recordEventState)(void* eHandle, int eState, state_args_v5* eStateArgs);
  ncclResult_t (*finalize)(void* context);
} profiler_v5;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** context, int* eActivationMask, const char* commName,
                       uint64_t commHash, int nNodes, int nranks, int rank,
                       ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void* context, void** eHandle, descr_v4* eDescr);
  ncclResult_t (*stopEvent)(void* eHandle);
  ncclResult_t (*recordEventState)(void* eHandle, int eState, state_args_v5* eStateArgs);
  ncclResult_t (*finalize)(void* context);
} profiler_v4;

#define MAGIC 0x3146525052554e4eULL /* "NNURPRF1" read as little-endian bytes */
#define SLOTS 16
#define HEADER 64
#define FILE_BYTES (HEADER + SLOTS * 64)
/* A collective's share of the collectives counter, split among its channels. */
#define ONE_COLL 65536u
/* Collectives a communicator enqueues before a record is reused. */
#define RING 256
#define CHANNELS 64

struct slot {
  uint64_t comm;
  int32_t rank;
  int32_t nranks;
  uint64_t colls;
  uint64_t kernel_ns;
  uint32_t ready;
  char pad[28];
};

/* Each handle starts with its type, so stopEvent knows what it stops. */
struct channel {
  uint64_t type;
  struct slot* slot;
  uint32_t of; /* the collective's channels; 0 once counted */
  uint64_t start;
  uint64_t stop;
};

struct coll {
  uint64_t type;
  struct slot* slot;
  uint32_t channels; /* written by the enqueuing thread, read by the proxy thread */
  struct channel ch[CHANNELS];
};

struct comm {
  struct slot* slot;
  uint64_t next;
  struct coll ring[RING];
};

/* NCCL 2.27 starts a collective's events only under a group event's handle. */
static uint64_t group_handle = ncclProfileGroup;

static char* mapped;

static void map_file(void) {
  const char* path = getenv("NRUN_NCCL_PROFILE");
  if (path == NULL || path[0] != '/') return;
  /* The agent made the file, private to this user; never one to create or follow here. */
  int fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
  struct stat st;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == getuid() &&
      st.st_size >= FILE_BYTES) {
    void* p = mmap(NULL, FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED && *(uint64_t*)p == MAGIC) mapped = p;
  }
  close(fd);
}

static ncclResult_t init(void** context, uint64_t commId, int* mask, const char* name, int nNodes,
                         int nranks, int rank, ncclDebugLogger_t log) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  (void)name, (void)nNodes, (void)log;
  *context = NULL;
  pthread_once(&once, map_file);
  /* NCCL keeps one mask for the whole process: every communicator asks for the same events,
   * and one without a slot (or without the file) has no context, so its events are ignored. */
  *mask = mapped == NULL ? 0 : ncclProfileColl | ncclProfileKernelCh;
  if (mapped == NULL) return ncclSuccess;
  uint32_t i = __atomic_fetch_add((uint32_t*)(mapped + 8), 1, __ATOMIC_RELAXED);
  if (i >= SLOTS) return ncclSuccess;
  struct comm* c = calloc(1, sizeof *c);
  if (c == NULL) return ncclSuccess;
  c->slot = (struct slot*)(mapped + HEADER + 64 * i);
  c->slot->comm = commId;
  c->slot->rank = rank;
  c->slot->nranks = nranks;
  __atomic_store_n(&c->slot->ready, 1, __ATOMIC_RELEASE);
  *context = c;
  return ncclSuccess;
}

static void start(struct comm* c, void** handle, uint64_t type, descr_v5* d) {
  if (type == ncclProfileGroup) {
    *handle = &group_handle;
  } else if (type == ncclProfileColl) {
    struct coll* r = &c->ring[c->next++ % RING];
    r->type = ncclProfileColl;
    r->slot = c->slot;
    __atomic_store_n(&r->channels, d->coll.nChannels, __ATOMIC_RELEASE);
    *handle = r;
  } else if (type == ncclProfileKernelCh && d->parentObj != NULL &&
             *(uint64_t*)d->parentObj == ncclProfileColl && d->kernelCh.channelId < CHANNELS) {
    struct coll* r = d->parentObj;
    struct channel* ch = &r->ch[d->kernelCh.channelId];
    ch->type = ncclProfileKernelCh;
    ch->slot = r->slot;
    ch->of = __atomic_load_n(&r->channels, __ATOMIC_ACQUIRE);
    ch->start = d->kernelCh.pTimer;
    ch->stop = 0;
    *handle = ch;
  }
}

static ncclResult_t start_event(void* context, void** handle, descr_v5* d) {
  *handle = NULL;
  if (context != NULL && d != NULL) start(context, handle, d->type, d);
  return ncclSuccess;
}

static ncclResult_t start_event_v4(void* context, void** handle, descr_v4* d) {
  *handle = NULL;
  if (context != NULL && d != NULL) start(context, handle, d->type, (descr_v5*)d);
  return ncclSuccess;
}

static ncclResult_t record_state(void* handle, int state, state_args_v5* args) {
  if (handle == NULL || args == NULL || *(uint64_t*)handle != ncclProfileKernelCh ||
      state != ncclProfilerKernelChStop)
    return ncclSuccess;
  ((struct channel*)handle)->stop = args->kernelCh.pTimer;
  return ncclSuccess;
}

static ncclResult_t stop_event(void* handle) {
  if (handle == NULL || *(uint64_t*)handle != ncclProfileKernelCh) return ncclSuccess;
  struct channel* ch = handle;
  uint32_t of = ch->of;
  ch->of = 0;
  if (of == 0 || of > CHANNELS || ch->stop <= ch->start) return ncclSuccess;
  __atomic_fetch_add(&ch->slot->kernel_ns, (ch->stop - ch->start) / of, __ATOMIC_RELAXED);
  __atomic_fetch_add(&ch->slot->colls, ONE_COLL / of, __ATOMIC_RELEASE);
  return ncclSuccess;
}

/* The records stay: with resources shared between communicators (NCCL's split-share) the proxy
 * thread can outlive this one, and a late channel event must not land in freed memory. At most
 * SLOTS are ever made. */
static ncclResult_t finalize(void* context) {
  struct comm* c = context;
  if (c != NULL) __atomic_store_n(&c->slot->ready, 0, __ATOMIC_RELEASE);
  return ncclSuccess;
}

static ncclResult_t init_v4(void** context, int* mask, const char* name, uint64_t commHash,
                            int nNodes, int nranks, int rank, ncclDebugLogger_t log) {
  return init(context, commHash, mask, name, nNodes, nranks, rank, log);
}

__attribute__((visibility("default"))) profiler_v5 ncclProfiler_v5 = {
    .name = "nrun",
    .init = init,
    .startEvent = start_event,
    .stopEvent = stop_event,
    .recordEventState = record_state,
    .finalize = finalize,
};

__attribute__((visibility("default"))) profiler_v4 ncclProfiler_v4 = {
    .name = "nrun",
    .init = init_v4,
    .startEvent = start_event_v4,
    .stopEvent = stop_event,
    .recordEventState = record_state,
    .finalize = finalize,
};
