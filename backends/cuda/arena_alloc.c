/* graphslot arena allocator: the malloc/free pair that torch's pluggable-allocator
 * interface (torch.cuda.memory.CUDAPluggableAllocator) loads for a torch.cuda.MemPool.
 *
 * It hands out byte ranges of *regions*: virtual address ranges that graphslot reserved
 * and maps itself. It never touches the memory and makes no CUDA call, so it is safe to
 * run during stream capture and needs no CUDA headers (the stream is an opaque pointer).
 *
 * Allocation goes to the one *active* region, which Python sets around a graph capture
 * (torch allows one capture at a time per process, and a graph's private pool only grows
 * while it is being captured into). With no active region, or no gap large enough,
 * gs_malloc returns NULL and torch raises its out-of-memory error; the region remembers
 * the failed request so Python can say what did not fit. Frees find their region by
 * address, whichever region is active. Placement is first fit over a sorted block list:
 * torch asks for a few large segments per pool, so the lists stay short. A region whose
 * owner went away is *retired*: it takes no new allocations, no longer blocks a new
 * region over the same addresses, and is forgotten when torch frees its last block.
 *
 * Built by backends/cuda/pool.py with the system C compiler at first use.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GS_MAX_REGIONS 4096

typedef struct {
    size_t off;
    size_t size;
} gs_block;

typedef struct {
    int in_use;
    int retired; /* no new allocations; forgotten once its last block is freed */
    uintptr_t base;
    size_t size;
    size_t align;
    gs_block *blocks; /* sorted by off, non-overlapping */
    size_t nblocks;
    size_t cap;
    size_t live;   /* bytes handed out and not freed */
    size_t high;   /* highest end offset ever handed out */
    size_t failed; /* size of the last request that did not fit, 0 if none */
    size_t nallocs;
    size_t nfrees;
} gs_region;

static gs_region regions[GS_MAX_REGIONS];
static int active = -1;
static size_t unrouted;      /* gs_malloc calls with no active region */
static size_t foreign_frees; /* gs_free calls for an address outside every region */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static int valid_id(int id) { return id >= 0 && id < GS_MAX_REGIONS && regions[id].in_use; }

/* Register [base, base + size); returns the region id, -1 for bad arguments, -2 when the
 * range overlaps a registered region, -3 when every slot is taken. */
int gs_region_add(uintptr_t base, size_t size, size_t align) {
    int id = -3;
    if (base == 0 || size == 0 || align == 0 || (align & (align - 1)) || base % align)
        return -1;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < GS_MAX_REGIONS; i++) {
        gs_region *r = &regions[i];
        if (r->in_use) {
            if (!r->retired && base < r->base + r->size && r->base < base + size) {
                id = -2;
                break;
            }
        } else if (id == -3) {
            id = i;
        }
    }
    if (id >= 0) {
        gs_region *r = &regions[id];
        memset(r, 0, sizeof *r);
        r->in_use = 1;
        r->base = base;
        r->size = size;
        r->align = align;
    }
    pthread_mutex_unlock(&lock);
    return id;
}

/* Forget a region; returns 0, -1 for an unknown id, -2 while blocks are still live. */
int gs_region_remove(int id) {
    int rc = 0;
    pthread_mutex_lock(&lock);
    if (!valid_id(id)) {
        rc = -1;
    } else if (regions[id].nblocks) {
        rc = -2;
    } else {
        free(regions[id].blocks);
        memset(&regions[id], 0, sizeof regions[id]);
        if (active == id)
            active = -1;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* Retire a region (see the top comment). Returns 0 when it was forgotten at once, 1 when
 * blocks are still live, -1 for an unknown id. */
int gs_region_retire(int id) {
    int rc = -1;
    pthread_mutex_lock(&lock);
    if (valid_id(id)) {
        gs_region *r = &regions[id];
        if (active == id)
            active = -1;
        if (r->nblocks) {
            r->retired = 1;
            rc = 1;
        } else {
            free(r->blocks);
            memset(r, 0, sizeof *r);
            rc = 0;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* Make `id` the region gs_malloc draws from (-1: none). Returns 0, or -1 for an unknown
 * or retired id, or -2 when another region is active already (a capture is under way). */
int gs_region_activate(int id) {
    int rc = 0;
    pthread_mutex_lock(&lock);
    if (id == -1) {
        active = -1;
    } else if (!valid_id(id) || regions[id].retired) {
        rc = -1;
    } else if (active != -1 && active != id) {
        rc = -2;
    } else {
        active = id;
        regions[id].failed = 0;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

int gs_active(void) {
    pthread_mutex_lock(&lock);
    int id = active;
    pthread_mutex_unlock(&lock);
    return id;
}

/* out[0..5] = live, high, nblocks, failed, nallocs, nfrees. Returns 0, or -1 for an
 * unknown id. */
int gs_region_stats(int id, size_t *out) {
    int rc = -1;
    pthread_mutex_lock(&lock);
    if (valid_id(id)) {
        gs_region *r = &regions[id];
        out[0] = r->live;
        out[1] = r->high;
        out[2] = r->nblocks;
        out[3] = r->failed;
        out[4] = r->nallocs;
        out[5] = r->nfrees;
        rc = 0;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* out[0..1] = allocations with no active region, frees of unknown addresses. */
void gs_global_stats(size_t *out) {
    pthread_mutex_lock(&lock);
    out[0] = unrouted;
    out[1] = foreign_frees;
    pthread_mutex_unlock(&lock);
}

static int insert_block(gs_region *r, size_t at, size_t off, size_t size) {
    if (r->nblocks == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 16;
        gs_block *b = realloc(r->blocks, cap * sizeof *b);
        if (!b)
            return -1;
        r->blocks = b;
        r->cap = cap;
    }
    memmove(&r->blocks[at + 1], &r->blocks[at], (r->nblocks - at) * sizeof *r->blocks);
    r->blocks[at].off = off;
    r->blocks[at].size = size;
    r->nblocks++;
    return 0;
}

void *gs_malloc(size_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    void *ptr = NULL;
    pthread_mutex_lock(&lock);
    if (active < 0) {
        unrouted++;
        pthread_mutex_unlock(&lock);
        return NULL;
    }
    gs_region *r = &regions[active];
    size_t want = align_up(size ? size : 1, r->align);
    size_t prev_end = 0, at = r->nblocks, off = 0;
    int found = 0;
    for (size_t i = 0; i <= r->nblocks; i++) {
        size_t start = align_up(prev_end, r->align);
        size_t limit = i < r->nblocks ? r->blocks[i].off : r->size;
        if (start <= limit && want <= limit - start) {
            at = i;
            off = start;
            found = 1;
            break;
        }
        if (i < r->nblocks)
            prev_end = r->blocks[i].off + r->blocks[i].size;
    }
    if (found && insert_block(r, at, off, want) == 0) {
        r->live += want;
        r->nallocs++;
        if (off + want > r->high)
            r->high = off + want;
        ptr = (void *)(r->base + off);
    } else {
        r->failed = size;
    }
    pthread_mutex_unlock(&lock);
    return ptr;
}

void gs_free(void *ptr, size_t size, int device, void *stream) {
    (void)size;
    (void)device;
    (void)stream;
    uintptr_t p = (uintptr_t)ptr;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < GS_MAX_REGIONS; i++) {
        gs_region *r = &regions[i];
        if (!r->in_use || p < r->base || p >= r->base + r->size)
            continue;
        size_t off = p - r->base, lo = 0, hi = r->nblocks;
        while (lo < hi) { /* first block with block.off >= off */
            size_t mid = (lo + hi) / 2;
            if (r->blocks[mid].off < off)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo < r->nblocks && r->blocks[lo].off == off) {
            r->live -= r->blocks[lo].size;
            r->nfrees++;
            memmove(&r->blocks[lo], &r->blocks[lo + 1], (r->nblocks - lo - 1) * sizeof *r->blocks);
            r->nblocks--;
            if (r->retired && r->nblocks == 0) {
                free(r->blocks);
                memset(r, 0, sizeof *r);
            }
            pthread_mutex_unlock(&lock);
            return;
        }
        /* not here: a retired region may overlap a newer one, so keep looking */
    }
    foreign_frees++;
    pthread_mutex_unlock(&lock);
}
