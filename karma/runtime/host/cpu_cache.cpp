// karma's caching allocator for the CPU backend: see [Note: a caching allocator for the CPU
// backend] in karma/runtime/host/cpu_cache.py, which builds this file and drives it through ctypes.
//
// Tensors of kMinCachedBytes or more get memory this file maps itself. When PyTorch frees one,
// its pages are kept, as long as the bytes held (live and kept) stay within a limit: the
// schedule's planned peak. A request takes kept pages before fresh ones: a kept block of its
// size; else part of the smallest larger one; else larger kept blocks moved side by side with
// mremap, which moves page tables, not bytes ([Note: reshaping kept memory] in cpu_cache.py).
// Smaller tensors go to the allocator this one replaced (glibc's bins, which reuse them).
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <c10/util/env.h>

#include <pthread.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t kMinCachedBytes = 64 << 10;
constexpr size_t kPageBytes = 4096;
constexpr size_t kHugePageBytes = 2 << 20;
// The most mappings one block may be made of: a block made of more is built with fresh pages
// instead (each moved piece is a kernel mapping, and a process may have only so many).
constexpr size_t kMaxPieces = 64;

// Memory this file mapped: `bytes` at `addr`, made of pieces (their lengths, in address
// order), each inside one kernel mapping: mremap moves one mapping at a time.
struct Block {
  char* addr = nullptr;
  size_t bytes = 0;
  std::vector<size_t> pieces;
};

struct State {
  std::mutex mu;
  std::unordered_map<void*, Block> live;  // blocks PyTorch holds, by address
  std::multimap<size_t, Block> idle;      // freed blocks kept, by bytes
  size_t live_bytes = 0, idle_bytes = 0, limit_bytes = SIZE_MAX;
  size_t peak_bytes = 0;  // of live + idle
  uint64_t hits = 0;      // requests served from kept pages alone
  uint64_t misses = 0;    // requests that took fresh pages
  uint64_t released = 0;  // kept blocks given back to the system
  uint64_t reshaped = 0;  // requests served from kept blocks of another size
  uint64_t fresh_bytes = 0;
  bool caching = false;     // off: freed blocks go straight back
  bool huge_pages = false;  // THP_MEM_ALLOC_ENABLE, read as PyTorch's own allocator does
  c10::DeleterFnPtr fallback_deleter = nullptr;  // the replaced allocator's: small tensors
};

State& state() {
  static State* s = new State();  // never destroyed: blocks may be freed at exit
  return *s;
}

size_t rounded(size_t nbytes) {
  return (nbytes + kPageBytes - 1) / kPageBytes * kPageBytes;
}

size_t alignment(const State& s, size_t bytes) {
  return s.huge_pages && bytes >= kHugePageBytes ? kHugePageBytes : kPageBytes;
}

// Address space for `bytes`, aligned, with nothing in it yet: PROT_NONE is not data, so it
// does not count against `prlimit --data`. nullptr if the system refuses.
char* reserve(size_t bytes, size_t align) {
  size_t span = bytes + (align > kPageBytes ? align : 0);
  void* p = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  char* start = static_cast<char*>(p);
  char* begin = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(start) + align - 1) / align * align);
  if (begin > start) munmap(start, begin - start);
  if (start + span > begin + bytes) munmap(begin + bytes, start + span - (begin + bytes));
  return begin;
}

// Fresh pages over [addr, addr + bytes) of a reservation; false if the system refuses (a
// memory cap).
bool map_fresh(const State& s, char* addr, size_t bytes) {
  void* p = mmap(addr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) return false;
  if (s.huge_pages && bytes >= kHugePageBytes) madvise(addr, bytes, MADV_HUGEPAGE);
  return true;
}

// Cuts `block` after `head` bytes (a whole number of pages) and returns the rest.
Block split(Block& block, size_t head) {
  Block tail{block.addr + head, block.bytes - head, {}};
  std::vector<size_t> kept;
  size_t at = 0;
  for (size_t piece : block.pieces) {
    if (at + piece <= head) {
      kept.push_back(piece);
    } else if (at >= head) {
      tail.pieces.push_back(piece);
    } else {
      kept.push_back(head - at);
      tail.pieces.push_back(at + piece - head);
    }
    at += piece;
  }
  block.bytes = head;
  block.pieces = std::move(kept);
  return tail;
}

Block take_idle(State& s, std::multimap<size_t, Block>::iterator it) {
  Block block = std::move(it->second);
  s.idle.erase(it);
  s.idle_bytes -= block.bytes;
  return block;
}

void keep_idle(State& s, Block block) {
  s.idle_bytes += block.bytes;
  s.idle.emplace(block.bytes, std::move(block));
}

// Gives kept blocks back to the system, largest first, until `need` more bytes fit under
// the limit or nothing is kept. Called with the lock held.
void release_for(State& s, size_t need) {
  while (!s.idle.empty() && s.live_bytes + s.idle_bytes + need > s.limit_bytes) {
    Block block = take_idle(s, std::prev(s.idle.end()));
    munmap(block.addr, block.bytes);
    s.released += 1;
  }
}

void release_all(State& s) { release_for(s, SIZE_MAX / 2); }

void note_peak(State& s) {
  if (s.live_bytes + s.idle_bytes > s.peak_bytes) s.peak_bytes = s.live_bytes + s.idle_bytes;
}

[[noreturn]] void out_of_memory(size_t nbytes) {
  TORCH_CHECK_WITH(OutOfMemoryError, false,
                   "karma's CPU allocator: can't allocate memory: you tried to allocate ",
                   nbytes, " bytes. Error code ", errno, " (", std::strerror(errno), ")");
}

// The kept blocks a request of `bytes` is made of (removed from what is kept; a larger one
// cut, its rest kept): one of that size; else the first part of the smallest larger one;
// else the largest ones, while they have few pieces enough. Called with the lock held.
std::vector<Block> take_for(State& s, size_t bytes) {
  std::vector<Block> taken;
  auto fit = s.idle.lower_bound(bytes);
  if (fit != s.idle.end()) {
    taken.push_back(take_idle(s, fit));
  } else {
    size_t have = 0, pieces = 0;
    while (have < bytes && !s.idle.empty()) {
      auto largest = std::prev(s.idle.end());
      if (pieces + largest->second.pieces.size() > kMaxPieces) break;
      taken.push_back(take_idle(s, largest));
      have += taken.back().bytes;
      pieces += taken.back().pieces.size();
    }
  }
  size_t have = 0;
  for (const Block& block : taken) have += block.bytes;
  if (have > bytes) keep_idle(s, split(taken.back(), taken.back().bytes - (have - bytes)));
  return taken;
}

// One block of `bytes` at an address of its own: the taken blocks' pages moved there side by
// side, then fresh pages for the rest. Called with the lock held; on failure every page
// taken is given back and nullptr returned.
char* assemble(State& s, std::vector<Block>& taken, size_t bytes, std::vector<size_t>& pieces) {
  char* base = reserve(bytes, alignment(s, bytes));
  size_t at = 0;
  bool moved = base != nullptr;
  for (Block& block : taken) {
    size_t from = 0;
    for (size_t piece : block.pieces) {
      if (moved && mremap(block.addr + from, piece, piece, MREMAP_MAYMOVE | MREMAP_FIXED,
                          base + at) != MAP_FAILED) {
        pieces.push_back(piece);
        at += piece;
      } else {
        moved = false;
        munmap(block.addr + from, piece);
      }
      from += piece;
    }
  }
  if (moved && (at == bytes || map_fresh(s, base + at, bytes - at))) {
    if (at < bytes) pieces.push_back(bytes - at);
    return base;
  }
  if (base != nullptr) munmap(base, bytes);  // with what had moved there
  return nullptr;
}

void delete_block(void* ptr) {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  auto it = s.live.find(ptr);
  if (it == s.live.end()) {  // a small tensor's memory, freed through raw_deleter()
    lock.unlock();
    s.fallback_deleter(ptr);
    return;
  }
  Block block = std::move(it->second);
  s.live.erase(it);
  s.live_bytes -= block.bytes;
  if (s.caching && s.live_bytes + s.idle_bytes + block.bytes <= s.limit_bytes) {
    keep_idle(s, std::move(block));
    return;
  }
  lock.unlock();
  munmap(block.addr, block.bytes);
}

struct CachingCPUAllocator final : public c10::Allocator {
  c10::Allocator* fallback = nullptr;  // the allocator this one replaced: small tensors

  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < kMinCachedBytes) return fallback->allocate(nbytes);
    size_t bytes = rounded(nbytes);
    State& s = state();
    std::unique_lock<std::mutex> lock(s.mu);
    bool same_size = s.idle.count(bytes) > 0;
    std::vector<Block> taken = take_for(s, bytes);
    size_t reused = 0;
    for (const Block& block : taken) reused += block.bytes;
    s.live_bytes += reused;  // taken: now held, no longer kept
    Block block;
    if (taken.size() == 1 && reused == bytes) {
      block = std::move(taken.front());  // a kept block, or the first part of one
    } else {
      release_for(s, bytes - reused);
      block.bytes = bytes;
      block.addr = assemble(s, taken, bytes, block.pieces);
      if (block.addr == nullptr) {  // out of memory: give back all that is kept, once more
        s.live_bytes -= reused;     // assemble gave the taken pages back
        s.released += taken.size();
        reused = 0;
        release_all(s);
        std::vector<Block> none;
        block.pieces.clear();
        block.addr = assemble(s, none, bytes, block.pieces);
        if (block.addr == nullptr) out_of_memory(nbytes);
      }
      s.live_bytes += bytes - reused;
    }
    if (reused == bytes) s.hits += 1; else s.misses += 1;
    if (reused > 0 && !same_size) s.reshaped += 1;
    s.fresh_bytes += bytes - reused;
    void* ptr = block.addr;
    s.live.emplace(ptr, std::move(block));
    note_peak(s);
    return {ptr, ptr, &delete_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CachingCPUAllocator* installed = nullptr;

// A fork (a DataLoader worker) must not inherit the lock held by another thread.
void before_fork() { state().mu.lock(); }
void after_fork() { state().mu.unlock(); }

}  // namespace

extern "C" {

// Makes this the CPU allocator (once per process) and turns caching on under `limit_bytes`.
void karma_cache_install(uint64_t limit_bytes) {
  State& s = state();
  if (installed == nullptr) {
    installed = new CachingCPUAllocator();
    installed->fallback = c10::GetCPUAllocator();
    s.fallback_deleter = installed->fallback->raw_deleter();
    if (s.fallback_deleter == nullptr) s.fallback_deleter = &c10::free_cpu;
    s.huge_pages = c10::utils::check_env("THP_MEM_ALLOC_ENABLE").value_or(false);
    pthread_atfork(before_fork, after_fork, after_fork);
    c10::SetCPUAllocator(installed, /*priority=*/0);
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.caching = true;
  s.limit_bytes = limit_bytes;
  s.peak_bytes = s.live_bytes + s.idle_bytes;
  s.hits = s.misses = s.released = s.reshaped = s.fresh_bytes = 0;
  release_for(s, 0);
}

// Sets the limit, giving back at once what it no longer allows.
void karma_cache_limit(uint64_t limit_bytes) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.limit_bytes = limit_bytes;
  release_for(s, 0);
}

// Turns caching off and gives back every kept block; blocks still live stay valid.
void karma_cache_stop() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.caching = false;
  release_all(s);
}

// live, idle, peak (of live + idle), limit bytes; hits, misses, released blocks; requests
// served from kept blocks of another size; fresh bytes.
void karma_cache_stats(uint64_t* out) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  out[0] = s.live_bytes;
  out[1] = s.idle_bytes;
  out[2] = s.peak_bytes;
  out[3] = s.limit_bytes;
  out[4] = s.hits;
  out[5] = s.misses;
  out[6] = s.released;
  out[7] = s.reshaped;
  out[8] = s.fresh_bytes;
}

}  // extern "C"
