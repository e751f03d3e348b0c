/* The data plane's constants and types (the ring's layout, a registration's Gate, a lane, a job,
 * the Engine and what it hands to the loop). A part of kvlane.c, which includes its parts once, in order. */

/* The ring's layout: kvserver/protocol/ring.py. */
#define HEADER_BYTES 64
#define SLOT_HEADER_BYTES 128
#define REQUEST_BYTES (64 * 1024)
#define RESPONSE_BYTES 1024
#define ERROR_BYTES (3 * 1024)
#define REQUEST_AT SLOT_HEADER_BYTES
#define RESPONSE_AT (REQUEST_AT + REQUEST_BYTES)
#define ERROR_AT (RESPONSE_AT + RESPONSE_BYTES)
#define SLOT_BYTES (ERROR_AT + ERROR_BYTES)
#define MAX_SLOTS 64
#define AWAKE_AT 32    /* ring header: nonzero while this thread looks at the slots unrung */
#define PLANE_AT 36    /* ring header: this thread reads the ring's submit doorbell: PLANE_* */
#define PLANE_ASLEEP 1  /* ... and sleeps in epoll_wait: a ring ahead of a call wakes it */
#define PLANE_RUNNING 2 /* ... and runs (copies, spins, serves): a ring ahead is not needed */
#define WAITING_AT 72  /* slot header: the client sleeps on the slot's done doorbell (quiet lanes) */
#define WAIT_END 2     /* ... for the call's end only: a step of it rings no one (ring_step) */
#define BUSY_AT 80     /* slot header: this thread's time on the call, in microseconds */
#define EXPIRES_AT 88  /* slot header: when the client stops waiting (CLOCK_MONOTONIC ns; 0: never) */
#define ST_SUBMITTED 1
#define ST_TAKEN 2
#define ST_DONE 3
#define RPC_PUT 3
#define RPC_GET 4
#define RPC_LOOKUP 7
#define RPC_WRITE_B 5
#define RPC_LOAD_B 6
#define RPC_COPIES_LAST 6 /* ids 1 to 6 name copies (Write, Load, Put, Get and the binary two: ring.py) */
#define FLAG_DONE 1
#define FLAG_JOB_ENDED 2
#define FLAG_PLANE_GET 4 /* a Get this thread served whole (try_get): its client's next one likely is too */
#define MAX_DRAIN 64
#define MAX_IDLE_RINGS 256       /* rings without a call taken, before a lane's doorbell is muted */
#define MUTE_NS 10000000LL      /* and for how long (its calls are then found 10 ms late at most) */
#define PIECE_BYTES (512 * 1024)
/* The thread's turns of the lanes (slots.h's lanes_turn): each pending lane's credit a turn, in
 * request bytes, and what a call costs besides its request's bytes. */
#define LANE_QUANTUM 1024
#define CALL_COST 64
/* Bytes of loads copied in a row while a write waited, after which the write gets a piece: the copy
 * workers' WRITE_EVERY pieces of CHUNK_BYTES (copies/workers.py), 16 MiB. A piece here is at most
 * one (layer, part) of a job, so a count of pieces would let a write into a small load. */
#define WRITE_EVERY_BYTES (16LL << 20)
#define WRITE_TURN_BYTES (2LL << 20) /* what writes then copy before loads go first again */
#define MAX_EDGES 32
/* An answering copy of at most this many bytes, submitted while the plane has no other job (so it
 * runs at once), publishes its first step (the pages found) without ringing, and rings a sleeping
 * waiter next a progress interval later or at its end, which comes within a few hundred
 * microseconds: one wake-up of the engine for a small Get, not one for its first step, one for
 * its first layer and one for its end. */
#define QUIET_FIRST_BYTES (1LL << 20)
/* The thread says it is awake (and looks at slots unrung) only while it spins with no copy to run,
 * and only while the watched lanes have at most this many slots: a look at every slot is a cache
 * and TLB miss each (a slot is 68 KiB), and a node of many idle lanes would make each look long. */
#define AWAKE_MAX_SLOTS 256

#define CODE_NOT_FOUND 5
#define CODE_RESOURCE_EXHAUSTED 8
#define CODE_DEADLINE 4
/* A write's status message when its copy ended past its write_by_ns (kvserver.errors.JobStopped's
 * "late", word for word). */
#define LATE_WRITE                                                                                 \
    "copy ended after its timeout_ms, when its engine may have given up on it and reused what it " \
    "read: nothing of it is kept"

/* ---- Gate: what the data plane may do for one registration ---------------------------------- */

/* Zeroed arrays that grow with a registration (a gate's marks, per page and per device token):
 * mapped, not allocated, so that making them clears nothing and a page of them costs only when
 * first touched. calloc serves a block under glibc's mmap ceiling (32 MiB) from the heap once its
 * sliding threshold has risen (a large free raises it) and clears it there: 80 MiB for a region of
 * 4 Mi pages, under the GIL. Under AddressSanitizer they are calloc'd: its guards are around heap
 * blocks, and mappings side by side would let an overrun of one land in the next unreported. */
#if defined(__SANITIZE_ADDRESS__)
#define KV_ZMAPPED 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KV_ZMAPPED 0
#endif
#endif
#ifndef KV_ZMAPPED
#define KV_ZMAPPED 1
#endif

static void *kv_zalloc(size_t n, size_t size) {
    if (n == 0 || size > SIZE_MAX / n)
        return NULL;
    if (!KV_ZMAPPED)
        return calloc(n, size);
    void *p = mmap(NULL, n * size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* Arrays to unmap, handed to a thread of their own: unmapping what a large registration touched
 * (80 MiB for 4 Mi pages) takes milliseconds, and the last reference to a gate goes on the loop. */
#define KV_ZMAX 8
typedef struct {
    int n;
    void *p[KV_ZMAX];
    size_t bytes[KV_ZMAX];
} kv_zbatch;

static void kv_zunmap_all(kv_zbatch *b) {
    for (int i = 0; i < b->n; i++)
        if (b->p[i]) {
            if (KV_ZMAPPED)
                munmap(b->p[i], b->bytes[i]);
            else
                free(b->p[i]);
        }
}

static void kv_zadd(kv_zbatch *b, void *p, size_t n, size_t size) {
    if (p && b->n < KV_ZMAX) {
        b->p[b->n] = p;
        b->bytes[b->n++] = n * size;
    }
}

static void *kv_zunmap_thread(void *arg) {
    kv_zunmap_all(arg);
    free(arg);
    return NULL;
}

/* Frees the batch's arrays: in a detached thread where they are mappings of over 1 MiB in all (or
 * here if no thread can be made). */
static void kv_zfree_batch(const kv_zbatch *b) {
    size_t total = 0;
    for (int i = 0; i < b->n; i++)
        total += b->bytes[i];
    if (KV_ZMAPPED && total > (1u << 20)) {
        kv_zbatch *copy = malloc(sizeof(*copy));
        pthread_attr_t attr;
        pthread_t t;
        if (copy && pthread_attr_init(&attr) == 0) {
            *copy = *b;
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            int rc = pthread_create(&t, &attr, kv_zunmap_thread, copy);
            pthread_attr_destroy(&attr);
            if (rc == 0)
                return;
        }
        free(copy);
    }
    kv_zunmap_all((kv_zbatch *)b);
}

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;       /* busy marks, ownership reads, counters, closed */
    pthread_mutex_t check_mu; /* the check's scratch marks */
    int closed;
    kv_limits lim;
    PyObject *owned_obj; /* keeps the allocator's bitmap alive */
    Py_buffer owned_view;
    int32_t *busy;          /* per page: copies of this plane using it */
    int32_t *wpages, *wdev; /* per page / device token: unfinished writes touching it */
    size_t page_marks, dev_marks; /* entries of the per-page and per-token arrays (kv_zalloc'd) */
    uint32_t generation;
    char *host_base;      /* the region's first page */
    int64_t page_bytes;   /* bytes of one host page (every layer and part) */
    int64_t token_bytes;  /* bytes of one token of one (layer, part) */
    int32_t parts;
    char **dev_bases;     /* [layer * parts + part] */
    int64_t dev_stride;   /* bytes between device tokens */
    int64_t py_inflight;  /* copies of this registration on the Python side */
    int64_t c_inflight;   /* jobs of this plane */
    int64_t x_inflight;   /* the loop's copies this plane runs for it (submit_copy) */
    uint64_t bytes_written, write_ops, bytes_loaded, load_ops, served;
    uint64_t lookup_hits, lookup_misses; /* of the Lookups answered and settled here (take_lookups) */
    int64_t last_call_ns;
    /* The plane thread's alone: what ``work()``'s pass over the jobs has seen of this gate so far. */
    uint64_t order_pass;
    int order_any, order_loads;
    /* Gets served whole on the plane (set_cache): its cache part (-1: none, every Get is the loop's),
     * the loop's name for it in their ends, its client id, its cache pages' (layer, part) chunk
     * stride, the most keys a Get may have, and the bytes from which the copy workers split a load
     * (0: never). */
    int32_t cache_gid;
    int64_t cache_token, cache_lp_stride, cache_max_keys, cache_split_bytes;
    char *client_id;
    uint64_t client_id_len;
    /* A space's gate (space_gate()): its lane carries a scheduler's Lookups of one whole space
     * (client_id holds the space id), walked in each of its nparts parts, space_gids (set_space;
     * cache_gid is the first); no pool, no copy, nothing else of this plane's. */
    int space;
    int32_t *space_gids;
    int32_t nparts;
    /* Free cache pages the loop set aside for this registration's Puts (Engine.stash): being
     * written, in no part, its tenant's; a Put of keys its part lacks takes them here (try_put).
     * The cache's lock guards them (the loop's stash and unstash, the plane's take). */
    int64_t *stash, nstash, capstash;
    int64_t stash_full; /* the pages the loop keeps it at (stash()) */
    int stash_short;    /* a Put a full stash would have held found it short (the loop fills it then) */
    /* A CUDA pool's gate (set_cuda): its Writes and Loads are put on the pool's stream through the
     * driver's entry points and completed by polling their events (cuda_jobs.h). */
    int cuda;
    kv_cuda_driver cu;
    void *cu_ctx, *cu_stream;
    void **cu_events;       /* the layer events: [slot * num_layers + local layer] */
    int64_t cu_host_shift;  /* added to a host address of the region: the GPU's address of it */
    int64_t cu_wait_ns;     /* no progress this long: the pool's GPU work is given up on */
    int64_t cu_max_copies, cu_min_copy_bytes, cu_small_copies; /* which jobs it takes (cuda_takes) */
    /* Driver calls it has on its stream for jobs not ended (the plane thread's alone), and the most
     * it may: a stream stalled behind an engine's event that never fires fills the driver's queue,
     * and a call into a full queue waits for room, which would hold this thread for every engine. */
    int64_t cu_queued, cu_max_queued;
    /* The copy kernel (set_cuda_kernels): its CUfunction per word (8, 4, 2, 1 bytes; NULL: none, a
     * job of many small rows is the loop's), and the pinned, mapped area its arguments go in (the
     * bases and offsets a job's launches read), a ring handed out in the gate's job order. */
    void *cu_kernels[4];
    char *cu_args;
    int64_t cu_args_bytes, cu_args_shift, cu_args_head, cu_args_tail; /* head, tail: bytes ever handed out / back */
    int32_t cu_max_blocks, cu_warps;
    unsigned char (*cu_ready)[64]; /* engines' ready events the loop opened (add_ready), under mu */
    void **cu_ready_ev;
    int cu_nready;
    char cu_failed[256];    /* why its GPU work is given up on (the plane's, set once, under mu) */
    uint64_t cu_jobs;        /* CUDA jobs the plane put on the stream whole (no driver call failed) */
    uint64_t cu_kernel_jobs; /* of those, the jobs copied by the copy kernel's launches */
} Gate;

/* ---- lanes, jobs, the engine ---------------------------------------------------------------- */

typedef struct Lane {
    int64_t key;
    char *ring;
    int slots;
    int submit_fd;
    int done_fd[MAX_SLOTS];
    Gate *gate; /* a reference, given back when the lane is removed */
    struct Lane *fresh_next; /* among Engine.fresh until watch_lane */
    int slot_busy[MAX_SLOTS]; /* taken here: a job, or handed to Python until finish_slot() */
    int watching;
    int quiet; /* the client said (FEATURE_QUIET_DONE) it sets WAITING_AT before it sleeps */
    int pending; /* it may have SUBMITTED slots: looked at in the thread's turns (lanes_turn) */
    int cursor;  /* the slot its next turn looks at first: the one after the last it took */
    int64_t credit; /* what its next calls may cost in the thread's turns (lanes_turn), in bytes */
    /* Rings read since its last call taken: a client rings once a call (and at most once ahead of
     * it), so past MAX_IDLE_RINGS its doorbell is not watched until muted_until (CLOCK_MONOTONIC
     * ns; 0: watched), and a peer ringing without end costs this thread a wake-up that long. */
    int64_t idle_rings, muted_until;
    struct Lane *next;
} Lane;

/* A run: ntok consecutive device tokens from dev_tok (each dev_stride bytes apart) and their host
 * rows, one after another from host_off. */
typedef struct {
    int64_t host_off; /* from the (layer, part) chunk's start in the region */
    int64_t dev_tok;
    int64_t ntok;
} Run;

typedef struct Job {
    struct Job *next; /* arrival order */
    Lane *lane;
    int slot;
    Gate *gate;
    int load, dependent;
    int64_t npages, *pages;
    int64_t nruns;
    Run *runs;
    uint32_t nl;
    int32_t *local;
    int64_t arrival_ns, deadline_ns, bytes_per_layer;
    /* A write (device to host) whose copy ends after this (CLOCK_MONOTONIC ns; 0: never) is not
     * done (finish): its engine gives up on the call by then and may reuse the device pages the
     * copy still reads (a daemon stopped mid-copy, then resumed), so what it copied may be torn.
     * Its deadline, or its client's expiry word if sooner; a loop's copy's, the loop's deadline. */
    int64_t write_by_ns;
    int released;  /* its gate closed: it ends at its next layer boundary */
    uint32_t li;   /* layers done */
    int part;      /* within the current layer */
    int64_t ri;    /* next run within the current (layer, part) */
    uint32_t step; /* progress updates published */
    uint32_t published; /* layers the slot's progress words say */
    int64_t last_pub_ns;
    int64_t ndev;  /* device tokens (the runs cover them) */
    char *host;        /* where the host rows' (layer 0, part 0) chunk starts */
    int64_t lp_stride; /* bytes from one (layer, part) chunk of the host rows to the next */
    /* The loop's copies (submit_copy): no slot; its stop word is read at layer boundaries, a
     * load's layers go to its progress word and eventfd, and its end is posted back (Done). */
    int ext;
    uint64_t seq; /* its place in the plane's arrival order (writes take turns by it) */
    uint64_t ticket;
    int64_t *progress;
    int signal_fd;
    int64_t interval_ns;
    const int64_t *stop;
    /* A loop's copy that also answers its lane slot (submit_copy's lane and slot: a Get the loop
     * planned): its layers and end are published in the slot as a plane Load's are, with `found`
     * in the pages word, and its end is posted back as every loop's copy's is. */
    int answers;
    int counted; /* its request's count in the gate's py_inflight, given back as it joins the jobs */
    uint32_t found;
    int stream; /* streaming stores (stream.h): a write, or a load of KV_STREAM_MIN_JOB bytes or more */
    int can_run; /* set by mark_runnable(): no earlier job of its gate holds it back */
    /* A Get the plane serves whole (try_get): an answering load whose host rows are cache pages it
     * holds, ids[0..found); its end goes back to the loop with them (GetEnd), which lets them go. */
    int get;
    int64_t *ids, misses;
    int end_kind; /* not a Get: what its end is (END_LOOKUP, END_PUT, END_LOOKUP_HOST: try_answer) */
    /* A Put the plane stores (try_put): a write into the stash's pages ids[0..nids) of the keys
     * its part lacked (words, KV_KEY_WORDS a key, key_len bytes each), `misses` the keys present
     * already; filed under the part once copied (finish_put). */
    int store;
    int64_t nids;
    uint64_t *words;
    uint8_t key_len;
    /* A CUDA job (its gate's set_cuda): put on the pool's stream whole as it is taken (cuda_issue),
     * then its events polled (cuda_poll): a load's layer events of slot cu_slot, a write's cu_done. */
    int cuda;
    int cu_quiet;   /* its slot answered already (given up on), or its lane gone: nothing more is written there */
    int cu_stalled; /* its GPU work given up on: it keeps its pages until its gate closes */
    int cu_error;   /* the CUresult that failed while it was put on the stream; cu_done is then a marker */
    uint32_t cu_slot;
    void *cu_ready, *cu_done;
    int64_t cu_progress_ns; /* its last progress: nothing for the gate's cu_wait_ns gives it up */
    int64_t cu_ops;         /* the driver calls it puts on the stream (counted in cu_queued until it ends) */
    int cu_kernel;          /* its copies are the copy kernel's launches, their arguments in the gate's area */
    int64_t cu_args_want, cu_args_pos; /* the span cuda_takes found room for (padding included), where
                                        * in the area its arguments start */
    int64_t cu_args_at, cu_args_len;   /* its span once launched: from ring position cu_args_at */
    uint32_t recorded;      /* slot word 48: a load's layer events are recorded */
} Job;

/* The latency histograms the plane keeps: Write, Load, Load's first layer, Get, Get's first layer,
 * Lookup, Put (of keys all stored already, or stored here). */
enum { H_WRITE, H_LOAD, H_FIRST, H_GET, H_GET_FIRST, H_LOOKUP, H_PUT, H_KINDS };

typedef struct {
    uint64_t ticket;
    int status; /* DONE_OK, DONE_STOPPED (its stop word), DONE_RELEASED (its gate closed), DONE_HALTED */
    uint32_t layers;
} Done;

enum { DONE_OK, DONE_STOPPED, DONE_RELEASED, DONE_HALTED, DONE_LATE /* a write ended past write_by_ns */ };

typedef struct {
    int64_t lane_key;
    int slot;
    uint32_t rpc; /* the call the plane read from the slot, which the loop serves (never read again) */
    int counted;  /* in its gate's py_inflight: a copy (handoff()) */
} Handoff;

/* The end of a Get the plane served whole: what the loop settles (take_gets): its pages' holds and
 * LRU touch, the misses, the bytes. ids is the job's, handed over. */
typedef struct {
    int64_t token, found, misses, nbytes;
    int64_t *ids, nids; /* found of them; a space's Lookup: found of each part, part after part */
    int32_t gid;
    int status; /* DONE_OK, DONE_RELEASED (its gate closed), DONE_HALTED (a deadline, the plane stopped) */
    uint32_t layers;
    int kind; /* END_GET (its pages are held), END_LOOKUP (made recent), END_PUT (all present),
               * END_LOOKUP_HOST (a Lookup of host memory only: made recent, no tier's copies),
               * END_STORE (a Put stored here: ids[0..found) filed and held, ids[found..nids) the
               * stash's pages it did not file, `misses` its keys present already) */
} GetEnd;

enum { END_GET, END_LOOKUP, END_PUT, END_LOOKUP_HOST, END_STORE };

enum { CMD_NONE, CMD_ADD, CMD_REMOVE, CMD_CLOSE_GATE, CMD_UNWATCH_ALL, CMD_PAUSE, CMD_RESUME, CMD_STOP };

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int started;
    int epfd, wake_fd, notify_fd;
    int paused; /* tests: requests are taken, no copy runs */
    int drained; /* unwatch_all ran (the daemon's stop): no lane is watched from then on */
    int64_t progress_interval_ns;
    int64_t spin_ns;  /* after a request or a job, how long it looks again before it sleeps */
    int awake;        /* the lanes' AWAKE_AT words say 1: clients submit without ringing */
    uint32_t plane_state; /* what the watched lanes' PLANE_AT words say: PLANE_ASLEEP or PLANE_RUNNING */
    int watched_slots; /* the slots of the lanes whose doorbells it watches */
    Lane *lanes;     /* changed by the thread alone (its commands), under lanes_mu */
    Lane *fresh;     /* made by new_lane, not yet given to the thread (watch_lane): under the GIL */
    pthread_mutex_t lanes_mu; /* the lane list read off the thread (lane_of): a command runs while
                               * the loop goes on (DataPlane's command thread waits for it) */
    Job *jobs;
    int64_t njobs;
    /* commands: one at a time (call_mu), acknowledged through cmd_cv; none runs once the thread
     * stops (started 2, set under call_mu) */
    pthread_mutex_t call_mu, cmd_mu;
    pthread_cond_t cmd_cv;
    int cmd, cmd_done;
    void *cmd_arg;
    int cmd_errno; /* what the command did: an add's errno (0: watched), read under call_mu */
    /* A command waits (set before its wake-up, cleared as the thread takes it): the thread stops
     * its turn of the lanes at the next lane, and reads no doorbell, until it has run it, so that
     * the loop, which waits for it, never waits for a turn of every lane (cmd_waiting()). The
     * lanes it left are still pending; the next turn starts at the one it stopped at. */
    int cmd_waiting;
    int npending;   /* lanes pending (Lane.pending) */
    int nmuted;     /* lanes whose doorbell is muted (Lane.muted_until) */
    uint64_t mutes; /* doorbells muted for rings without calls (the tests') */
    Lane *turn_at;  /* where the next turn starts (NULL: the first lane; remove_lane moves it on) */
    uint64_t cmd_cuts; /* turns cut short for a command (the tests') */
    int64_t cmd_delay_ns; /* the tests': the thread waits this long before it takes a command, as one
                           * that gets no CPU for that long */
    uint64_t naps;     /* naps taken for CUDA jobs waiting on the GPU (the tests') */
    /* handoffs to Python */
    pthread_mutex_t hand_mu;
    Handoff *hand;
    size_t nhand, caphand;
    uint64_t handed, served;
    /* the loop's copies: submitted (in_mu) until the thread takes them; their ends, under hand_mu,
     * with room kept for every copy not yet posted (so a post never needs memory) */
    uint64_t next_seq, last_write; /* the arrival order; the write that last copied a piece */
    int64_t loads_in_a_row;        /* bytes of loads copied in a row while a write waited */
    int64_t write_credit;          /* bytes the waiting writes may still copy ahead of loads */
    uint64_t write_turns;          /* write pieces run ahead of waiting loads (WRITE_EVERY_BYTES) */
    pthread_mutex_t in_mu;
    Job *incoming;
    int nincoming;
    Done *done;
    size_t ndone, capdone, unposted;
    /* Gets served whole here (set_cache): the cache they walk, and their ends, under hand_mu, with
     * room kept for every one not yet posted */
    Cache *cache;
    GetEnd *gets;
    size_t ngets, capgets, unposted_gets;
    uint64_t plane_gets;    /* Gets served whole here, counted as they are taken */
    uint64_t plane_lookups; /* Lookups likewise (a space's among them) */
    uint64_t plane_space_lookups; /* of those, a scheduler's of a whole space (its space's lane) */
    uint64_t plane_puts;    /* Puts of keys all stored already, likewise */
    uint64_t plane_stores;  /* Puts that stored pages here (try_put), counted as they are answered */
    int64_t cu_progress_ns; /* when a CUDA job was last put on a stream or moved on (its polls' pace) */
    int64_t cu_queued;      /* driver calls on every gate's stream for jobs not ended (CU_PLANE_QUEUED_MAX) */
    /* latency histograms, as kvserver_operation_duration_seconds and
     * kvserver_time_to_first_layer_seconds count them (H_WRITE...) */
    pthread_mutex_t stat_mu;
    int nedges;
    double edges[MAX_EDGES];
    uint64_t hist[H_KINDS][MAX_EDGES + 1];
    double hsum[H_KINDS];
} Engine;

/* Whether the loop waits for a command of this thread (run_command). */
static inline int cmd_waiting(Engine *e) { return __atomic_load_n(&e->cmd_waiting, __ATOMIC_ACQUIRE); }
